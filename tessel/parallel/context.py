"""Context parallelism: each sequence split over the cp ranks, attention as a ring
(`torch.distributed.tensor.experimental.context_parallel`, CUDA only: PyTorch registers its
ring attention for the CUDA flash/efficient/cuDNN kernels, not for the CPU one).

Inputs, targets and the RoPE table are sharded along the sequence with PyTorch's load
balancing (rank i keeps chunks i and 2cp-1-i, so causal work is even). Each rank computes the
loss of its own tokens; FSDP's shard group spans dp_shard x cp, so gradients are summed over
the cp ranks by the same reduce-scatter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh

from tessel.config import Config
from tessel.models.transformer import Transformer
from tessel.parallel.dims import ParallelError


def check_context_parallel(cfg: Config, device: torch.device) -> None:
    """What this build's context parallelism supports; refuses the rest in one line."""
    p = cfg.parallel
    if p.cp == 1:
        return
    if device.type != "cuda":
        raise ParallelError(
            f"context parallelism (cp={p.cp}) runs ring attention on CUDA only; PyTorch has no "
            "CPU implementation: set parallel.cp=1"
        )
    if cfg.model.position != "rope":
        raise ParallelError(
            "context parallelism needs rotary positions (model.position='rope'); learned "
            "position embeddings are not sharded along the sequence"
        )
    if cfg.data.document_mask:
        raise ParallelError(
            "context parallelism runs causal ring attention without masks; set "
            "data.document_mask=false"
        )
    if p.tp > 1 or p.pp > 1:
        raise ParallelError("this build combines context parallelism with data parallelism only; "
                            "set parallel.tp=1 and parallel.pp=1")


@contextlib.contextmanager
def context_parallel_step(
    model: Transformer, cp_mesh: DeviceMesh | None, inputs: torch.Tensor, targets: torch.Tensor,
) -> Iterator[None]:
    """Within: SDPA is ring attention over `cp_mesh`, and `inputs`, `targets` and the model's
    RoPE table hold this rank's part of the sequence. A no-op without a cp mesh."""
    if cp_mesh is None or cp_mesh.size() == 1:
        yield
        return
    from torch.distributed.tensor.experimental import context_parallel

    full_table = model.rope_freqs
    freqs = full_table[: inputs.shape[1]].clone()  # (T, hd/2, 2): sharded like the tokens
    model.rope_freqs = freqs
    try:
        with context_parallel(cp_mesh, buffers=[inputs, targets, freqs], buffer_seq_dims=[1, 1, 0],
                              no_restore_buffers={inputs, targets, freqs}):
            yield
    finally:
        model.rope_freqs = full_table
