"""From `data.*` config to train/val loaders: the one seam the trainer talks to.

- `indexed`: datasets made by `tessel preprocess` (`PREFIX.bin/.idx`), optionally weighted.
- `stdlib` / `files`: raw text, tokenized once through the same preprocessing into an
  indexed dataset in the cache (keyed by the inputs' names, sizes and times, the tokenizer
  and the vocabulary), then read like any indexed dataset.
- `synthetic`: uniform random ids (a throughput workload; nothing to learn).
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tessel.config import Config, DataConfig
from tessel.data.cache import build_once, data_cache_dir
from tessel.data.chat_template import ChatTemplate
from tessel.data.dataset import TokenDataset, split_ranges
from tessel.data.loader import Loader
from tessel.data.tokenizer import Tokenizer, byte_tokenizer, load_tokenizer, train_bpe
from tessel.errors import DataError

_SYNTHETIC_TOKENS = 1 << 20
_BASELINE_TOKENS = 1 << 24  # the unigram baseline counts at most this many tokens


@dataclass
class Data:
    train: Loader
    val: Loader | None
    """None when the split leaves no validation data."""
    tokenizer: Tokenizer
    """The tokenizer the data was made with (saved with the run)."""
    unigram_baseline: float
    """Validation cross-entropy of a context-free (unigram) model: the bar to beat."""
    figures: dict[str, float] = field(default_factory=dict)
    """Static figures of the data for the metrics (fine-tuning: packing efficiency and
    learned-token fraction), logged with every training record."""
    chat_template: ChatTemplate | None = None
    """Fine-tuning: the template the conversations were rendered with (saved with the run,
    written by its exports)."""


def stdlib_files() -> list[Path]:
    """This Python's standard-library sources: text on every machine with Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


# (name, token ids, document offsets) of one corpus to train on
_Corpus = tuple[str, np.ndarray, np.ndarray]


def _synthetic_corpus(cfg: Config) -> tuple[Tokenizer, list[_Corpus], None, list[str]]:
    """`data.source = "synthetic"`: (tokenizer, one corpus of uniform random ids, no weights,
    its fingerprint)."""
    d, t = cfg.data, cfg.train
    tok = (byte_tokenizer() if d.tokenizer in ("auto", "bytes", "bpe")
           else load_tokenizer(d.tokenizer, d.eod_token))
    rng = np.random.default_rng(t.seed)
    ids = rng.integers(0, cfg.model.vocab_size, _SYNTHETIC_TOKENS).astype(np.int64)
    return tok, [("synthetic", ids, np.array([0, len(ids)], dtype=np.int64))], None, \
        [f"synthetic:{t.seed}"]


def _indexed_corpora(cfg: Config, cache: Path, console
                     ) -> tuple[Tokenizer, list[_Corpus], list[float] | None, list[str]]:
    """`indexed` datasets, or raw text (`stdlib` / `files`) made one in the cache, checked:
    (their tokenizer, the corpora, the configured weights if any, their fingerprints)."""
    from tessel.data.indexed import IndexedDataset

    d = cfg.data
    if d.source == "indexed":
        weighted = d.weighted_paths()
        # Megatron-LM datasets keep no tokenizer: they are read with the configured one
        given_tok = (load_tokenizer(d.tokenizer, d.eod_token) if d.tokenizer != "auto"
                     else None)
        sets = [IndexedDataset(prefix, given_tok) for _, prefix in weighted]
        tok = _common_tokenizer(sets, [p for _, p in weighted], d.tokenizer, d.eod_token)
        given = [w for w, _ in weighted]
        weights = None if given[0] is None else [float(w) for w in given]  # type: ignore[arg-type]
    else:
        prefix = ensure_corpus(d, cfg.model.vocab_size, cache, console)
        sets = [IndexedDataset(prefix)]
        tok, weights = sets[0].tokenizer().with_eod(d.eod_token), None
    corpora = [(s_name, s.tokens, s.doc_offsets) for s_name, s in zip(_names(d, sets), sets)]
    for (name, _, _), s in zip(corpora, sets):
        if s.vocab_size > cfg.model.vocab_size:
            raise DataError(
                f"dataset {name!r} was made with a {s.vocab_size}-token vocabulary but "
                f"model.vocab_size is {cfg.model.vocab_size}; set model.vocab_size >= "
                f"{s.vocab_size}"
            )
        verify_dataset(s, d.verify, console)
    return tok, corpora, weights, [s.fingerprint for s in sets]


def _split_corpora(corpora: list[_Corpus], fingerprints: list[str],
                   fractions: tuple[float, float, float], seq_len: int
                   ) -> tuple[list[TokenDataset], list[TokenDataset]]:
    """Each corpus's documents split into its train and validation samples."""
    train_sets, val_sets = [], []
    for (name, tokens, offsets), fingerprint in zip(corpora, fingerprints):
        ranges = split_ranges(len(offsets) - 1, fractions)
        train_sets.append(TokenDataset(tokens, offsets, seq_len, ranges[0], f"{name}[train]",
                                       fingerprint))
        val_sets.append(TokenDataset(tokens, offsets, seq_len, ranges[1], f"{name}[val]",
                                     fingerprint))
    return train_sets, val_sets


