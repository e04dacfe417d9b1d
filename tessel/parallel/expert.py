"""Expert parallelism: each MoE layer's routed experts split over the `ep` ranks of an expert
group, tokens sent to their experts' ranks and back with `all_to_all_single`.

    this rank's N*k token slots, sorted by (global) expert
    -> all-to-all of the counts: what each rank sends me, per local expert
    -> all-to-all of the slots (uneven splits)       rows grouped by (source rank, local expert)
    -> re-sorted by local expert -> the grouped expert MLPs -> back to (source rank, expert)
    -> all-to-all back (the reverse splits)            this rank's slots, in their sorted order

The experts' weights are DTensors sharded Shard(0) (the expert dimension) over the ep mesh,
so checkpoints hold the full (experts, in, out) tensors and reshard across ep sizes; FSDP2
then shards each rank's experts over the experts' own data-parallel group (efsdp).

Gradient scale: the gradient an expert receives through the combine all-to-all already sums
the losses of all ep ranks that sent it tokens, and efsdp's reduction adds the rest of the
data-parallel ranks, so the experts' FSDP divides by the whole data-parallel degree
(`expert_gradient_divide_factor`), as the dense parameters' reduction does.

`MeshExperts` is the distributed `tessel.models.moe.ExpertExchange` a MoE layer holds once
any of these places it (`mesh_experts`): expert parallelism gives it the dispatch, tensor
and context parallelism the group of ranks that share the micro-batch's tokens, and every
one of them makes some of the layer's weights DTensors, which it unwraps.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

from tessel.models.moe import MoE, Weights


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; its backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int],  # noqa: ANN001
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class ExpertDispatch:
    """Runs a MoE layer's local experts on the token slots every rank of the group sends.

    Called by `MeshExperts.experts` in place of the experts: (experts module, this rank's
    slots sorted by expert (S, C), per-expert counts (E,), the weights' local values) -> the
    experts' outputs for those slots, in the same order (S, C)."""

    def __init__(self, group: dist.ProcessGroup, ep: int, n_experts: int):
        self.group, self.ep, self.local = group, ep, n_experts // ep

    # The splits must be host integers (all_to_all_single takes lists): a sync per MoE layer,
    # and under torch.compile a graph break around the dispatch (the rest of the block stays
    # compiled).
    @torch.compiler.disable
    def __call__(self, experts: nn.Module, x: torch.Tensor, counts: torch.Tensor,
                 local: Weights) -> torch.Tensor:
        send = counts.view(self.ep, self.local)  # slots for each rank's local experts
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv.view(-1), send.reshape(-1), group=self.group)
        in_splits = send.sum(1).tolist()
        out_splits = recv.sum(1).tolist()
        x_recv = _AllToAll.apply(x, out_splits, in_splits, self.group)
        # Received rows come grouped by source rank, then local expert: group them by expert
        # (stable, so each expert sees its slots in rank order).
        expert_of = torch.arange(self.local, device=x.device).repeat(self.ep)
        expert_of = expert_of.repeat_interleave(recv.reshape(-1))
        order = torch.argsort(expert_of, stable=True)
        y = experts(x_recv[order], recv.sum(0), expert_of[order], x_recv.shape[0], local)
        y_recv = y[torch.argsort(order)]  # back to (source rank, expert) order
        return _AllToAll.apply(y_recv, in_splits, out_splits, self.group)


class MeshExperts:
    """A MoE layer's `ExpertExchange` on the mesh (see the module docstring)."""

    def __init__(self) -> None:
        self.dispatch: ExpertDispatch | None = None
        """Expert parallelism: runs the experts this rank holds on the slots every rank of
        its group sends; None = all experts are here."""
        self.token_group: dist.ProcessGroup | None = None
        """The ranks that each hold a part of the micro-batch's tokens (tensor parallelism's
        sequence, context parallelism's), token_shards of them; None = all here."""
        self.token_shards = 1

    def local(self, w: torch.Tensor) -> torch.Tensor:
        """This rank's part of a DTensor weight, else `w`: the experts it holds under expert
        parallelism (Shard(0)); or, under tensor parallelism, its copy of a replicated
        weight, whose gradient from this rank's tokens is then one part of a sum (Partial)."""
        if not isinstance(w, DTensor):
            return w
        grads = [Partial() if p.is_replicate() else p for p in w.placements]
        return w.to_local(grad_placements=grads)

    def token_counts(self, counts: torch.Tensor) -> torch.Tensor:
        if self.token_group is None:
            return counts
        total = counts.clone()
        dist.all_reduce(total, group=self.token_group)
        return total

    def experts(self, experts: nn.Module, x: torch.Tensor, counts: torch.Tensor,
                expert_of: torch.Tensor, max_rows: int) -> torch.Tensor:
        if self.dispatch is None:
            return experts(x, counts, expert_of, max_rows, self.local)
        return self.dispatch(experts, x, counts, self.local)


def mesh_experts(moe: MoE) -> MeshExperts:
    """The layer's `MeshExperts`, placed on it by the first parallelism that needs it."""
    if not isinstance(moe.exchange, MeshExperts):
        moe.exchange = MeshExperts()
    return moe.exchange


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard every MoE layer's routed experts Shard(0) over `ep_mesh` (on the meta device:
    no communication) and route its tokens through the group."""
    ep = ep_mesh.size()
    for moe in moe_layers(model):
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param, ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(experts, name, nn.Parameter(sharded))
        mesh_experts(moe).dispatch = ExpertDispatch(ep_mesh.get_group(), ep, moe.n_experts)
