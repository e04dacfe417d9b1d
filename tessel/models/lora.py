"""Low-rank adapters (LoRA, Hu et al. 2021) on the projections of a `Transformer`.

A target projection `W` (an `nn.Linear` of a block: attention wq/wk/wv/wo, MLP w1/w2/w3) keeps
its weight, frozen, and gains two children, `lora_A` (rank x in) and `lora_B` (out x rank);
its output becomes

    W x + (alpha / rank) * B A dropout(x)

The adapters are children of the projection rather than a wrapper around it, so every
existing parameter keeps its name (`layers.0.attention.wq.weight`: checkpoints, init_from,
the tensor-parallel plans and the Hugging Face mappings are unchanged) and the adapters are
named as peft names them (`...wq.lora_A.weight` <-> `...q_proj.lora_A.weight`). The extra term
is added by a forward hook on the projection.

Initialisation is peft's: A kaiming-uniform (a = sqrt(5), nn.Linear's default), B zero, so the
adapted model starts as the base model.

Nothing here knows about parallelism: the hook calls the adapter's `between` and `after`
steps, identities here, which `tessel.parallel.tensor.shard_lora` replaces when the base
projection is tensor-parallel.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable, Iterable

import torch
from torch import nn

# The projection names (and their check) are data of the config layer, which validates
# lora.targets without torch; re-exported here for the code that imports them from the model.
from tessel.config.lora import HF_TARGETS, TESSEL_TARGETS, TESSEL_TO_HF, LoraError, resolve_targets

__all__ = [
    "ADAPTER_SUFFIXES", "HF_TARGETS", "TESSEL_TARGETS", "TESSEL_TO_HF", "AdapterState",
    "LoraError", "adapted_modules", "add_lora", "attach", "cast_base", "initial_value",
    "is_adapter", "merged_weight", "resolve_targets",
]

ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def is_adapter(name: str) -> bool:
    """Whether parameter `name` is a LoRA adapter (trainable) rather than the base model."""
    return name.endswith(ADAPTER_SUFFIXES)


class AdapterState:
    """The state the hook of one adapted projection needs (kept off the module's attributes
    that nn.Module treats specially)."""

    def __init__(self, scaling: float, dropout: float):
        self.scaling = scaling
        self.dropout = dropout
        # Tensor parallelism replaces these (see the module docstring): `between` maps the
        # rank-r activations A x, `after` the adapter's output before it is added.
        self.between: Callable[[torch.Tensor], torch.Tensor] = lambda h: h
        self.after: Callable[[torch.Tensor], torch.Tensor] = lambda y: y


def add_lora(model: nn.Module, targets: Iterable[str], rank: int, alpha: float,
             dropout: float = 0.0) -> list[str]:
    """Give every block of `model` (a Transformer, or a pipeline stage of one; on any device,
    meta included) adapters on the `targets` projections and freeze every other parameter.
    Returns the adapted projections' names. LoraError when a target is absent from a block
    (e.g. `w3` without a gated MLP, or the MLP of an MoE layer)."""
    short = resolve_targets(targets)
    adapted = []
    for index, block in model.layers.items():
        for t in short:
            path = TESSEL_TARGETS[t]
            parent, _, leaf = path.rpartition(".")
            linear = getattr(block.get_submodule(parent), leaf, None)
            if not isinstance(linear, nn.Linear):
                what = "an MoE layer" if parent == "feed_forward" and linear is None and hasattr(
                    block.feed_forward, "router") else "this model"
                raise LoraError(f"lora.targets: layers.{index}.{path} does not exist in {what}; "
                                f"drop {t!r} from lora.targets")
            attach(linear, rank, alpha, dropout)
            adapted.append(f"layers.{index}.{path}")
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    return adapted


def attach(linear: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
    """Adapters `lora_A`, `lora_B` on `linear` (built on its weight's device, fp32, peft's
    initialisation) and the forward hook that adds their term."""
    device = linear.weight.device
    linear.lora_A = nn.Linear(linear.in_features, rank, bias=False, device=device)
    linear.lora_B = nn.Linear(rank, linear.out_features, bias=False, device=device)
    # nn.Linear's own init of A is peft's (kaiming-uniform, a = sqrt(5)); B starts at zero.
    # (A model built on meta is initialised later, per name: `initial_value`.)
    nn.init.zeros_(linear.lora_B.weight)
    linear.lora_adapter = AdapterState(alpha / rank, dropout)  # type: ignore[assignment]
    linear.register_forward_hook(_add_delta)


def _add_delta(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    ad: AdapterState = module.lora_adapter
    x = args[0]  # as the projection got it (a DTensor under tensor parallelism)
    if ad.dropout:  # the projection's training flag: model.train()/eval() reach it
        x = nn.functional.dropout(x, ad.dropout, training=module.training)
    a, b = module.lora_A.weight, module.lora_B.weight
    if torch.is_autocast_enabled(x.device.type):
        h = nn.functional.linear(x, a)
    else:  # the base may be held in bf16 (lora.base_dtype): the adapters compute in theirs
        h = nn.functional.linear(x.to(a.dtype), a)
    y = nn.functional.linear(ad.between(h), b) * ad.scaling
    return out + ad.after(y).to(out.dtype)


def adapted_modules(model: nn.Module) -> dict[str, nn.Linear]:
    """name -> projection, for every projection of `model` that has adapters."""
    return {name: m for name, m in model.named_modules() if hasattr(m, "lora_adapter")}


def initial_value(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The initial value of adapter `name` (float32, CPU), as peft initialises it: A
    kaiming-uniform with a = sqrt(5) (bound 1/sqrt(in)), B zero; seeded per name, so a
    shard or pipeline stage draws exactly the single-process values."""
    if name.endswith(".lora_B.weight"):
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    bound = 1.0 / math.sqrt(shape[1])  # kaiming_uniform_(a=sqrt(5)): gain sqrt(1/3)
    return (torch.rand(shape, generator=gen) * 2 - 1) * bound


def cast_base(model: nn.Module, dtype: torch.dtype) -> None:
    """Hold the frozen weights of the blocks' projections in `dtype` (lora.base_dtype): the
    projection casts its input to it and its output back, so the rest of the model is
    unchanged. The cast happens inside the projection's forward, so the adapters' hook gets
    the input as it came (as peft's adapters do): adapters of one input (wq/wk/wv, w1/w3)
    share it for backward rather than each saving its own float32 copy of the cast."""
    for block in model.layers.values():
        for m in block.modules():
            if isinstance(m, nn.Linear) and not m.weight.requires_grad and m.weight.dtype != dtype:
                m.to(dtype)
                for child in ("lora_A", "lora_B"):  # adapters stay in float32
                    if hasattr(m, child):
                        getattr(m, child).float()
                m.forward = functools.partial(_cast_forward, m)  # type: ignore[method-assign]


def _cast_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.is_autocast_enabled(x.device.type):  # autocast casts both itself
        return nn.functional.linear(x, module.weight, module.bias)
    out = nn.functional.linear(x.to(module.weight.dtype), module.weight, module.bias)
    return out.to(x.dtype)


@torch.no_grad()
def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  scaling: float) -> torch.Tensor:
    """W + scaling * B @ A in float32 (the merged projection of an export)."""
    return weight.float() + scaling * (b.float() @ a.float())
