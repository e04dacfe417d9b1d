"""The checkpoint package's error (one line, meant for the user)."""

from __future__ import annotations

from typing import Any

from tessel.errors import TesselError


class CheckpointError(TesselError):
    """Unusable checkpoint; the message is one line meant for the user."""


def short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def check_finite(tensor: Any, name: str, where: str) -> Any:
    """`tensor`, refused (CheckpointError, one line naming it) when it holds NaN or infinity:
    weights tessel reads (an import, model.init_from, a checkpoint to export or sample) or
    writes (an export, a consolidated file) are never used or written silently so, since
    every result computed from them is then NaN, or, where a comparison skips them (the MoE
    balancing bias's spread), wrong without a sign."""
    if tensor.is_floating_point() and not bool(tensor.isfinite().all()):
        bad = int((~tensor.isfinite()).sum())
        raise CheckpointError(
            f"{where}: tensor {name!r} holds {bad:,} NaN or infinite value(s) of "
            f"{tensor.numel():,}; the weights are damaged or their training diverged: use a "
            "checkpoint saved before (or the weights as they were)")
    return tensor
