"""What LoRA (lora.enabled) changes in a memory estimate: the adapters' own parameters per
tensor-parallel rank, the bytes of the frozen base, and the adapters the activation probe
runs with (what a LoRA block saves is measured, like the base model's: `probe_adapters`).

The base has no gradients and no optimizer state; only the adapters train. Their placement
under tensor parallelism is `tessel.parallel.tensor.shard_lora`'s: beside a column-parallel
projection A is whole and B split by tp, beside a row-parallel one A is split and B whole.
"""

from __future__ import annotations

import torch
from torch import nn

from tessel.config import LoraConfig, ModelConfig
from tessel.models.lora import TESSEL_TARGETS, add_lora, cast_base, resolve_targets

PROBE_RANK = 5
"""The probe's adapter rank: a width per token no other tensor of the probe has, so what
the adapters save at width rank (A x) is told apart and scaled to lora.rank."""


def projection_shapes(m: ModelConfig) -> dict[str, tuple[int, int, bool]]:
    """tessel projection name -> (in, out, column-parallel) for a dense block."""
    d, f, q, kv = m.d_model, m.ffn_hidden, m.q_dim, m.n_kv_heads * m.head_dim
    shapes = {"wq": (d, q, True), "wk": (d, kv, True), "wv": (d, kv, True),
              "wo": (q, d, False), "w1": (d, f, True), "w2": (f, d, False)}
    if m.mlp != "gelu":
        shapes["w3"] = (d, f, True)
    return shapes


def adapter_parameters(m: ModelConfig, lora: LoraConfig, layers: int, moe_layers: int,
                       tp: int) -> int:
    """Adapter elements on one tensor-parallel rank holding `layers` blocks, `moe_layers` of
    them MoE layers (whose MLP has no adapters)."""
    shapes = projection_shapes(m)
    total = 0
    for t in resolve_targets(lora.targets):
        if t not in shapes:
            continue  # the trainer refuses it (the model has no such projection)
        n_in, n_out, column = shapes[t]
        per_layer = (lora.rank * n_in + lora.rank * n_out // tp if column
                     else lora.rank * n_in // tp + lora.rank * n_out)
        total += per_layer * (layers - moe_layers if t in ("w1", "w2", "w3") else layers)
    return total


def cast_elements(lora: LoraConfig, block_matmul: int, experts: int, head_matmul: int,
                  adapters: int, checkpointing: str) -> int:
    """Weight elements whose autocast copies (bf16 without FSDP) one LoRA micro-batch keeps
    for backward: the head's; without recomputation also the adapters', the routed experts'
    and the blocks' other projections (`block_matmul`) when held in float32 (a bf16 base is
    used as it is). Frozen weights are cast anew at each use (autocast caches only weights
    that train), each copy kept by its matmul; the first block's projections whose input
    needs no gradient keep none, which is left out (the count is at most one block's
    attention projections high)."""
    if checkpointing != "none":
        return head_matmul
    base = block_matmul if lora.base_dtype == "float32" else 0
    return head_matmul + adapters + experts + base


def base_block_matmul_bytes(lora: LoraConfig) -> int:
    """Bytes per element of the frozen blocks' projection weights (lora.base_dtype; the
    routed experts' are not projections, `tessel.models.lora.cast_base`: float32)."""
    return 2 if lora.base_dtype == "bfloat16" else 4


def probe_adapters(model: nn.Module, lora: LoraConfig) -> None:
    """Give a probe model (`tessel.planner.record`) the run's adapters: on those of
    lora.targets its blocks have (an MoE probe's block has no dense MLP), at PROBE_RANK,
    with lora.dropout, the rest frozen, the base in lora.base_dtype."""
    block = next(iter(model.layers.values()))
    targets = [t for t in resolve_targets(lora.targets)
               if isinstance(_submodule(block, TESSEL_TARGETS[t]), nn.Linear)]
    add_lora(model, targets, PROBE_RANK, lora.alpha, lora.dropout)
    if lora.base_dtype == "bfloat16":
        cast_base(model, torch.bfloat16)


def _submodule(block: nn.Module, path: str) -> nn.Module | None:
    parent, _, leaf = path.rpartition(".")
    return getattr(block.get_submodule(parent), leaf, None)
