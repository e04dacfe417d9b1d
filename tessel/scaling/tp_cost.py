"""What tensor parallelism costs a block beyond its share of the compute and its collectives,
measured on this machine's processes.

A DTensor operator does host work a plain one does not: sharding propagation, the
redistributions its placements ask for (with their copies), wrapping and unwrapping local
tensors; and a block's matmuls, a tp-th of the whole, run less efficiently. On a GPU the host
issues kernels ahead of the device and that time hides behind them; on CPU processes it
adds to the step, and for a small model it is a large part of a tensor-parallel step. The
optimizer's multi-tensor operators and the gradient clipping run through DTensor too. The
planner takes two figures per block, one per micro-batch's forward + backward
(`GpuProfile.tp_block_overhead_s`) and one per optimizer phase
(`GpuProfile.tp_block_optimizer_s`), measured here inside the workers of the gloo
measurement (`tessel.scaling.gloo`), each rank as its rank of the tensor-parallel group:

    pass overhead = block time under tensor parallelism - the same block on one process / tp
    optimizer overhead = the same for the optimizer phase (clipping, AdamW)

where a block's time is the difference between models of 3 and 1 blocks (the embedding,
head and loss cancel), each the fastest of timed forward + backward passes (the four
models timed in turn, round after round) of the config's
own micro-batch at its own width and architecture (dense: MoE layers are not split by
tensor parallelism). The tensor-parallel blocks run on PyTorch's fake process group, whose
collectives move nothing and return at once: the calls are priced by the gloo measurement,
not here. (An earlier version timed a tiny width with real collectives and subtracted their
measured latency; on the project's machine it read 0-2.5 ms per demo block where the real
width under the fake group reads ~8 ms, and a tp=2 step with every collective made free ran
0.25-0.27 s where the planner then said ~0.19 s of compute.)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tessel.config import ModelConfig

LAYERS = (1, 3)
"""The two depths whose difference is two blocks."""
WARMUP = 2
"""Untimed passes of each model (DTensor caches its sharding decisions on the first)."""
REPEATS = 7
"""Timed passes of each model, the models in turn; the fastest is kept."""


def _up(n: int, k: int) -> int:
    return -(-n // k) * k


def probe_model(model: ModelConfig, layers: int, seq_len: int, tp: int = 1,
                dense: bool = True) -> ModelConfig:
    """`model` as the probe times it: `layers` blocks, dense unless `dense` is False (MoE
    layers are not split by tensor parallelism; the drift probe, `tessel.scaling.gloo`, keeps
    them), fresh, without dropout, positions for `seq_len`; its heads, MLP
    width and vocabulary rows rounded up to multiples of `tp` where they do not split (the
    nearest shape `tp` processes can run: the sweep's largest count need not divide the
    model, whose point then fails on its own, while the smaller ones still want the
    figure)."""
    kv = _up(model.n_kv_heads, tp)
    heads = kv * -(-model.n_heads // model.n_kv_heads)  # the same heads per key/value head
    return model.model_copy(update=dict(
        n_layers=layers, moe_experts=0 if dense else model.moe_experts, init_from=None,
        dropout=0.0,
        max_seq_len=max(_up(seq_len, tp), model.max_seq_len), n_heads=heads, n_kv_heads=kv,
        ffn_hidden=_up(model.ffn_hidden, tp),
        vocab_pad_to=math.lcm(model.vocab_pad_to, tp)))


def _timer(model: torch.nn.Module, tokens: torch.Tensor, parallel: bool
           ) -> Callable[[], tuple[float, float]]:
    """A function timing, on each call, (one forward + backward, loss and all; one optimizer
    phase as the trainer runs it: gradient clipping, multi-tensor AdamW, zeroing) of `model`,
    every rank starting each together."""
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

    def once() -> tuple[float, float]:
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
        return middle - start, time.perf_counter() - resumed

    return once


def block_overhead(model_fields: dict[str, Any], sequence_parallel: bool,
                   tokens: tuple[int, int]) -> dict[str, float]:
    """Seconds one tensor-parallel block adds beyond a tp-th of the same block on one
    process, the ranks of the default process group as one tensor-parallel group over a
    fake process group (module docstring): {"pass_s": per micro-batch of `tokens`
    (sequences, positions) forward + backward, "optimizer_s": per optimizer phase}; each
    >= 0 (a noisy machine can make a difference negative)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 (registers "fake")
    from torch.distributed.device_mesh import DeviceMesh

    from tessel.models.init import materialise
    from tessel.models.transformer import Transformer
    from tessel.parallel.placement import MESH
    from tessel.parallel.tensor import apply_tensor_parallel

    tp = dist.get_world_size()
    fake = dist.new_group(list(range(tp)), backend="fake")
    mesh = DeviceMesh.from_group(fake, "cpu", mesh_dim_names=("tp",))
    base = ModelConfig.model_validate(model_fields)
    sequences, positions = tokens[0], _up(tokens[1], tp)  # sequence parallelism splits them
    torch.manual_seed(0)
    batch = torch.randint(0, base.vocab_size, (sequences, positions))
    timers = {}
    for parallel in (False, True):
        for layers in LAYERS:
            with torch.device("meta"):
                model = Transformer(probe_model(base, layers, positions, tp))
            if parallel:
                apply_tensor_parallel(model, mesh, sequence_parallel)
            materialise(model, torch.device("cpu"), seed=0, placement=MESH)
            timers[parallel, layers] = _timer(model, batch, parallel)
    # The four models in turn, round after round, each figure the fastest of its rounds: a
    # load that comes and goes (the other tests of a suite, another job) slows them alike
    # and the fastest pass is what the machine can do (medians of one model after another
    # made the difference of differences below come out 0 on a loaded machine).
    times: dict[tuple[bool, int], list[tuple[float, float]]] = {key: [] for key in timers}
    for round_ in range(WARMUP + REPEATS):
        for key, once in timers.items():
            taken = once()
            if round_ >= WARMUP:
                times[key].append(taken)
    blocks = LAYERS[1] - LAYERS[0]

    def per_block(parallel: bool, part: int) -> float:
        shallow, deep = (min(t[part] for t in times[parallel, layers]) for layers in LAYERS)
        return (deep - shallow) / blocks

    return {"pass_s": max(0.0, per_block(True, 0) - per_block(False, 0) / tp),
            "optimizer_s": max(0.0, per_block(True, 1) - per_block(False, 1) / tp)}
