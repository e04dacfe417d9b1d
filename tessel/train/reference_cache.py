"""DPO's reference log-probabilities kept in the data cache (`data.cache_dir`), so a run that
asks for exactly what an earlier run computed (a sweep over dpo.beta, dpo.loss, the learning
rate or the steps) skips the reference pass: a 23-minute pass for 8B on 8 GPUs.

The key is everything the pass reads, so a hit returns the very numbers the run would compute
itself: the preference pairs (their token fingerprints), the config minus the settings the
pass does not read (the optimizer, the DPO loss and its beta, steps, logging, checkpoints),
the weights' files (names, sizes and modification times of model.init_from and
dpo.reference_model, as the pretraining corpus cache keys its inputs), the resolved precision,
device type and layout (another layout sums in another order), and the tessel and torch
versions. An entry is checked against its manifest's checksum when read; a damaged one is said
in one line and computed again, never used.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from tessel.data.cache import build_once

NOT_READ = {
    "optim": None, "run": None, "metrics": None, "checkpoint": None, "lm_eval": None,
    "notify": None, "recovery": None, "watchdog": None, "fault_tolerance": None,
    "alerts": None,
    "train": {"steps", "global_batch_size", "eval_interval", "eval_iters", "grad_clip"},
    "dpo": {"beta", "loss", "label_smoothing", "loss_weight", "sft_weight"},
    "data": {"cache_dir", "verify"},
}
"""Config sections (None: all of it) and keys the reference pass does not read. Anything not
listed is part of the key: a setting added later misses the cache rather than hitting it
wrongly."""

FORMAT = 1
"""Raised when the reference pass or the model's forward changes its numbers, so entries an
older tessel of the same version wrote are not reused."""
_FILE = "reference_logps.npy"
_MANIFEST = "manifest.json"


def reference_key(cfg: Any, pairs: list[tuple[int, str]], world: dict[str, Any]) -> dict[str, Any]:
    """What the reference pass of `cfg` reads: `pairs` (count, fingerprint) of each split,
    `world` the resolved precision, device type and layout."""
    import torch

    settings = {}
    for section, values in cfg.to_dict().items():
        drop = NOT_READ.get(section, set())
        if drop is None or not isinstance(values, dict):
            continue
        settings[section] = {k: v for k, v in values.items() if k not in drop}
    weights = {name: _files(p) for name, p in (("model.init_from", cfg.model.init_from),
                                              ("dpo.reference_model", cfg.dpo.reference_model))
               if p}
    return {"pairs": [list(p) for p in pairs], "settings": settings, "weights": weights,
            "world": world, "tessel": _version(), "format": FORMAT, "torch": torch.__version__}


def _version() -> str:
    try:
        return importlib.metadata.version("tessel")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "source"


def _files(path: str) -> list[list[Any]]:
    """(name, size, modification time) of every file of a weights path (a file or a
    directory, walked in a fixed order); a path that is not there is its name alone."""
    root = Path(path)
    found = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    out: list[list[Any]] = []
    for f in found:
        st = f.stat()
        out.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    return out or [[str(root.resolve()), -1, -1]]


def entry_dir(cache: Path, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    return cache / "dpo-reference" / digest[:24]


def read_cached(cache: Path, key: dict[str, Any], rows: int, say: Any) -> np.ndarray | None:
    """The cached (rows, 2) log-probabilities of `key`, or None: not there, or damaged (said
    in one line and removed, so this run's pass writes it again)."""
    where = entry_dir(cache, key)
    if not (where / _MANIFEST).is_file():
        return None
    try:
        manifest = json.loads((where / _MANIFEST).read_text())
        if not isinstance(manifest, dict):
            raise ValueError("its manifest is not a JSON object")
        blob = (where / _FILE).read_bytes()
        if manifest.get("key") != json.loads(json.dumps(key, default=str)):
            raise ValueError("made for another key")
        if hashlib.sha256(blob).hexdigest() != manifest.get("sha256"):
            raise ValueError("its checksum does not match")
        ref = np.load(io.BytesIO(blob), allow_pickle=False)
        if ref.shape != (rows, 2) or ref.dtype != np.float64 or not np.isfinite(ref).all():
            raise ValueError(f"it holds {ref.shape} {ref.dtype} values, not ({rows}, 2) finite")
    except (OSError, ValueError, TypeError) as exc:
        say(f"tessel: the cached reference log-probabilities in {where} are damaged ({exc}); "
            "computing them again")
        shutil.rmtree(where, ignore_errors=True)
        return None
    return ref


def write_cached(cache: Path, key: dict[str, Any], blob: bytes) -> Path:
    """Keep the log-probabilities whose .npy bytes are `blob` (`npy_bytes`) under `key` (a
    finished entry appears whole or not at all)."""
    def build(tmp: Path) -> None:
        with (tmp / _FILE).open("wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        manifest = {"key": key, "sha256": hashlib.sha256(blob).hexdigest()}
        (tmp / _MANIFEST).write_text(json.dumps(manifest, default=str))

    return build_once(entry_dir(cache, key), build, marker=_MANIFEST)


def npy_bytes(values: np.ndarray) -> bytes:
    """`values` as a .npy file's bytes (no pickled objects)."""
    out = io.BytesIO()
    np.save(out, values, allow_pickle=False)
    return out.getvalue()
