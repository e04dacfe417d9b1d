"""Checkpoints: atomic DCP save/load that reshards across layouts."""

from tessel.checkpoint.store import (
    CheckpointError,
    PendingSave,
    checkpoint_shapes,
    latest_checkpoint,
    list_checkpoints,
    load_model,
    load_optimizer,
    load_tensors,
    read_full,
    read_state,
    save_checkpoint,
)

__all__ = [
    "CheckpointError",
    "PendingSave",
    "checkpoint_shapes",
    "latest_checkpoint",
    "list_checkpoints",
    "load_model",
    "load_optimizer",
    "load_tensors",
    "read_full",
    "read_state",
    "save_checkpoint",
]
