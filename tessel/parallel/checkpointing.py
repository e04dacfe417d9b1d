"""Activation checkpointing: which activations a block keeps for backward and which it
recomputes, per policy (`parallel.activation_checkpointing`), and on which blocks
(`parallel.activation_checkpointing_every`).

- `full`: a block keeps its input only and recomputes its whole forward in backward.
- `selective`: the per-operator policy torchtitan uses: keep the attention kernel's outputs,
  what collectives return (so tensor parallelism's calls are not repeated in backward) and
  every other matmul output of the block (in a Llama block: wq, wv, w1 and w2 kept; wk, wo
  and w3 recomputed); recompute the rest (norms, activations, RoPE, residual adds).
- `matmuls`: keep every matmul and attention output (Megatron's "selective": only the cheap
  element-wise ops are recomputed); more memory than `selective`, about 3% recompute.

The policy is one object per checkpointed region (`KeepRule`), so the activation probe of the
planner (tessel/planner/record.py) asks the same rule what a block keeps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

POLICIES = ("none", "full", "selective", "matmuls")

ATTENTION_OPS = frozenset({
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
})
MATMUL_OPS = frozenset({
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.linear.default,
})
"""The projections' matmuls as the dispatcher sees them (nn.Linear decomposes to mm, with a
bias to addmm)."""


def _collectives() -> frozenset:
    """What functional collectives return (DTensor's redistributions issue these): kept by
    the per-op policy so that the backward's recomputation does not call them again."""
    ops = torch.ops._c10d_functional
    return frozenset(getattr(ops, name).default for name in (
        "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single",
        "wait_tensor") if hasattr(ops, name))


COLLECTIVE_OPS = _collectives()


class KeepRule:
    """Whether an operator's output is kept, for one checkpointed region (one block's
    forward and its recomputation, each counting its own matmuls)."""

    def __init__(self, policy: str):
        self.policy = policy
        self.matmuls = {False: 0, True: 0}  # matmuls seen so far: forward, recomputation

    def keeps(self, func: object, recompute: bool = False) -> bool:
        if func in ATTENTION_OPS:
            return True
        if func in MATMUL_OPS:
            if self.policy == "matmuls":
                return True
            self.matmuls[recompute] += 1
            return self.matmuls[recompute] % 2 == 1  # the 1st, 3rd, 5th, ... of the block
        return self.policy == "selective" and func in COLLECTIVE_OPS


def _policy(rule: KeepRule, ctx, func, *args, **kwargs) -> CheckpointPolicy:  # noqa: ANN001
    keep = rule.keeps(func, ctx.is_recompute)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _contexts(policy: str):  # noqa: ANN202
    """Fresh contexts (and a fresh matmul count) for each checkpointed call."""
    return create_selective_checkpoint_contexts(functools.partial(_policy, KeepRule(policy)))


def checkpointed_blocks(n_layers: int, every: int) -> range:
    """The block indices checkpointing applies to: every `every`-th (1: all; 2: 1, 3, 5, ...,
    as torchtitan counts its layers from one)."""
    return range(every - 1, n_layers, every)


def apply_activation_checkpointing(model: torch.nn.Module, mode: str, every: int = 1) -> None:
    """Recompute the activations of every `every`-th block of `model` (its `layers`, keyed by
    global block index) in the backward pass under policy `mode`. Overrides `forward` on the
    block instance rather than wrapping the module, so parameter names do not change."""
    if mode == "none":
        return
    if mode not in POLICIES:
        raise ValueError(f"unknown activation checkpointing policy {mode!r}")
    chosen = set(checkpointed_blocks(model.cfg.n_layers, every))
    context_fn: Callable | None = None
    if mode != "full":
        context_fn = functools.partial(_contexts, mode)
    for key, block in model.layers.items():
        if int(key) not in chosen:
            continue
        inner = block.forward

        def forward(*args, _inner=inner, **kwargs):  # noqa: ANN002, ANN003
            extra = {"context_fn": context_fn} if context_fn is not None else {}
            return checkpoint(_inner, *args, use_reentrant=False, **extra, **kwargs)

        block.forward = forward  # type: ignore[method-assign]
