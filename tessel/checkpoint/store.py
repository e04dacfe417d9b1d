"""Atomic checkpoints in safetensors + JSON.

Layout of `RUN/checkpoints/`:

    step_00000200/  model.safetensors  optimizer.safetensors  rng.safetensors  state.json
    latest -> step_00000200

A save writes everything into `.tmp-step_…` , fsyncs it, writes `state.json` last (it lists
the files and their sizes), then renames the directory into place and repoints `latest`.
A crash at any moment leaves either the old set of checkpoints or the old set plus a complete
new one; leftovers of a killed save are hidden temporary directories that loading ignores.
Loading reads only safetensors and JSON, so it never unpickles anything.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from tessel.errors import TesselError
from tessel.fileio import fsync_dir

FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_SEP = "::"  # between a parameter name and an optimizer-state key


class CheckpointError(TesselError):
    """Unusable checkpoint; the message is one line meant for the user."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and (child / "state.json").is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


# ---- save -------------------------------------------------------------------------------


def save_checkpoint(
    root: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    state: dict[str, Any],
    tensors: dict[str, torch.Tensor] | None = None,
    keep_last: int = 3,
) -> Path:
    """Write checkpoint `step` atomically; returns its directory."""
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(root)
    name = step_dir_name(step)
    tmp = root / f".tmp-{name}-{os.getpid()}"
    tmp.mkdir()
    files = {
        "model.safetensors": model_tensors(model),
        "rng.safetensors": dict(tensors or {}),
    }
    if optimizer is not None:
        files["optimizer.safetensors"] = optimizer_tensors(model, optimizer)
    sizes = {}
    for fname, content in files.items():
        path = tmp / fname
        save_file({k: v.detach().contiguous().cpu() for k, v in content.items()}, str(path))
        _fsync_file(path)
        sizes[fname] = path.stat().st_size
    meta = {"format": FORMAT_VERSION, "step": step, "files": sizes, **state}
    _write_json(tmp / "state.json", meta)  # written last: its presence marks completeness
    fsync_dir(tmp)

    final = root / name
    if final.exists():  # same step saved before (e.g. a timeline we went back from)
        trash = root / f".trash-{name}-{os.getpid()}"
        final.rename(trash)
        tmp.rename(final)
        shutil.rmtree(trash)
    else:
        tmp.rename(final)
    fsync_dir(root)
    _point_latest(root, name)
    _prune(root, keep_last)
    return final


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    # named_parameters lists a tied weight once, which safetensors requires.
    out = {n: p for n, p in model.named_parameters()}
    out.update({n: b for n, b in model.named_buffers() if _is_persistent(model, n)})
    return out


def optimizer_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Optimizer state keyed by parameter name (`layers.0.attention.wq.weight::exp_avg`)."""
    names = _index_to_name(model, optimizer)
    out = {}
    for idx, entry in optimizer.state_dict()["state"].items():
        for key, value in entry.items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            out[f"{names[idx]}{_SEP}{key}"] = t
    return out


# ---- load -------------------------------------------------------------------------------


def read_state(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads((path / "state.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{str(path)!r} is not a complete checkpoint (no state.json)"
        ) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {str(path)!r} is unreadable: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has format {meta.get('format') if isinstance(meta, dict) else '?'}"
            f", this tessel reads format {FORMAT_VERSION}"
        )
    for fname, size in meta.get("files", {}).items():
        f = path / fname
        actual = f.stat().st_size if f.is_file() else None
        if actual != size:
            raise CheckpointError(
                f"checkpoint {str(path)!r} is damaged: {fname} has {actual} bytes, "
                f"expected {size}; move that directory out of checkpoints/ to resume from the "
                "one before"
            )
    return meta


def read_tensors(path: Path, fname: str) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path / fname))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint file {str(path / fname)!r} is unreadable: {exc}") from None


def load_model(path: Path, model: nn.Module) -> None:
    """Copy checkpointed weights into `model` (same names and shapes required)."""
    saved = read_tensors(path, "model.safetensors")
    expected = model_tensors(model)
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not match the model: "
            f"missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    with torch.no_grad():
        for name, target in expected.items():
            src = saved[name]
            if src.shape != target.shape:
                raise CheckpointError(
                    f"checkpoint tensor {name!r} has shape {tuple(src.shape)}, the model "
                    f"expects {tuple(target.shape)}"
                )
            target.copy_(src)


def load_optimizer(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    saved = read_tensors(path, "optimizer.safetensors")
    names = _index_to_name(model, optimizer)
    by_name: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in saved.items():
        pname, _, skey = key.partition(_SEP)
        by_name.setdefault(pname, {})[skey] = value
    unknown = sorted(set(by_name) - set(names.values()))
    if unknown:
        raise CheckpointError(
            f"optimizer state in {str(path)!r} names parameters the model lacks: {unknown[:3]}"
        )
    sd = optimizer.state_dict()
    sd["state"] = {idx: by_name[n] for idx, n in names.items() if n in by_name}
    optimizer.load_state_dict(sd)


# ---- internals --------------------------------------------------------------------------


def _index_to_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return {i: by_id[id(p)] for i, p in enumerate(params)}


def _is_persistent(model: nn.Module, name: str) -> bool:
    owner_name, _, buf = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    return buf not in owner._non_persistent_buffers_set


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with path.open("w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _point_latest(root: Path, name: str) -> None:
    link = root / "latest"
    tmp = root / f".latest-{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(name, tmp)
    os.replace(tmp, link)  # atomic swap of the symlink


def _prune(root: Path, keep_last: int) -> None:
    for _, path in list_checkpoints(root)[:-keep_last]:
        # Rename first: a kill during the delete then leaves a hidden leftover (swept by the
        # next save), never a step directory with state.json but missing tensors.
        trash = root / f".trash-{path.name}-{os.getpid()}"
        path.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)


def _remove_stale_temporaries(root: Path) -> None:
    for child in root.iterdir():
        if child.name.startswith((".tmp-", ".trash-")) and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
