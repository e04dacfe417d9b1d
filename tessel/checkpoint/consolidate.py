"""`tessel checkpoint consolidate`: one safetensors file of the full model from a sharded
checkpoint saved under any layout."""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors.torch import save_file

from tessel.checkpoint.errors import CheckpointError
from tessel.checkpoint.store import find_checkpoint, read_full, read_state
from tessel.fileio import fsync_dir


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory, or a run directory (its latest checkpoint)."""
    found = find_checkpoint(path)
    if found is None:
        raise CheckpointError(f"{str(path)!r} is neither a checkpoint nor a run with checkpoints")
    return found


def consolidate(ckpt: Path, output: Path) -> tuple[int, int]:
    """Write every model tensor of `ckpt`, unsharded, to `output` (atomically); returns
    (tensors, bytes). A tied output projection is stored once, as the embedding."""
    state = read_state(ckpt)
    tied = bool(state.get("config", {}).get("model", {}).get("tie_embeddings"))
    tensors = read_full(ckpt, "model", skip={"output.weight"} if tied else set())
    info = {"format": "tessel", "step": str(state["step"]),
            "model_config": json.dumps(state.get("config", {}).get("model", {}))}
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=info)
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(output.parent)
    return len(tensors), sum(t.numel() * t.element_size() for t in tensors.values())
