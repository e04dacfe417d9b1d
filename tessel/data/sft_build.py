"""`data.source = "sft"`: fine-tuning records rendered, tokenized and packed once into the
data cache, then read back (verified) as the train and validation `SFTDataset`s.

A cache entry `sft-KEY/` is keyed by the content (sha256) of every input file, the
tokenizer, the chat template and its special tokens, train.seq_len, the split and the SFT
options, so changing any of them builds a new entry and nothing stale is ever read. It holds
one `.npy` file per array (read without pickle), the tokenizer, and `manifest.json` with each
file's sha256 and the packing counts; the entry is built in a temporary directory and
renamed (`build_once`), so it is complete or absent. Opening it checks every checksum: a
damaged entry is said in one line and rebuilt, never used.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tessel.config import DataConfig
from tessel.data.cache import build_once
from tessel.data.chat_template import ChatTemplate, resolve_template
from tessel.data.dataset import split_ranges
from tessel.data.sft import (
    Packed,
    PackStats,
    SFTDataset,
    assistant_spans,
    chat_encoder,
    fit,
    learned_example,
    pack,
    to_messages,
)
from tessel.data.sft_prepare import Preparation
from tessel.data.tokenizer import Tokenizer, load_tokenizer, train_bpe
from tessel.errors import DataError
from tessel.fileio import write_text_atomic

FORMAT = 3
"""Bumped when what is cached changes meaning; part of the key (2: a reply starting with
"<", or an empty one, learns its first / end-of-turn token; 3: text that is not UTF-8 is
replaced string by string and counted, mostly invalid strings refused)."""
_MANIFEST = "manifest.json"
_SPLITS = ("train", "val")
_ARRAYS = ("tokens", "learned", "docs")
_ENCODE_BATCH = 1024


@dataclass
class SFTCorpus:
    """The opened cache entry."""

    train: SFTDataset
    val: SFTDataset | None
    tokenizer: Tokenizer
    stats: dict[str, float]
    """Counts and fractions (train split): examples, truncated, dropped, samples,
    packing_efficiency, learned_fraction."""
    summary: str
    """The one start-up line."""
    template: ChatTemplate
    """The chat template the conversations were rendered with."""


def _file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _tokenizer_dir(spec: str) -> Path | None:
    path = Path(spec)
    return path.parent if path.is_file() else None


def template_tokens(template: ChatTemplate) -> tuple[str, ...]:
    """The `<|...|>` markers a template writes literally (ChatML's <|im_start|>, say): the
    special tokens of a BPE tessel trains for it, so each is one token."""
    return tuple(sorted(set(re.findall(r"<\|[A-Za-z0-9_]+\|>", template.source))))


def sft_key(files: list[Path], tok_identity: str, template: ChatTemplate, seq_len: int,
            d: DataConfig) -> str:
    """The cache key: everything the packed samples depend on."""
    h = hashlib.sha256(json.dumps([
        FORMAT, tok_identity, template.source, template.bos_token, template.eos_token,
        seq_len, d.sft_overlong, d.sft_pack, list(d.split_fractions()),
        *([template.others] if template.others else []),  # pad_token, ... (when named)
    ]).encode())
    for f in files:
        h.update(_file_hash(f).encode())
    return h.hexdigest()[:16]


def ensure_sft(d: DataConfig, seq_len: int, vocab_size: int, cache: Path,
               console: Callable[[str], None] = print,
               progress: Callable[[str], None] | None = None) -> SFTCorpus:
    """The cached, verified SFT corpus for `data.*`; built on first use (`progress`: where
    the progress lines of a long preparation go, stderr by default)."""
    from tessel.data.readers import resolve_inputs

    try:
        files = resolve_inputs(list(d.paths))
    except DataError as exc:
        raise DataError(f"{exc}; fix data.paths") from None
    if d.tokenizer == "auto":  # a byte-level BPE trained on the rendered conversations
        tok: Tokenizer | None = None
        tok_identity = f"bpe:{vocab_size}:{d.eod_token}"
        eos = "<|endoftext|>"
    else:
        tok = load_tokenizer(d.tokenizer, d.eod_token)
        tok_identity = f"{tok.fingerprint()}:{d.eod_token}"
        eos = str(tok.hf.id_to_token(tok.eod_id))
    template = resolve_template(d.chat_template, _tokenizer_dir(d.tokenizer), eos)
    target = cache / f"sft-{sft_key(files, tok_identity, template, seq_len, d)}"
    if (target / _MANIFEST).is_file():
        try:
            return _open(target, seq_len, template)
        except DataError as exc:
            console(f"tessel: {exc}; rebuilding it")
            shutil.rmtree(target, ignore_errors=True)
    console(f"tessel: preparing fine-tuning data from {len(files)} file(s) once, template "
            f"{template.origin} (cached in {target})")
    # Everything is computed in memory first: the temporary directory of the entry exists
    # only while the finished arrays are written, so nothing is left behind by a refusal, a
    # signal, or a process killed while it renders or trains its tokenizer.
    prep = Preparation(template.origin, progress)
    prepared = _prepare(files, tok, template, seq_len, vocab_size, d, prep)
    build_once(target, lambda tmp: _write(tmp, *prepared, template, seq_len, d),
               marker=_MANIFEST)
    return _open(target, seq_len, template)


def _render_all(files: list[Path], template: ChatTemplate, prep: Preparation, read: Any
                ) -> list[tuple[str, list[tuple[int, int]]]]:
    """Every record's conversation rendered, with its assistant spans (see `Preparation`
    for the bounds and the progress lines)."""
    from tessel.data.readers import iter_json_records

    rendered = []
    for where, obj in iter_json_records(files, read):
        messages = to_messages(obj, where)
        began = time.monotonic()
        text, spans = assistant_spans(template, messages, where)
        prep.rendered_one(messages, text, time.monotonic() - began)
        rendered.append((text, spans))
    return rendered


def _prepare(files: list[Path], tok: Tokenizer | None, template: ChatTemplate, seq_len: int,
             vocab_size: int, d: DataConfig, prep: Preparation
             ) -> tuple[Tokenizer, dict[str, tuple[Packed, PackStats]], Any]:
    """The tokenizer, each split's packed samples with their counts, and the read counts."""
    from tessel.data.readers import ReadStats

    read = ReadStats()
    rendered = _render_all(files, template, prep, read)
    if not rendered:
        raise DataError(f"data.paths {list(d.paths)} hold no records")
    if not any(spans for _, spans in rendered):
        # training would run on a loss of 0 (and validation divide by no target)
        raise DataError(
            f"nothing to learn: the chat template ({template.origin}) writes no character of "
            f"an assistant reply in any of the {len(rendered):,} conversations (it leaves the "
            "assistant turns out, or renders the same text whatever they say); use a "
            "data.chat_template that writes them")
    if tok is None:
        doing = (f"training a tokenizer on {len(rendered):,} conversations "
                 f"({prep.rendered / 1e6:,.1f} MB)")
        tok = train_bpe((text for text, _ in rendered), vocab_size,
                        special_tokens=template_tokens(template), waiting=lambda: prep.tick(doing))
    hf = chat_encoder(tok)
    examples = []
    for lo in range(0, len(rendered), _ENCODE_BATCH):  # the library encodes a batch in parallel
        chunk = rendered[lo:lo + _ENCODE_BATCH]
        encodings = hf.encode_batch([text for text, _ in chunk], add_special_tokens=False)
        examples += [learned_example(enc, spans) for enc, (_, spans) in zip(encodings, chunk)]
        prep.tick(f"{lo + len(chunk):,} of {len(rendered):,} conversations tokenized")
    length = seq_len + 1
    splits = {}
    for name, (lo, hi) in zip(_SPLITS, split_ranges(len(examples), d.split_fractions())):
        stats = PackStats()
        kept = fit(examples[lo:hi], length, d.sft_overlong, stats)
        if name == "train" and not kept:
            raise _nothing_left(stats, length)
        splits[name] = (pack(kept, length, tok.eod_id, d.sft_pack, stats), stats)
    return tok, splits, read


