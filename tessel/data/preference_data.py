"""train.objective = "dpo": the preference records of dpo.paths as train and validation pairs
(tessel.data.preference), and the pair loader that deals them to the data-parallel ranks.

A micro-batch of `b` pairs is 2b rows: the chosen row of every pair, then the rejected row of
every pair (tessel.train.dpo's order), targets -100 outside the replies, with the reference
model's log-probabilities of its pairs (b, 2) once they are known (`Batch.ref`). Pairs are
dealt as the token loader deals samples (the same blend schedule: a seeded per-epoch order,
micro-batch r of each group of dp micro-batches to data-parallel rank r, resumable state),
so one pair's two rows are always in one micro-batch on one rank.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tessel.data.chat_template import resolve_template
from tessel.data.dataset import split_ranges
from tessel.data.loader import Batch, BlendSchedule, Loader
from tessel.data.preference import PairCounts, Pairs, PreferenceDataset, read_pairs, texts_of
from tessel.data.sft import chat_encoder
from tessel.data.tokenizer import Tokenizer, load_tokenizer, train_bpe
from tessel.errors import DataError
from tessel.models.loss import IGNORE_INDEX


class PairLoader(Loader):
    """This data-parallel rank's micro-batches of `micro_batch_size` pairs (the token
    loader's schedule, state and reset)."""

    def __init__(self, dataset: PreferenceDataset, micro_batch_size: int, seed: int,
                 shuffle: bool, dp_rank: int = 0, dp_size: int = 1,
                 cache_dir: Path | None = None):
        # not Loader.__init__ (token datasets): the attributes its methods read, set here
        self.dataset, self.mbs, self.masked = dataset, micro_batch_size, True
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.schedule = BlendSchedule([dataset], [1.0], seed, shuffle, cache_dir)  # type: ignore[list-item]
        self.n_samples = dataset.n_samples

    def next_batch(self) -> Batch:
        picks = [self.schedule.next()[1] for _ in range(self.mbs * self.dp_size)]
        return pair_batch(self.dataset, picks[self.dp_rank * self.mbs:(self.dp_rank + 1) * self.mbs])


def pair_batch(dataset: PreferenceDataset, picks: list[int]) -> Batch:
    """The micro-batch of pairs `picks`: rows [chosen..., rejected...], and their reference
    log-probabilities (b, 2) when the dataset has them."""
    tokens, learned = zip(*(dataset.pair(i) for i in picks))  # each (2, L)
    rows = torch.from_numpy(np.concatenate([np.stack([t[j] for t in tokens]) for j in (0, 1)]))
    keep = torch.from_numpy(np.concatenate([np.stack([m[j] for m in learned]) for j in (0, 1)]))
    targets = rows[:, 1:].masked_fill(~keep[:, 1:], IGNORE_INDEX)
    ref = torch.from_numpy(dataset.ref[picks]) if dataset.ref is not None else None
    return Batch(rows[:, :-1], targets, None, ref)


def _tokenizer(d: Any, files: list[Path], vocab_size: int, console: Any
               ) -> tuple[Tokenizer, Any, str]:
    """(the tokenizer, the chat template, the end-of-sequence token) for the pairs: the
    configured tokenizer, or (data.tokenizer = "auto") a byte-level BPE trained on them."""
    from tessel.data.preference import to_record
    from tessel.data.readers import iter_json_records
    from tessel.data.sft_build import template_tokens

    if d.tokenizer != "auto":
        tok = load_tokenizer(d.tokenizer, d.eod_token)
        eos = str(tok.hf.id_to_token(tok.eod_id))
        beside = Path(d.tokenizer).parent if Path(d.tokenizer).is_file() else None
        return tok, resolve_template(d.chat_template, beside, eos), eos
    eos = "<|endoftext|>"
    template = resolve_template(d.chat_template, None, eos)
    texts = [t for where, obj in iter_json_records(files)
             for t in texts_of(to_record(obj, where), template)]
    console(f"tessel: training a tokenizer on {len(texts) // 2:,} preference records")
    return train_bpe(iter(texts), vocab_size, special_tokens=template_tokens(template)), \
        template, eos


def _dataset(pairs: Pairs, lo: int, hi: int, name: str) -> PreferenceDataset:
    part = Pairs(pairs.tokens[lo:hi], pairs.learned[lo:hi])
    h = hashlib.sha256(part.tokens.tobytes())
    h.update(part.learned.tobytes())
    return PreferenceDataset(part, name, h.hexdigest()[:16])


def build_preference_data(cfg: Any, cache: Path, dp_rank: int, dp_size: int,
                          console: Any) -> tuple[Any, ...]:
    """(train pair loader, validation pair loader or None, tokenizer, figures, chat template)
    of dpo.paths (tessel.data.sources makes them its Data); DataError (exit 2) for records it
    cannot read or too few pairs."""
    from tessel.data.readers import resolve_inputs

    d, t = cfg.data, cfg.train
    try:
        files = resolve_inputs(list(cfg.dpo.paths))
    except DataError as exc:
        raise DataError(f"{exc}; fix dpo.paths") from None
    tok, template, eos = _tokenizer(d, files, cfg.model.vocab_size, console)
    if tok.vocab_size > cfg.model.vocab_size:
        raise DataError(f"the tokenizer has {tok.vocab_size} ids but model.vocab_size is "
                        f"{cfg.model.vocab_size}; set model.vocab_size >= {tok.vocab_size}")
    pairs, counts = read_pairs(files, template, chat_encoder(tok), eos, t.seq_len + 1)
    (lo, hi), (vlo, vhi) = split_ranges(counts.pairs, d.split_fractions())[:2]
    train_set, val_set = (_dataset(pairs, lo, hi, "dpo[train]"),
                          _dataset(pairs, vlo, vhi, "dpo[val]"))
    group = t.micro_batch_size * dp_size
    train_set.require(group, "one micro-batch of pairs on every data-parallel rank")
    console(_summary(counts, train_set, val_set, template.origin))
    train = PairLoader(train_set, t.micro_batch_size, t.seed, True, dp_rank, dp_size,
                       cache / "indices")
    val = None
    if val_set.n_samples >= group:
        val = PairLoader(val_set, t.micro_batch_size, t.seed, False, dp_rank, dp_size)
    elif d.split_fractions()[1] > 0:
        raise DataError(
            f"data.split={d.split!r} asks for a validation split, but it holds "
            f"{val_set.n_samples} preference pair(s) and one micro-batch per data-parallel rank "
            f"needs {group}; add records, raise the validation share of data.split, or set "
            "data.split = \"100,0\"")
    figures = {"dpo_pairs": float(train_set.n_samples), "dpo_left_out": float(counts.dropped())}
    return train, val, tok, figures, template


def _summary(counts: PairCounts, train: PreferenceDataset, val: PreferenceDataset,
             template: str) -> str:
    return (f"dpo: {counts.pairs:,} preference pairs of {counts.records:,} records "
            f"({train.n_samples:,} train, {val.n_samples:,} validation; template {template}), "
            f"{counts.truncated:,} rows cut to train.seq_len + 1 tokens{counts.note()}")
