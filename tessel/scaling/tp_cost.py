"""What tensor parallelism costs the host per block, measured on this machine's processes.

A DTensor operator does host work a plain one does not: sharding propagation, the
redistributions its placements ask for, wrapping and unwrapping local tensors. On a GPU the
host issues kernels ahead of the device and that time hides behind them; on CPU processes
it adds to the step, and for a small model it is a large part of a tensor-parallel step.
The optimizer's multi-tensor operators and the gradient clipping run through DTensor too.
The planner takes two figures per block, one per micro-batch's forward + backward
(`GpuProfile.tp_block_overhead_s`) and one per optimizer phase
(`GpuProfile.tp_block_optimizer_s`), measured here inside the workers of the gloo
measurement (`tessel.scaling.gloo`), on their process group:

    pass overhead = (block time under tensor parallelism - the same block on one process)
                    - what the planner charges for the block's collective calls
    optimizer overhead = the same difference for the optimizer phase (clipping, AdamW)

where a block's time is the difference between models of 3 and 1 blocks (the embedding,
head and loss cancel), each the fastest of timed forward + backward passes at a tiny width
(the matmuls' and messages' bytes cost next to nothing, so what is left is the host work
and the calls' latency). The blocks are the config's own architecture (norm, MLP, biases,
attention heads' grouping, sequence parallelism) shrunk to that width, since each of those
changes the number of operators a block runs.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from tessel.config import ModelConfig
from tessel.planner.hardware import GpuProfile

LAYERS = (1, 5)
"""The two depths whose difference is two blocks."""
WARMUP = 3
"""Untimed passes of each model (DTensor caches its sharding decisions on the first)."""
REPEATS = 12
"""Timed passes of each model; the fastest is kept (another job on the machine only ever
adds time, and the planner predicts a machine of the run's own)."""
TOKENS = (2, 16)
"""(sequences, positions) of the timed micro-batch."""


def tiny_model(model: ModelConfig, tp: int, layers: int) -> ModelConfig:
    """`model`'s architecture at a width where compute and bytes cost next to nothing (its
    heads divisible by `tp`), dense (MoE layers are not split by tensor parallelism), with
    `layers` blocks."""
    heads = 2 * tp
    kv = heads if model.n_kv_heads == model.n_heads else tp
    return model.model_copy(update=dict(
        n_layers=layers, d_model=8 * heads, n_heads=heads, n_kv_heads=kv, head_dim=8,
        ffn_hidden=16 * heads, vocab_size=64 * tp, vocab_pad_to=8 * tp,
        max_seq_len=TOKENS[1], moe_experts=0, init_from=None, dropout=0.0))


def _seconds(model: torch.nn.Module, tokens: torch.Tensor, parallel: bool
             ) -> tuple[float, float]:
    """Fastest seconds of (one forward + backward, loss and all; one optimizer phase as the
    trainer runs it: gradient clipping, multi-tensor AdamW, zeroing), every rank starting
    each together."""
    from torch.distributed.tensor import DTensor

    from tessel.models.loss import token_loss_sum
    from tessel.parallel.grad_norm import clip_grad_norm
    from tessel.parallel.tensor import loss_context

    params = list(model.parameters())
    # Sharded and plain (replicated, e.g. learned positions) parameters in separate groups:
    # one multi-tensor operator cannot take both.
    groups = [{"params": [p for p in params if isinstance(p, DTensor) == sharded]}
              for sharded in (True, False)]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=1e-4, foreach=True)
    passes, steps = [], []
    for i in range(WARMUP + REPEATS):
        dist.barrier()
        start = time.perf_counter()
        logits = model(tokens)
        with loss_context(parallel):
            token_loss_sum(logits, tokens).backward()
        middle = time.perf_counter()
        dist.barrier()
        resumed = time.perf_counter()
        clip_grad_norm(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        end = time.perf_counter()
        if i >= WARMUP:
            passes.append(middle - start)
            steps.append(end - resumed)
    return min(passes), min(steps)


def block_overhead(model_fields: dict[str, Any], sequence_parallel: bool,
                   calls: GpuProfile) -> dict[str, float]:
    """Seconds of host work one tensor-parallel block adds, on the default process group as
    one tensor-parallel group: {"pass_s": per micro-batch (forward + backward) beyond what
    `calls` (a profile of the measured latency, bandwidth and curve) prices its collective
    calls at in the planner, "optimizer_s": per optimizer phase}; each >= 0 (a noisy
    machine can make a difference negative). Subtracting the planner's own price keeps the
    two consistent: the block's calls and its host work add up to what was measured."""
    from torch.distributed.device_mesh import init_device_mesh

    from tessel.models.transformer import Transformer
    from tessel.parallel.apply import materialise
    from tessel.parallel.tensor import apply_tensor_parallel
    from tessel.planner.layout import Layout
    from tessel.planner.speed import tp_calls, tp_calls_seconds

    tp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    base = ModelConfig.model_validate(model_fields)
    torch.manual_seed(0)
    tokens = torch.randint(0, 64 * tp, TOKENS)
    per_depth: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for parallel in (False, True):
        for layers in LAYERS:
            with torch.device("meta"):
                model = Transformer(tiny_model(base, tp, layers))
            if parallel:
                apply_tensor_parallel(model, mesh["tp"], sequence_parallel)
            materialise(model, torch.device("cpu"), seed=0)
            per_depth[parallel].append(_seconds(model, tokens, parallel))
    blocks = LAYERS[1] - LAYERS[0]

    def per_block(parallel: bool, part: int) -> float:
        shallow, deep = per_depth[parallel]
        return (deep[part] - shallow[part]) / blocks

    one_block = Layout(1, 1, tp, 1, 1, 0, TOKENS[0], sequence_parallel=sequence_parallel)
    act = TOKENS[0] * TOKENS[1] * tiny_model(base, tp, 1).d_model * 4  # fp32 activations
    priced = tp_calls_seconds(calls, one_block, act, 4, tp_calls(one_block, 1, 0, False, False),
                              False, False, calls.intra_node_gbps * 1e9 * calls.comm_efficiency)
    return {"pass_s": max(0.0, per_block(True, 0) - per_block(False, 0) - priced),
            "optimizer_s": max(0.0, per_block(True, 1) - per_block(False, 1))}
