"""`tessel checkpoint consolidate`: one safetensors file of the full model from a sharded
checkpoint saved under any layout. A LoRA checkpoint holds adapters only: its file is the
base (model.init_from) with the adapters merged, an ordinary model like any other."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from tessel.checkpoint.errors import CheckpointError, check_finite
from tessel.checkpoint.run_config import run_config
from tessel.checkpoint.state_file import read_state
from tessel.checkpoint.store import find_checkpoint, read_full
from tessel.fileio import fsync_dir


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory, or a run directory (its latest checkpoint)."""
    found = find_checkpoint(path)
    if found is None:
        raise CheckpointError(f"{str(path)!r} is neither a checkpoint nor a run with checkpoints")
    return found


def consolidate(ckpt: Path, output: Path) -> tuple[int, int, str]:
    """Write every model tensor of `ckpt`, unsharded, to `output` (atomically); returns
    (tensors, bytes, a note on what was written: "" for a checkpoint's own tensors). A tied
    output projection is stored once, as the embedding."""
    from tessel.checkpoint.lora import lora_config_of, merged_tensors

    state = read_state(ckpt)
    model_cfg = run_config(ckpt, state).model.model_dump()
    lora = lora_config_of(ckpt)
    tensors: dict[str, torch.Tensor]
    if lora is not None:  # adapters alone are no model: merge them into the base
        cfg = lora[0]
        tensors = merged_tensors(*lora)
        base = cfg.model.init_from or f"the random base of train.seed={cfg.train.seed}"
        note = (f"LoRA adapters merged into the base {base} (W + alpha/rank B A); for the "
                "adapters alone: tessel convert tessel-to-hf RUN OUT --peft")
    else:
        tied = bool(model_cfg.get("tie_embeddings"))
        tensors = read_full(ckpt, "model", skip={"output.weight"} if tied else set())
        for name, t in tensors.items():
            check_finite(t, name, repr(str(ckpt)))
        note = ""
    info = {"format": "tessel", "step": str(state["step"]), "model_config": json.dumps(model_cfg)}
    if lora is not None:
        info["source"] = f"LoRA checkpoint {ckpt} merged into its base"
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=info)
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(output.parent)
    return len(tensors), sum(t.numel() * t.element_size() for t in tensors.values()), note
