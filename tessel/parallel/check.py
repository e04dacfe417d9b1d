"""The one layout check: can tessel run this config's parallel layout on this kind of device?

Called by the trainer before anything is built and by the planner for every candidate
layout, so a layout the planner proposes is one the trainer accepts, with the same words.
"""

from __future__ import annotations

import torch

from tessel.config import Config
from tessel.parallel.async_tp import check_async_tp
from tessel.parallel.dims import ParallelDims, ParallelError, resolve_zero
from tessel.parallel.fsdp import check_offload
from tessel.parallel.replica_group import check_replicas


def check_layout(cfg: Config, dims: ParallelDims, device: torch.device | str,
                 precision: str) -> None:
    """Raise ParallelError (one line, with the fix) unless `dims` can run `cfg` on `device`
    (a real device or just its type) in `precision` (resolved: fp32, bf16 or fp16)."""
    device = torch.device(device)
    dims.validate(cfg)
    check_replicas(cfg, dims, precision)
    p = cfg.parallel
    check_offload(p, device)
    check_async_tp(cfg, dims, device)
    if p.offload != "none" and cfg.optim.state_dtype != "float32":
        raise ParallelError(
            f"parallel.offload = {p.offload!r} keeps float32 optimizer state; set "
            f'optim.state_dtype = "float32" or parallel.offload = "none"')
    if cfg.optim.state_dtype == "int8" and (dims.tp > 1 or dims.ep > 1):
        # torchao's quantised state is tested here only on plain and FSDP2-sharded tensors
        raise ParallelError(
            "optim.state_dtype = 'int8' (torchao's AdamW8bit) runs in one process, DDP, "
            "ZeRO/FSDP2 and pipeline layouts, not with tensor or expert parallelism; use "
            "optim.state_dtype = 'bfloat16' there")
    if p.offload != "none" and cfg.optim.name != "adamw":
        # Muon gathers whole matrices with the device's collectives: not from host memory
        raise ParallelError(
            f"parallel.offload = {p.offload!r} runs AdamW only, not optim.name = "
            f'{cfg.optim.name!r}; set parallel.offload = "none" or optim.name = "adamw"')
    if p.dp_comm_hook == "bf16" and device.type != "cuda":
        raise ParallelError(
            "dp_comm_hook='bf16' needs NCCL (CUDA); on CPU use 'fp16' or 'powersgd'"
        )
    if precision == "fp16" and dims.world_size > 1 and (resolve_zero(p) > 0 or dims.tp > 1 or dims.pp > 1):
        raise ParallelError(
            "fp16 loss scaling is supported for one process or DDP (zero=0) only; use "
            "train.precision='bf16' (no loss scaling needed) for sharded layouts"
        )
