"""Global gradient-norm clipping over any layout.

Parameters may be plain tensors, or DTensors on different meshes (FSDP shards, TP shards,
both); pipeline stages hold disjoint parameters on different ranks. The norm is computed per
group of same-mesh, same-placement gradients (so replicated copies are counted once), then
summed over pipeline ranks.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


@torch.no_grad()
def clip_grad_norm(
    params: list[torch.nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup | None = None,
    also_clip: list[torch.nn.Parameter] = (),
) -> torch.Tensor:
    """Clip in place to `max_norm` (math.inf: only measure); returns the total norm as a
    plain tensor, identical on every rank. No host synchronisation. `also_clip`: gradients
    scaled by the same factor but not measured (copies of measured ones)."""
    for p in params:
        # A replicated weight that ranks used on different tokens (MoE layers under tensor
        # parallelism) has a partial gradient where no FSDP summed it: sum it first.
        if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements):
            p.grad = p.grad.redistribute(
                placements=[Replicate() if pl.is_partial() else pl for pl in p.grad.placements])
    grads = [p.grad for p in params if p.grad is not None]
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else (None, None)
        groups.setdefault(key, []).append(g)
    device = grads[0].device if grads else torch.device("cpu")
    if grads and isinstance(grads[0], DTensor):
        device = grads[0].to_local().device
    total_sq = torch.zeros((), device=device, dtype=torch.float32)
    for gs in groups.values():
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(gs, 2.0)), 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # partial norms of the shards -> the group's norm
        total_sq += norm.float().to(device) ** 2
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    if max_norm != math.inf:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        extra = [p.grad for p in also_clip if p.grad is not None]
        plain = [g.to_local() if isinstance(g, DTensor) else g for g in grads + extra]
        torch._foreach_mul_(plain, coef)
    return total
