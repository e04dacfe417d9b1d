"""Turn a text source into one packed token array per split, cached on disk.

A corpus is a list of documents (files). Documents are split into train/val by a fixed
permutation (independent of the training seed, so every run of a corpus validates on the
same text), tokenized, joined with the end-of-document id and cached as `.npy` files keyed
by the source's file list, sizes and modification times.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tessel.config import DataConfig
from tessel.data.tokenizer import Tokenizer
from tessel.errors import TesselError

_SPLIT_SEED = 20240601  # fixed: the val split must not move when train.seed changes
_SYNTHETIC_TOKENS = 1 << 20


class DataError(TesselError):
    """Unusable data; the message is one line meant for the user."""


@dataclass
class Splits:
    train: np.ndarray  # (N,) token ids, documents separated by eod
    val: np.ndarray


def default_cache_dir() -> Path:
    env = os.environ.get("TESSEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tessel"


def stdlib_files() -> list[Path]:
    """This Python's standard-library sources: text on every machine with Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file()
    )


def collect_files(paths: list[str]) -> list[Path]:
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            out.extend(sorted(f for f in p.rglob("*") if f.is_file()))
        elif p.is_file():
            out.append(p)
        else:
            raise DataError(f"data path {raw!r} does not exist; fix data.paths")
    if not out:
        raise DataError(f"data.paths {paths} hold no files; point them at text files")
    return out


def load_splits(cfg: DataConfig, tok: Tokenizer, seed: int) -> Splits:
    if cfg.source == "synthetic":
        # Uniform random ids: a throughput workload, not something a model can learn.
        rng = np.random.default_rng(seed)
        data = rng.integers(0, tok.vocab_size, _SYNTHETIC_TOKENS, dtype=np.int64).astype(np.uint16)
        cut = int(len(data) * cfg.split_fractions()[0])
        return Splits(train=data[:cut], val=data[cut:])
    files = stdlib_files() if cfg.source == "stdlib" else collect_files(cfg.paths)
    cache = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    key = _cache_key(cfg, tok, files)
    target = cache / f"corpus-{key}"
    if not (target / "val.npy").is_file():
        _build(files, tok, cfg.split_fractions()[1], target)
    return Splits(train=np.load(target / "train.npy"), val=np.load(target / "val.npy"))


def _cache_key(cfg: DataConfig, tok: Tokenizer, files: list[Path]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([tok.to_spec(), cfg.split]).encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _build(files: list[Path], tok: Tokenizer, val_fraction: float, target: Path) -> None:
    order = np.random.default_rng(_SPLIT_SEED).permutation(len(files))
    n_val = int(round(len(files) * val_fraction))
    if val_fraction > 0 and len(files) > 1:
        n_val = max(n_val, 1)  # a tiny corpus still gets a validation document
    val_ids = set(order[:n_val].tolist())
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    for i, f in enumerate(files):
        try:
            text = f.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise DataError(f"cannot read {str(f)!r}: {exc.strerror}") from None
        ids = tok.encode(text) + [tok.eod_id]
        parts["val" if i in val_ids else "train"].append(np.asarray(ids, dtype=np.uint16))
    if len(files) == 1 and val_fraction > 0:
        # One document: hold out its tail instead.
        doc = parts["train"].pop()
        cut = int(len(doc) * (1 - val_fraction))
        parts = {"train": [doc[:cut]], "val": [doc[cut:]]}
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    for split, arrays in parts.items():
        data = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.uint16)
        np.save(tmp / f"{split}.npy", data)
    # Rename the whole directory: a concurrent or interrupted build never leaves a half cache.
    try:
        tmp.rename(target)
    except OSError:
        if not (target / "val.npy").is_file():
            raise
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()


def unigram_baseline(train: np.ndarray, val: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of the val split under the train split's unigram
    distribution (add-one smoothed): what a model that ignores context would score."""
    counts = np.bincount(train.astype(np.int64), minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[val[1:].astype(np.int64)].mean()) if len(val) > 1 else float("nan")
