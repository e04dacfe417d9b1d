"""Which device a process trains (or samples) on."""

from __future__ import annotations

import torch

from tessel.errors import TesselError


def pick_device(name: str) -> torch.device:
    """`auto` (CUDA when present, else CPU), `cpu` or `cuda` (refused without a GPU)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise TesselError("train.device='cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
    return torch.device(name)
