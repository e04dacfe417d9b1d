"""Blended, resumable, data-parallel sample loading.

The global sample order is a deterministic function of (seed, datasets, weights, seq_len):

- `BlendSchedule` decides which dataset supplies each next sample. It picks the dataset
  whose realised count lags its weight the most (Megatron's blending rule), so at every
  prefix of the order each dataset's count is within one sample of weight x prefix length.
- Each dataset serves its own samples in a per-epoch permutation of (seed, dataset name,
  epoch), cached on disk; a dataset that runs out starts a new, reshuffled epoch on its own.

The state is the per-dataset consumption counters. A resume continues from them exactly; a
resume with different weights keeps them and blends the new weights from that point on, so
nothing already consumed is repeated and nothing is skipped.

Data parallelism: the global order is cut into groups of micro_batch_size x dp_size samples;
rank r takes the r-th micro-batch of each group. Ranks never overlap and, together, cover
the order.
"""

from __future__ import annotations

import hashlib
import os
import zlib
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from tessel.data.dataset import TokenDataset
from tessel.errors import DataError
from tessel.models.loss import IGNORE_INDEX


class Batch(NamedTuple):
    inputs: torch.Tensor  # (B, T) int64
    targets: torch.Tensor  # (B, T) int64; IGNORE_INDEX (-100) where not learned (fine-tuning)
    doc_ids: torch.Tensor | None  # (B, T) int64 document index per position, when masking
    ref: torch.Tensor | None = None  # (B/2, 2) float64 reference log-probabilities (DPO)