def _val_loader(cfg: Config, val_sets: list[TokenDataset], weights: list[float],
                fractions: tuple[float, float, float], dp_rank: int, dp_size: int) -> Loader | None:
    """The validation loader over the sets that hold samples, or None where there is
    nothing to validate on (refused where a validation split was asked for)."""
    d, t = cfg.data, cfg.train
    group = t.micro_batch_size * dp_size
    kept = [(ds, w) for ds, w in zip(val_sets, weights) if ds.n_samples > 0 and w > 0]
    if kept and sum(ds.n_samples for ds, _ in kept) >= group:
        return Loader([ds for ds, _ in kept], [w for _, w in kept], t.micro_batch_size, t.seed,
                      False, dp_rank, dp_size, d.document_mask)
    if fractions[1] > 0 and d.source != "synthetic":
        # a validation split was asked for: never end with val_loss null (random tokens,
        # one endless "document", have nothing to validate on)
        have = sum(ds.n_samples for ds in val_sets)
        raise DataError(
            f"data.split={d.split!r} asks for a validation split, but it holds {have} sample(s) "
            f"of train.seq_len={t.seq_len} tokens and one micro-batch per data-parallel rank "
            f"needs {group}; add documents, raise the validation share of data.split, or set "
            "its validation part to 0 (e.g. data.split = \"100,0\") to train without validation"
        )
    return None


def build_data(cfg: Config, dp_rank: int = 0, dp_size: int = 1, console=print) -> Data:
    """Train and validation loaders for this data-parallel rank, and the tokenizer."""
    d, t = cfg.data, cfg.train
    cache = data_cache_dir(d)
    if cfg.train.objective == "dpo":  # preference pairs of dpo.paths (data.source unread)
        from tessel.data.preference_data import build_preference_data

        train, val, tok, figures, template = build_preference_data(cfg, cache, dp_rank, dp_size,
                                                                   console)
        # no unigram baseline: a preference loss is no cross-entropy to compare it with
        return Data(train, val, tok, float("nan"), figures, template)  # type: ignore[arg-type]
    if d.source == "sft":
        return _sft_data(cfg, cache, dp_rank, dp_size, console)
    tok, corpora, weights, fingerprints = (
        _synthetic_corpus(cfg) if d.source == "synthetic"
        else _indexed_corpora(cfg, cache, console))
    if tok.vocab_size > cfg.model.vocab_size:
        raise DataError(
            f"the tokenizer has {tok.vocab_size} ids but model.vocab_size is "
            f"{cfg.model.vocab_size}; set model.vocab_size >= {tok.vocab_size}"
        )

    fractions = d.split_fractions()
    train_sets, val_sets = _split_corpora(corpora, fingerprints, fractions, t.seq_len)
    if weights is None:  # no weights given: mix in proportion to size
        weights = [float(ds.n_samples) for ds in train_sets]
    group = t.micro_batch_size * dp_size
    for ds in train_sets:
        ds.require(1, "one sample")
    if sum(ds.n_samples for ds in train_sets) < group:
        train_sets[0].require(group, "one micro-batch on every data-parallel rank")
    index_cache = cache / "indices"
    train = Loader(train_sets, weights, t.micro_batch_size, t.seed, True, dp_rank, dp_size,
                   d.document_mask, index_cache)
    val = _val_loader(cfg, val_sets, weights, fractions, dp_rank, dp_size)
    baseline = unigram_baseline(train_sets[0].tokens, val_sets[0].tokens, tok.vocab_size)
    return Data(train, val, tok, baseline)


def _sft_data(cfg: Config, cache: Path, dp_rank: int, dp_size: int, console) -> Data:
    """Fine-tuning loaders: packed conversations, loss on the assistant turns, the document
    mask always on (packed examples must not see each other)."""
    from tessel.data.sft_build import ensure_sft

    d, t = cfg.data, cfg.train
    corpus = ensure_sft(d, t.seq_len, cfg.model.vocab_size, cache, console)
    console(corpus.summary)
    tok = corpus.tokenizer
    if tok.vocab_size > cfg.model.vocab_size:
        raise DataError(
            f"the tokenizer has {tok.vocab_size} ids but model.vocab_size is "
            f"{cfg.model.vocab_size}; set model.vocab_size >= {tok.vocab_size}"
        )
    group = t.micro_batch_size * dp_size
    corpus.train.require(group, "one micro-batch on every data-parallel rank")
    train = Loader([corpus.train], [1.0], t.micro_batch_size, t.seed, True, dp_rank, dp_size,
                   True, cache / "indices")
    val_set, val = corpus.val, None
    if val_set is not None and val_set.n_samples >= group:
        val = Loader([val_set], [1.0], t.micro_batch_size, t.seed, False, dp_rank, dp_size, True)
    elif d.split_fractions()[1] > 0:
        have = val_set.n_samples if val_set is not None else 0
        raise DataError(
            f"data.split={d.split!r} asks for a validation split, but it holds {have} packed "
            f"sample(s) and one micro-batch per data-parallel rank needs {group}; add records, "
            "raise the validation share of data.split, or set data.split = \"100,0\"")
    val_ids = val_set.learned_targets() if val_set is not None else np.zeros(0, np.int64)
    # the baseline over learned targets only: what the loss counts
    baseline = unigram_baseline(corpus.train.learned_targets(), np.concatenate([[0], val_ids]),
                                tok.vocab_size)
    return Data(train, val, tok, baseline, corpus.stats, corpus.template)


