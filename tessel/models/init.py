"""Materialise a model built on the meta device: allocate its tensors and give every
parameter its initial value, the same full value whatever share of it a rank holds.

Where a rank's share lives is a port, `Placement`: `Whole` here (every tensor whole, on one
device); `tessel.parallel.placement.MESH` for a model the parallel layer has placed on the
mesh (DTensor slices, FSDP's CPU offload). Nothing here starts a collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from tessel.models import lora
from tessel.models.transformer import Transformer

InitialValue = Callable[[str, tuple[int, ...]], torch.Tensor]
"""The full initial value of a parameter, by name and shape."""
InitialBuffer = Callable[[str, tuple[int, ...]], "torch.Tensor | None"]
"""The full value of a persistent buffer (trained state, e.g. the MoE balancing bias), by
name and shape, or None to keep the fresh model's value."""


class Placement(Protocol):
    """Where this rank holds its share of a model's tensors."""

    def params_device(self, model: nn.Module, device: torch.device) -> torch.device:
        """Where `model`'s parameters are allocated when it computes on `device`."""
        ...

    def fill(self, tensor: torch.Tensor, full: torch.Tensor) -> None:
        """Copy this rank's share of `full` (the whole value, on any device) into `tensor`."""
        ...


class Whole:
    """Every tensor whole, on the device the model computes on."""

    def params_device(self, model: nn.Module, device: torch.device) -> torch.device:
        return device

    def fill(self, tensor: torch.Tensor, full: torch.Tensor) -> None:
        tensor.copy_(full)


@torch.no_grad()
def materialise(model: Transformer, device: torch.device, seed: int,
                initial: InitialValue | None = None,
                initial_buffer: InitialBuffer | None = None,
                placement: Placement | None = None) -> None:
    """Allocate `model`'s parameters on `device` (or where `placement` keeps them) and give
    each its share of the full initial value (`initial(name, shape)`, else the seeded
    initialisation); the persistent buffers take `initial_buffer(name, shape)` where it
    gives one."""
    place = placement if placement is not None else Whole()
    params_device = place.params_device(model, device)
    model.to_empty(device=params_device)
    model.tie_weights()
    for name, param in model.named_parameters():
        if lora.is_adapter(name):  # never in the base weights: peft's initialisation
            full = lora.initial_value(name, tuple(param.shape), seed)
        elif initial is not None:
            full = initial(name, tuple(param.shape))
        else:
            full = model.initial_value(name, param.shape, seed)
        place.fill(param, full)
    if params_device != device:  # buffers live on the compute device
        for module in model.modules():
            for key, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[key] = buf.to(device)
    model.init_buffers(place.fill)
    if initial_buffer is not None:
        # The persistent buffers are what the state dict holds besides the parameters.
        for name, buf in model.state_dict(keep_vars=True).items():
            if not isinstance(buf, nn.Parameter):
                full = initial_buffer(name, tuple(buf.shape))
                if full is not None:
                    buf.copy_(full)