def _write(out: Path, tok: Tokenizer, splits: dict[str, tuple[Packed, PackStats]], read: Any,
           template: ChatTemplate, seq_len: int, d: DataConfig) -> None:
    """The prepared entry's files, into build_once's temporary directory `out`."""
    manifest: dict = {"format": FORMAT, "seq_len": seq_len, "files": {}, "stats": {},
                      "read": {"records": read.documents, "invalid_utf8": read.invalid_utf8}}
    for name, (packed, stats) in splits.items():
        for key, arr in packed.arrays().items():
            path = out / f"{name}.{key}.npy"
            np.save(path, arr, allow_pickle=False)
            manifest["files"][path.name] = _file_hash(path)
        manifest["stats"][name] = {
            "examples": stats.examples, "truncated": stats.truncated, "dropped": stats.dropped,
            "samples": stats.samples, "tokens": stats.tokens, "capacity": stats.capacity,
            "learned": stats.learned, "targets": stats.targets}
    tok.save(out / "tokenizer.json")
    manifest["files"]["tokenizer.json"] = _file_hash(out / "tokenizer.json")
    manifest["eod_token"] = d.eod_token
    manifest["template"] = template.origin
    # written last: its presence marks the entry complete (build_once's marker)
    write_text_atomic(out / _MANIFEST, json.dumps(manifest, indent=1))


