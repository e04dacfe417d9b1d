"""Asynchronous tensor parallelism (parallel.async_tp): PyTorch's micro-pipelined TP.

Under sequence parallelism every column-parallel projection waits for an all-gather of the
sequence and every row-parallel one ends in a reduce-scatter. Inductor's micro-pipeline pass
(`torch._inductor.config._micro_pipeline_tp`) rewrites each all-gather -> matmul and
matmul -> reduce-scatter of a compiled graph into per-rank pieces exchanged through
symmetric memory, so that a piece's transfer runs while the matmul of the pieces already
there computes (forward and backward graphs alike). It needs the tensor-parallel group
registered for symmetric memory before the first compiled call, as torchtitan's
`_maybe_enable_async_tp` does; the blocks compile lazily, on their first call.
"""

from __future__ import annotations

import warnings

import torch
from torch.distributed.device_mesh import DeviceMesh

from tessel.config import Config, ParallelConfig
from tessel.parallel.dims import ParallelDims, ParallelError


def symmetric_memory_missing() -> str | None:
    """What this torch lacks for async TP (symmetric memory, the compiler pass), or None."""
    try:
        import torch._inductor.config as inductor
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group  # noqa: F401
    except ImportError:
        return "torch.distributed._symmetric_memory"
    if not hasattr(inductor, "_micro_pipeline_tp"):
        return "torch._inductor.config._micro_pipeline_tp"
    return None


def check_async_tp(cfg: Config, dims: ParallelDims, device: torch.device) -> None:
    """Raise ParallelError (one line, with the fix) unless parallel.async_tp can run here."""
    if not cfg.parallel.async_tp:
        return
    off = "or set parallel.async_tp = false"
    if device.type != "cuda":
        raise ParallelError(
            f"parallel.async_tp runs on CUDA GPUs only (symmetric memory between the "
            f"tensor-parallel ranks); this run is on {device.type}: set parallel.async_tp = false")
    if dims.tp == 1:
        raise ParallelError(f"parallel.async_tp overlaps tensor parallelism's collectives and "
                            f"this layout has tp = 1: set parallel.tp > 1 {off}")
    if not cfg.parallel.sequence_parallel:
        raise ParallelError(
            "parallel.async_tp pipelines sequence parallelism's all-gathers and reduce-scatters "
            f"with the projections: set parallel.sequence_parallel = true {off}")
    if not cfg.train.compile:
        raise ParallelError("parallel.async_tp is a pass of the compiler over each block's graph: "
                            f"set train.compile = true {off}")
    missing = symmetric_memory_missing()
    if missing:
        raise ParallelError(f"parallel.async_tp needs a torch with symmetric memory and the "
                            f"micro-pipeline pass ({missing} is missing in torch "
                            f"{torch.__version__}): upgrade torch {off}")


def enable_async_tp(p: ParallelConfig, tp_mesh: DeviceMesh) -> None:
    """With parallel.async_tp: register the tensor-parallel group for symmetric memory and
    turn the compiler's micro-pipeline pass on (for every graph compiled after this, in this
    process); without it, nothing."""
    if not p.async_tp:
        return
    import torch._inductor.config as inductor
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    with warnings.catch_warnings():
        # torch 2.12+ marks the call deprecated, yet its micro-pipeline pass still asks
        # is_symm_mem_enabled_for_group, which only this call makes true.
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    inductor._micro_pipeline_tp = True