class BlendSchedule:
    """Which dataset supplies the next sample, and that dataset's next sample index."""

    def __init__(
        self,
        datasets: list[TokenDataset],
        weights: list[float],
        seed: int,
        shuffle: bool,
        cache_dir: Path | None = None,
    ):
        self.datasets, self.seed, self.shuffle, self.cache_dir = datasets, seed, shuffle, cache_dir
        self.weights = _normalise(weights)
        self.consumed = [0] * len(datasets)  # samples taken from each dataset, all epochs
        self.total = 0
        # Counters at the moment the current weights took effect (a resume may change them).
        self.anchor_consumed = [0] * len(datasets)
        self.anchor_total = 0
        self._orders: dict[int, tuple[int, np.ndarray]] = {}

    def next(self) -> tuple[int, int]:
        """(dataset index, sample index within it) of the next sample; advances the state."""
        i = self.total - self.anchor_total
        lag = [
            w * (i + 1) - (c - a)
            for w, c, a in zip(self.weights, self.consumed, self.anchor_consumed)
        ]
        d = max(range(len(lag)), key=lambda k: (lag[k], -k))  # ties: the first dataset
        epoch, pos = divmod(self.consumed[d], self.datasets[d].n_samples)
        sample = int(self._order(d, epoch)[pos])
        self.consumed[d] += 1
        self.total += 1
        return d, sample

    def _order(self, d: int, epoch: int) -> np.ndarray:
        cached = self._orders.get(d)
        if cached is not None and cached[0] == epoch:
            return cached[1]
        n = self.datasets[d].n_samples
        if not self.shuffle:
            order = np.arange(n)
        else:
            order = self._load_or_build_permutation(d, epoch, n)
        self._orders[d] = (epoch, order)
        return order

    def _load_or_build_permutation(self, d: int, epoch: int, n: int) -> np.ndarray:
        name = self.datasets[d].name
        key = hashlib.sha256(f"{self.seed}|{name}|{n}|{epoch}".encode()).hexdigest()[:20]
        path = self.cache_dir / f"order-{key}.npy" if self.cache_dir else None
        if path is not None and path.is_file():
            try:
                order = np.load(path)
                if order.shape == (n,):
                    return order
            except (OSError, ValueError):
                pass  # a damaged cache entry is rebuilt below
        # The dataset's name seeds its order, so adding a dataset to a blend does not
        # reshuffle the others.
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode()), epoch])
        order = rng.permutation(n).astype(np.int64)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            with tmp.open("wb") as f:
                np.save(f, order)
            os.replace(tmp, path)  # large blends start fast next time
        return order

    def state_dict(self) -> dict[str, Any]:
        return {
            "names": [ds.name for ds in self.datasets],
            "sizes": [ds.n_samples for ds in self.datasets],
            "fingerprints": [ds.fingerprint for ds in self.datasets],
            "weights": self.weights,
            "consumed": list(self.consumed),
            "total": self.total,
            "anchor_consumed": list(self.anchor_consumed),
            "anchor_total": self.anchor_total,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        names = [ds.name for ds in self.datasets]
        if state["names"] != names:
            raise DataError(
                f"the datasets changed since the checkpoint ({state['names']} then, {names} now); "
                "resume with the same data.paths (weights may change)"
            )
        sizes = [ds.n_samples for ds in self.datasets]
        if state["sizes"] != sizes:
            raise DataError(
                f"the datasets' sizes changed since the checkpoint ({state['sizes']} samples then, "
                f"{sizes} now); resume with the data the run was started with"
            )
        then = state.get("fingerprints")  # absent in checkpoints made before they existed
        now = [ds.fingerprint for ds in self.datasets]
        if then is not None and then != now:
            changed = next(ds.name for ds, a, b in zip(self.datasets, then, now) if a != b)
            raise DataError(
                f"the content of dataset {changed!r} changed since the checkpoint (same sizes, "
                "different tokens); resume with the data the run was started with, or start a "
                "new run from these weights with --model.init_from=RUN_DIR"
            )
        self.consumed, self.total = list(state["consumed"]), int(state["total"])
        if np.allclose(state["weights"], self.weights, rtol=0, atol=1e-12):
            self.anchor_consumed = list(state["anchor_consumed"])
            self.anchor_total = int(state["anchor_total"])
        else:  # new mixture: blend the new weights from here, keep every dataset's position
            self.anchor_consumed, self.anchor_total = list(self.consumed), self.total
        self._orders.clear()

    def reset(self) -> None:
        self.consumed = [0] * len(self.datasets)
        self.anchor_consumed = [0] * len(self.datasets)
        self.total = self.anchor_total = 0


class Loader:
    """This data-parallel rank's micro-batches from a blend of datasets."""

    def __init__(
        self,
        datasets: list[TokenDataset],
        weights: list[float],
        micro_batch_size: int,
        seed: int,
        shuffle: bool,
        dp_rank: int = 0,
        dp_size: int = 1,
        document_mask: bool = False,
        cache_dir: Path | None = None,
    ):
        self.mbs, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.document_mask = document_mask
        self.datasets = datasets
        # Datasets with a loss mask (SFTDataset) mask their targets; token datasets have none.
        self.masked = all(hasattr(ds, "loss_mask") for ds in datasets)
        self.schedule = BlendSchedule(datasets, weights, seed, shuffle, cache_dir)
        self.n_samples = sum(ds.n_samples for ds in datasets)

    def next_batch(self) -> Batch:
        picks = [self.schedule.next() for _ in range(self.mbs * self.dp_size)]
        mine = picks[self.dp_rank * self.mbs : (self.dp_rank + 1) * self.mbs]
        rows = np.stack([self.datasets[d].sample(i) for d, i in mine])  # (B, T+1)
        batch = torch.from_numpy(rows)
        doc_ids = None
        if self.document_mask:
            doc_ids = torch.from_numpy(np.stack([self.datasets[d].doc_ids(i) for d, i in mine]))
        targets = batch[:, 1:]
        if self.masked:  # fine-tuning: only the learned targets count in the loss
            keep = np.stack([self.datasets[d].loss_mask(i) for d, i in mine])  # (B, T)
            targets = targets.masked_fill(torch.from_numpy(~keep), IGNORE_INDEX)
        return Batch(batch[:, :-1], targets, doc_ids)

    def state_dict(self) -> dict[str, Any]:
        return self.schedule.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.schedule.load_state_dict(state)

    def reset(self) -> None:
        """Back to the first sample (validation restarts at every evaluation)."""
        self.schedule.reset()


def _normalise(weights: list[float]) -> list[float]:
    total = float(sum(weights))
    if total <= 0 or any(w < 0 for w in weights):
        raise DataError(f"blend weights {weights} must be non-negative with a positive sum")
    return [w / total for w in weights]
