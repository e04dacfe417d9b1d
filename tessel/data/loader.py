"""Fixed-length samples from a packed token array, served deterministically and resumably.

Sample i covers tokens [i*seq_len, i*seq_len + seq_len + 1): inputs are the first seq_len,
targets the last seq_len. Training order is a fresh permutation per epoch drawn from
(seed, epoch); the state is just (epoch, position), so a resumed run reads exactly the
samples the uninterrupted run would have read. With data parallelism each rank takes its own
micro-batch-sized slice of every group of dp_size micro-batches, so ranks never overlap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tessel.config import Config
from tessel.data.corpus import DataError, load_splits, unigram_baseline
from tessel.data.tokenizer import Tokenizer


class Loader:
    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        micro_batch_size: int,
        seed: int,
        shuffle: bool,
        dp_rank: int = 0,
        dp_size: int = 1,
        name: str = "train",
    ):
        self.tokens, self.seq_len, self.mbs = tokens, seq_len, micro_batch_size
        self.seed, self.shuffle = seed, shuffle
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.n_samples = (len(tokens) - 1) // seq_len if len(tokens) > seq_len else 0
        if self.n_samples < micro_batch_size * dp_size:
            raise DataError(
                f"the {name} split has {len(tokens)} tokens, fewer than one batch of "
                f"{micro_batch_size * dp_size} samples of {seq_len + 1} tokens; add data, "
                f"lower train.seq_len or train.micro_batch_size, or change data.split"
            )
        self.epoch = 0
        self.position = 0  # samples consumed in this epoch, over all ranks
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n_samples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_samples)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next micro-batch: inputs and targets, (mbs, seq_len) int64 each."""
        group = self.mbs * self.dp_size
        if self.position + group > self.n_samples:  # drop the ragged tail, start an epoch
            self.epoch += 1
            self.position = 0
            self._order = self._permutation(self.epoch)
        start = self.position + self.dp_rank * self.mbs
        idx = self._order[start : start + self.mbs]
        self.position += group
        offsets = idx[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        batch = torch.from_numpy(self.tokens[offsets].astype(np.int64))
        return batch[:, :-1], batch[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "n_samples": self.n_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("n_samples") != self.n_samples:
            raise DataError(
                f"the data changed since the checkpoint ({state.get('n_samples')} samples then, "
                f"{self.n_samples} now); resume with the data the run was started with"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)

    def reset(self) -> None:
        """Back to the first sample (validation restarts at every evaluation)."""
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)


@dataclass
class Data:
    train: Loader
    val: Loader
    unigram_baseline: float
    """val cross-entropy of a context-free (unigram) model: the bar a trained model must beat"""


def build_data(
    cfg: Config, tok: Tokenizer, dp_rank: int = 0, dp_size: int = 1
) -> Data:
    """Train and validation loaders for this data-parallel rank."""
    if tok.vocab_size > cfg.model.vocab_size:
        raise DataError(
            f"tokenizer {tok.name!r} has {tok.vocab_size} ids but model.vocab_size is "
            f"{cfg.model.vocab_size}; set model.vocab_size >= {tok.vocab_size}"
        )
    splits = load_splits(cfg.data, tok, cfg.train.seed)
    t = cfg.train
    train = Loader(splits.train, t.seq_len, t.micro_batch_size, t.seed, True, dp_rank, dp_size)
    val = Loader(splits.val, t.seq_len, t.micro_batch_size, t.seed, False, dp_rank, dp_size, "val")
    return Data(train, val, unigram_baseline(splits.train, splits.val, tok.vocab_size))
