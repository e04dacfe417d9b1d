"""Data parallelism: DDP (zero = 0) or FSDP2 `fully_shard` for ZeRO stages 1-3, HSDP when
dp_replicate > 1, and FSDP2's CPU offload. Replicated data parallelism beside tensor or
pipeline parallelism (zero = 0 with tp or pp > 1) is FSDP2 over a (replicas, 1) mesh: a shard
group of one, so parameters and optimizer state are whole on every rank and gradients are
all-reduced once per step, as torchtitan's FSDP2-based `replicate` does.

How the ZeRO stages map onto FSDP2 (parameters are DTensors sharded over the shard group in
every stage, so the optimizer always holds 1/dp_shard of its state):

    zero 1  parameters stay gathered and gradients accumulate unsharded through the
            micro-batches of a step; one reduce-scatter at the last (Megatron's distributed
            optimizer).  See `DataParallel.micro_batch`.
    zero 2  gradients are reduce-scattered after every micro-batch's backward; parameters
            are gathered once per forward and kept for the backward.
    zero 3  parameters are gathered for each block's forward and again for its backward.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard
from torch.nn.parallel import DistributedDataParallel as DDP

from tessel.config import ParallelConfig
from tessel.errors import TesselError
from tessel.models.transformer import Transformer

DDP_BUCKET_MB = 25  # PyTorch's default; the first bucket's all-reduce starts while backward runs


@dataclass(frozen=True)
class ExpertSharding:
    """How FSDP shards the routed experts under expert parallelism."""

    mesh: DeviceMesh
    """The experts' own shard group (efsdp), or (dp_replicate, efsdp) for HSDP."""
    divide_factor: int
    """The whole data-parallel degree: each expert's gradient already sums the losses of
    the ep ranks that sent it tokens (tessel.parallel.expert)."""


def apply_fsdp(
    model: Transformer,
    mesh: DeviceMesh,
    zero: int,
    param_dtype: torch.dtype | None,
    offload_params: bool,
    experts: ExpertSharding | None = None,
) -> None:
    """Shard each block, then the rest (embeddings, final norm, head) as the root unit.

    `mesh` is the shard group, or a 2-D (replicate, shard) mesh for HSDP. Gradients are
    always reduced in fp32, whatever the compute dtype. With expert parallelism each MoE
    layer's routed experts are a unit of their own over `experts.mesh`, sharded along
    dimension 1 (dimension 0, the experts, is already split over the ep ranks).
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    kwargs = {"mesh": mesh, "mp_policy": mp}
    if offload_params:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's backward starts right after its forward: resharding it would
        # gather it again at once.
        reshard = zero == 3 and i < len(blocks) - 1
        routed = getattr(block.feed_forward, "experts", None)
        if experts is not None and routed is not None:
            fully_shard(routed, mesh=experts.mesh, mp_policy=mp,
                        shard_placement_fn=lambda _: Shard(1), reshard_after_forward=reshard,
                        **({"offload_policy": kwargs["offload_policy"]}
                           if offload_params else {}))
            routed.set_gradient_divide_factor(experts.divide_factor)
            if experts.mesh.device_type == "cpu" and experts.mesh.size(-1) > 1:
                # Gloo has no PREMUL_SUM (NCCL's multiply-then-sum): sum, then divide. Not
                # for a shard group of one, where torch 2.13's FSDP2 divides by the factor
                # when it copies the gradient instead of reducing it, and would divide twice.
                routed.set_force_sum_reduction_for_comms(True)
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    fully_shard(model, reshard_after_forward=zero == 3, **kwargs)


# No broadcast of buffers before each forward (DDP's default): tessel's are constant (rotary
# table, vocabulary mask) or kept equal on every rank by tessel itself (MoE routing statistics
# are all-reduced and the balancing bias moved identically), so the broadcast was a collective
# per step, and a wait for the slowest rank, for nothing. torch 2.13 names it
# forward_sync_buffers (buffers still synced once at construction); 2.11-2.12 broadcast_buffers.
NO_FORWARD_BUFFER_SYNC = ({"forward_sync_buffers": False}
                          if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
                          else {"broadcast_buffers": False})


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, hook: str) -> DDP:
    """Wrap in DDP over the data-parallel group: bucketed all-reduce overlapped with backward.
    `hook` compresses the all-reduce (bf16/fp16 halve the bytes; PowerSGD sends a rank-2
    approximation with error feedback)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    group = dp_mesh.get_group()
    wrapped = DDP(model, process_group=group, bucket_cap_mb=DDP_BUCKET_MB,
                  gradient_as_bucket_view=True, **NO_FORWARD_BUFFER_SYNC)
    if hook == "bf16":
        wrapped.register_comm_hook(group, default_hooks.bf16_compress_hook)
    elif hook == "fp16":
        wrapped.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=2,
                                            start_powerSGD_iter=2)
        wrapped.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return wrapped


@dataclass
class DataParallel:
    """What the training loop needs to know about the data-parallel wrapper of each part."""

    kind: str  # "none" | "ddp" | "replicate" | "fsdp"
    zero: int

    @contextlib.contextmanager
    def micro_batch(self, modules: list[nn.Module], last: bool) -> Iterator[None]:
        """Around one micro-batch's forward+backward (not used by pipeline schedules, which
        manage gradient sync themselves): gradients are reduced only where needed."""
        if self.kind == "ddp" and not last:
            with contextlib.ExitStack() as stack:
                for m in modules:
                    stack.enter_context(m.no_sync())  # type: ignore[operator]
                yield
            return
        if (self.kind == "fsdp" and self.zero == 1) or self.kind == "replicate":
            for m in modules:
                assert isinstance(m, FSDPModule)
                # Accumulate unsharded gradients, keep parameters gathered, until the last.
                m.set_requires_gradient_sync(last)
                m.set_reshard_after_backward(last)
        yield


def data_parallel_kind(zero: int, dp_cp: int, tp: int, pp: int) -> str:
    """none (one replica) | ddp (zero 0, whole models) | replicate (zero 0 beside tp/pp:
    FSDP2 over a shard group of one, since DDP wraps neither DTensor parameters nor
    pipeline stages) | fsdp (ZeRO 1-3)."""
    if dp_cp == 1:
        return "none"
    if zero == 0:
        return "ddp" if tp == 1 and pp == 1 else "replicate"
    return "fsdp"


def check_offload(p: ParallelConfig, device: torch.device) -> None:
    # offload = "optimizer" runs anywhere: on a CPU device the state already is in host
    # memory and the same code runs without copies (which is how it is tested).
    if p.offload == "params" and device.type != "cuda":
        raise TesselError(
            f"parallel.offload={p.offload!r} moves state from GPU to host memory; on "
            f"{device.type} everything already is in host memory: set parallel.offload='none'"
        )
