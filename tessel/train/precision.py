"""Mixed precision: autocast over fp32 weights, loss scaling for fp16."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass

import torch

from tessel.errors import TesselError


@dataclass
class Precision:
    name: str  # fp32 | bf16 | fp16
    autocast: Callable[[], ContextManager]
    scaler: torch.amp.GradScaler | None  # only for fp16


class PrecisionError(TesselError):
    pass


def resolve_precision(requested: str, device: torch.device) -> Precision:
    name = requested
    if name == "auto":
        bf16_ok = device.type == "cuda" and torch.cuda.is_bf16_supported()
        name = "bf16" if bf16_ok else "fp32"
    if name == "fp32":
        return Precision(name, contextlib.nullcontext, None)
    if name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise PrecisionError(
            "this GPU does not support bf16; use train.precision='fp16' or 'fp32'"
        )
    dtype = torch.bfloat16 if name == "bf16" else torch.float16

    def autocast() -> ContextManager:
        return torch.autocast(device_type=device.type, dtype=dtype)

    # fp16 overflows without a dynamic loss scale; bf16 has fp32's exponent range and needs none.
    scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None
    return Precision(name, autocast, scaler)