def _nothing_left(stats: PackStats, length: int) -> DataError:
    """Why no training example is left, for the setting in use: the fix differs."""
    if stats.dropped_long:  # data.sft_overlong = "drop"
        return DataError(
            f"no fine-tuning example is left after dropping the {stats.dropped_long:,} longer "
            f"than train.seq_len + 1 = {length} tokens (data.sft_overlong = \"drop\")"
            + (f" and the {stats.dropped_unlearned:,} with nothing to learn"
               if stats.dropped_unlearned else "")
            + "; raise train.seq_len or set data.sft_overlong = \"truncate\"")
    if not stats.dropped_cut:
        return DataError(
            f"no fine-tuning example is left: none of the {stats.dropped_unlearned:,} has a "
            "token to learn (the reply is only the example's first token, which is never "
            "learned); use a data.chat_template that writes the assistant replies")
    return DataError(
        f"no fine-tuning example is left: the {stats.dropped_cut:,} longer than train.seq_len "
        f"+ 1 = {length} tokens have no reply to learn within their first {length} tokens (the "
        "prompt fills the sample), so cutting them to it (data.sft_overlong = \"truncate\") "
        "leaves nothing to learn"
        + (f", and {stats.dropped_unlearned:,} have nothing to learn at all"
           if stats.dropped_unlearned else "")
        + "; raise train.seq_len or shorten the prompts")


def _open(target: Path, seq_len: int, template: ChatTemplate) -> SFTCorpus:
    """The cache entry in `target` (built with `template`), every file checked against the
    manifest."""
    try:
        manifest = json.loads((target / _MANIFEST).read_text())
        files = manifest["files"]
        stats = manifest["stats"]
    except (OSError, ValueError, KeyError, TypeError):
        raise DataError(f"cached fine-tuning data in {target} has a damaged manifest") from None
    for name, digest in files.items():
        path = target / name
        if not path.is_file() or _file_hash(path) != digest:
            raise DataError(f"cached fine-tuning data in {target} is damaged ({name} does not "
                            "match its checksum)")
    fingerprint = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]
    sets: dict[str, SFTDataset] = {}
    for split in _SPLITS:
        arrays = [np.load(target / f"{split}.{a}.npy", mmap_mode="r", allow_pickle=False)
                  for a in _ARRAYS]
        if arrays[0].shape[0]:
            sets[split] = SFTDataset(Packed(*arrays), seq_len, f"sft[{split}]", fingerprint)
    if "train" not in sets:
        raise DataError(f"cached fine-tuning data in {target} has no training samples")
    tok = Tokenizer.from_json((target / "tokenizer.json").read_text(), "json",
                              manifest.get("eod_token", "auto"))
    s = stats["train"]
    efficiency = s["tokens"] / s["capacity"] if s["capacity"] else 0.0
    learned = s["learned"] / s["targets"] if s["targets"] else 0.0
    val = stats["val"]
    read = manifest.get("read") if isinstance(manifest.get("read"), dict) else {}
    invalid = (f"; invalid UTF-8 replaced in {read['invalid_utf8']:,} of {read['records']:,} "
               "records" if read.get("invalid_utf8") else "")  # as pretraining counts them
    summary = (f"sft: {s['examples']:,} examples, {s['truncated']:,} truncated, "
               f"{s['dropped']:,} dropped, packing efficiency {100 * efficiency:.1f}%, "
               f"{100 * learned:.1f}% of targets learned ({s['samples']:,} samples of "
               f"{seq_len + 1} tokens; validation: {val['examples']:,} examples, "
               f"{val['samples']:,} samples{invalid})")
    figures = {"sft_examples": float(s["examples"]), "sft_truncated": float(s["truncated"]),
               "sft_dropped": float(s["dropped"]), "sft_packing_efficiency": efficiency,
               "sft_learned_fraction": learned}
    return SFTCorpus(sets["train"], sets.get("val"), tok, figures, summary, template)