def _names(d: DataConfig, sets: list) -> list[str]:
    if d.source == "indexed":
        return [str(Path(p)) for _, p in d.weighted_paths()]
    return [d.source]


def _common_tokenizer(sets: list, prefixes: list[str], spec: str, eod_token: str) -> Tokenizer:
    """All blended datasets must share one tokenizer, and it must be the configured one."""
    prints = {s.tokenizer_fingerprint for s in sets}
    if len(prints) > 1:
        raise DataError(
            f"datasets {prefixes} were made with different tokenizers; preprocess them with one"
        )
    tok = sets[0].tokenizer().with_eod(eod_token)
    if spec not in ("auto",):
        wanted = load_tokenizer(spec)
        if wanted.fingerprint() != tok.fingerprint():
            raise DataError(
                f"data.tokenizer={spec!r} differs from the tokenizer {prefixes[0]!r} was made "
                "with; set data.tokenizer='auto' or re-run tessel preprocess"
            )
    return tok


# ---- raw text -> cached indexed corpus --------------------------------------------------


_FULL_CHECK_BYTES = 2 << 30  # data.verify = "auto": token files up to this are read whole


def verify_dataset(ds: Any, mode: str, console: Any = print) -> None:
    """Check a dataset's token file as data.verify says (see DataConfig.verify)."""
    size = ds.bin_path.stat().st_size
    if mode == "full" or (mode == "auto" and size <= _FULL_CHECK_BYTES):
        ds.verify()
        return
    if mode == "auto":
        console(f"tessel: {ds.bin_path} is {size / 2**30:.1f} GiB: checking sampled token ids "
                "only; data.verify = \"full\" also checks its checksum (reads it whole)")
    ds.check_sampled_ids()


def ensure_corpus(d: DataConfig, vocab_size: int, cache: Path, console=print) -> Path:
    """The cached indexed dataset for a `stdlib` or `files` source; built on first use."""
    inputs = [str(p) for p in stdlib_files()] if d.source == "stdlib" else list(d.paths)
    spec = "bpe" if d.tokenizer == "auto" else d.tokenizer
    key = _corpus_key(inputs, spec, vocab_size, d.json_key, d.eod_token)
    target = cache / f"corpus-{key}"
    if (target / "data.idx").is_file():
        return target / "data"
    what = "the standard library's sources" if d.source == "stdlib" else f"{len(inputs)} input(s)"
    from tessel.data.preprocess import preprocess
    from tessel.data.readers import iter_documents

    console(f"tessel: tokenizing {what} once (cached in {target})")

    def build(tmp: Path) -> None:
        if spec == "bpe":
            tok = train_bpe(iter_documents(inputs, d.json_key), vocab_size)
        else:
            tok = load_tokenizer(spec, d.eod_token)
        preprocess(inputs, tok, tmp / "data", json_key=d.json_key, append_eod=True,
                   progress=False)

    return build_once(target, build) / "data"


def _corpus_key(inputs: list[str], spec: str, vocab_size: int, json_key: str,
                eod_token: str) -> str:
    h = hashlib.sha256(json.dumps([spec, vocab_size, json_key]).encode())
    if eod_token != "auto":
        h.update(f"eod:{eod_token}".encode())
    from tessel.data.readers import resolve_inputs

    try:
        files = resolve_inputs(inputs)  # exactly the files preprocessing will read
    except DataError as exc:
        raise DataError(f"{exc}; fix data.paths") from None
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    if spec not in ("bytes", "bpe"):
        # Corpora cached before a tokenizer.json's post-processor applied (BOS) are not reused.
        h.update(b"post-processor applied")
        if Path(spec).is_file():
            h.update(Path(spec).read_bytes())
    return h.hexdigest()[:16]


def unigram_baseline(train: np.ndarray, val: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of the val split under the train split's unigram
    distribution (add-one smoothed, from at most 16M tokens of each): what a model that
    ignores context would score."""
    train_ids = np.asarray(train[:_BASELINE_TOKENS], dtype=np.int64)
    val_ids = np.asarray(val[1:_BASELINE_TOKENS], dtype=np.int64)
    if len(val_ids) == 0:
        return float("nan")
    counts = np.bincount(train_ids, minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[val_ids].mean())
