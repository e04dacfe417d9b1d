"""Muon (`optim.name = "muon"`): orthogonalised Nesterov momentum for the hidden matrices,
PyTorch's AdamW for every other parameter, in one optimizer.

Per Muon matrix W (A x B) with gradient G, momentum mu, learning rate lr, weight decay wd:

    M <- mu * M + (1 - mu) * G             (momentum, kept as an average)
    U <- (1 - mu) * G + mu * M             (Nesterov)
    O <- NS5(U)                            (5 quintic Newton-Schulz steps)
    W <- W * (1 - lr * wd) - lr * 0.2 * sqrt(max(A, B)) * O

which is `torch.optim.Muon(adjust_lr_fn="match_rms_adamw", nesterov=True)` (the tests check
it against that step for step): the 0.2 * sqrt(max(A, B)) of Moonlight ("Muon is Scalable
for LLM Training") gives the update AdamW's RMS, so AdamW's learning rate and weight decay
carry over. An MoE layer's expert stack (E, A, B) is E matrices, each orthogonalised alone.

Newton-Schulz runs in bfloat16 on GPUs (as the reference implementations) and in float32 on
CPUs (`optim.muon_ns_dtype = "auto"`): bfloat16 matrix products are slow there, and its
rounding turns float noise (a gradient summed in another order) into updates that differ
by a good fraction of themselves, so no two layouts would agree to float32 tolerance.

Distributed: Newton-Schulz needs whole matrices, and under FSDP2/HSDP/TP/EP a parameter is
a DTensor of which each rank holds a shard. Each such matrix is gathered whole on the ranks of
its mesh, orthogonalised by one of them (its owner: matrices are dealt to the mesh's ranks
largest first, each to the least loaded), and the result goes back as a sum over the mesh
in which only the owner contributes (a reduce-scatter to the parameter's own placements,
an all-reduce over replicated dimensions). So the Newton-Schulz work is spread over the
ranks and every rank ends with exactly the owner's result for its shard. Plain tensors
(one process, DDP replicas, pipeline stages' own parameters) are orthogonalised where they
are.

With `optim.state_dtype = "bfloat16"` the momentum buffers and AdamW's moments are stored in
bfloat16 by stochastic rounding (`tessel.optim.lowbit`).

The class extends torch.optim.AdamW so that checkpoints (DCP's optimizer state dict, its
resharding), GradScaler and the planner see one optimizer with one state: AdamW's moments
for its parameters, a `momentum_buffer` for each Muon matrix.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial

from tessel.optim.lowbit import (
    STATE_DTYPES,
    Rounder,
    adamw_step,
    closure_loss,
    keep_state_dtype,
    local,
    shard_index,
)
from tessel.optim.offload import placed_like

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's quintic Newton-Schulz coefficients (steepest slope at zero)."""
NS_EPS = 1e-7


def newton_schulz(g: torch.Tensor, steps: int, dtype: torch.dtype = torch.bfloat16,
                  eps: float = NS_EPS) -> torch.Tensor:
    """The orthogonalised `g` (2-D): U V^T of its SVD, approximately (singular values land
    in about [0.7, 1.2]), computed in `dtype` (bfloat16: as the reference implementations)."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:  # iterate on the wide orientation: the Gram matrix is the smaller one
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b*G + c*G^2
        x = torch.addmm(x, poly, x, beta=a)  # a*X + (b*G + c*G^2) X
    return x.T if tall else x


def orthogonalise(u: torch.Tensor, steps: int, dtype: torch.dtype,
                  owned: Any = None) -> torch.Tensor:
    """`u` orthogonalised matrix by matrix (a 3-D expert stack: each expert alone) in
    `dtype`, returned in u's. `owned(i)`: whether this rank computes matrix i (the others
    stay zero)."""
    out = torch.zeros_like(u)
    mats = [u] if u.ndim == 2 else list(u.unbind(0))
    targets = [out] if u.ndim == 2 else list(out.unbind(0))
    for i, (m, t) in enumerate(zip(mats, targets)):
        if owned is None or owned(i):
            t.copy_(newton_schulz(m, steps, dtype))
    return out


def matrix_cost(shape: torch.Size) -> int:
    """Newton-Schulz multiply-adds of one matrix of `shape` (its last two dimensions),
    per step, up to a constant: the load the owners are balanced by."""
    rows, cols = shape[-2:]
    return rows * cols * min(rows, cols)


def update_scale(shape: torch.Size) -> float:
    """Moonlight's factor on the orthogonalised update: matches AdamW's update RMS."""
    return 0.2 * math.sqrt(max(shape[-2:]))


class Owners:
    """Which rank of a DTensor's mesh orthogonalises each matrix of a group: matrices dealt
    largest first to the least loaded rank (ties: the lowest rank), per mesh, decided once
    from the shapes alone (so every rank of the mesh decides the same)."""

    def __init__(self, params: list[torch.Tensor]):
        self.owner: dict[tuple[int, int], int] = {}
        by_mesh: dict[int, list[tuple[int, int, int]]] = {}
        meshes: dict[int, Any] = {}
        for k, p in enumerate(params):
            if not isinstance(p, DTensor):
                continue
            mesh = p.device_mesh
            meshes[id(mesh)] = mesh
            n = 1 if p.ndim == 2 else p.shape[0]
            by_mesh.setdefault(id(mesh), []).extend(
                (matrix_cost(p.shape), k, i) for i in range(n))
        for key, items in by_mesh.items():
            load = [0] * meshes[key].size()
            for cost, k, i in sorted(items, key=lambda t: (-t[0], t[1], t[2])):
                rank = min(range(len(load)), key=lambda r: (load[r], r))
                load[rank] += cost
                self.owner[(k, i)] = rank

    def owns(self, k: int, p: DTensor) -> Any:
        """`owned(i)` for parameter k of the group on this rank."""
        me = mesh_rank(p.device_mesh)
        return lambda i: self.owner[(k, i)] == me


def mesh_rank(mesh: Any) -> int:
    """This rank's position in `mesh`, its coordinates flattened row-major."""
    rank = 0
    for size, coord in zip(mesh.shape, mesh.get_coordinate()):
        rank = rank * size + coord
    return rank


