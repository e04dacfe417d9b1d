"""Checkpoints: atomic safetensors + JSON save/load (HF import/export and resharding later)."""

from tessel.checkpoint.store import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_model,
    load_optimizer,
    read_state,
    read_tensors,
    save_checkpoint,
)

__all__ = [
    "CheckpointError",
    "latest_checkpoint",
    "list_checkpoints",
    "load_model",
    "load_optimizer",
    "read_state",
    "read_tensors",
    "save_checkpoint",
]
