"""Checkpoints: atomic DCP save/load that reshards across layouts."""

from tessel.checkpoint.errors import CheckpointError
from tessel.checkpoint.pending import CheckpointWriteError, PendingSave
from tessel.checkpoint.state_file import read_state
from tessel.checkpoint.store import (
    CHECKPOINTS_DIR,
    checkpoint_shapes,
    find_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_model,
    load_optimizer,
    load_tensors,
    read_full,
    save_checkpoint,
)

__all__ = [
    "CheckpointError",
    "CheckpointWriteError",
    "PendingSave",
    "CHECKPOINTS_DIR",
    "checkpoint_shapes",
    "find_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "load_model",
    "load_optimizer",
    "load_tensors",
    "read_full",
    "read_state",
    "save_checkpoint",
]