class Muon(torch.optim.AdamW):
    """Muon for the param groups with `muon: True`, AdamW (PyTorch's, unchanged) for the
    others; see the module docstring."""

    def __init__(self, groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float,
                 momentum: float, ns_steps: int, ns_dtype: str = "bfloat16",
                 state_dtype: str = "float32", **impl: Any):
        super().__init__(groups, lr=lr, betas=betas, eps=eps, **impl)
        self.state_dtype = STATE_DTYPES[state_dtype]
        self.rounder = Rounder()
        keep_state_dtype(self, self.state_dtype)
        for group in self.param_groups:
            group.setdefault("muon", False)
        # Settings, not state: kept out of the param groups, whose values a checkpoint
        # would restore over the config's (lr and weight decay are set as AdamW's are).
        self.momentum, self.ns_steps, self.ns_dtype = momentum, ns_steps, getattr(torch, ns_dtype)
        self._owners: dict[int, Owners] = {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # load_state_dict: AdamW's fix-ups expect Adam's state keys, so they see its groups
        groups = state["param_groups"]
        super().__setstate__({**state, "param_groups": [g for g in groups if not g.get("muon")]})
        self.param_groups = groups

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure_loss(closure)
        groups = self.param_groups
        if self.state_dtype == torch.float32:
            # AdamW's own step over its groups alone (its kernels, its state keys).
            self.param_groups = [g for g in groups if not g["muon"]]
            try:
                super().step()
            finally:
                self.param_groups = groups
        for n, group in enumerate(groups):
            if group["muon"]:
                self._muon_step(n, group)
            elif self.state_dtype != torch.float32:
                adamw_step(self, group, self.rounder, self.state_dtype, n)
        return loss

    def _muon_step(self, n: int, group: dict) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], self.momentum
        steps, dtype = self.ns_steps, self.ns_dtype
        owners = self._owners.get(n)
        if owners is None:  # decided once: the shapes never change
            owners = self._owners[n] = Owners(group["params"])
        for k, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            grad = local(placed_like(p.grad, p))
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, dtype=self.state_dtype)
                if self.state_dtype != torch.float32:  # the rounding's seed counts steps
                    state["step"] = torch.tensor(0.0)
            buf = local(state["momentum_buffer"])
            buf32 = (buf if buf.dtype == torch.float32 else buf.float()).lerp_(grad, 1 - mu)
            update = grad.lerp(buf32, mu)  # Nesterov
            if "step" in state:
                state["step"] += 1
                self.rounder.store(buf, buf32, int(state["step"].item()), (n, k, shard_index(p)))
            if isinstance(p, DTensor):
                update = DTensor.from_local(update, p.device_mesh, p.placements, run_check=False,
                                            shape=p.shape, stride=p.stride())
                whole = orthogonalise(update.full_tensor(), steps, dtype, owners.owns(k, p))
                mesh = p.device_mesh
                ortho = DTensor.from_local(whole, mesh, [Partial()] * mesh.ndim, run_check=False,
                                           shape=p.shape, stride=p.stride())
                ortho = ortho.redistribute(mesh, p.placements)
            else:
                ortho = orthogonalise(update, steps, dtype)
            p.mul_(1 - lr * wd)
            p.add_(ortho, alpha=-lr * update_scale(p.shape))
