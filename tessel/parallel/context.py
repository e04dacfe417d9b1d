"""Context parallelism: each sequence split over the cp ranks of the mesh, the same code on
every device (CPU/gloo and CUDA/NCCL).

Sharding (`ContextParallel.shard`): the sequence is cut into 2·cp chunks and rank r keeps
chunks r and 2·cp−1−r (head–tail), so every rank gets the same amount of causal attention
work (`parallel.cp_load_balance = false`: rank r keeps the r-th contiguous piece). Tokens,
targets and positions are gathered into new tensors (the loader's inputs and targets are
overlapping views of one buffer and are never written); the whole sample's document ids stay
whole, because masks and per-document positions come from the whole sample.

Attention (`tessel.models.attention.Attention.sequence`), two modes:

- ``allgather`` (default; Llama 3's choice): each rank keeps its queries; keys and values,
  after RoPE and before the grouped-query expansion (so GQA models move only their KV heads),
  are all-gathered along the sequence over the cp group with an autograd-aware functional
  collective whose backward reduce-scatters dK/dV. Any mask is easy: the query rows carry
  their global positions.
- ``ulysses`` (DeepSpeed-Ulysses): all-to-all from sequence-sharded to head-sharded before
  the kernel (each rank attends the whole sequence with heads/cp of the heads) and back after
  it; needs the (per tensor-parallel rank) query and KV head counts divisible by cp.

Each rank computes the loss of its own tokens; gradients are summed over the cp ranks by the
data-parallel reduction (FSDP's shard group spans dp_shard × cp; DDP's group is dp × cp), which
averages, so the step's loss is scaled by cp before it (`TrainStep`).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from tessel.models.transformer import Transformer


def chunk_positions(seq_len: int, size: int, rank: int, balanced: bool,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """(seq_len / size,) the global positions rank `rank` of `size` holds, in order: chunks
    rank and 2·size−1−rank of 2·size (`balanced`), else the rank-th of size pieces."""
    if not balanced:
        piece = seq_len // size
        return torch.arange(rank * piece, (rank + 1) * piece, device=device)
    chunks = torch.arange(seq_len, device=device).view(2 * size, -1)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]])


class ContextParallel:
    """One rank's view of the cp group: shards a batch, and is the `SequenceExchange` every
    attention module of the model holds."""

    def __init__(self, cp_mesh: DeviceMesh, mode: str = "allgather", balanced: bool = True):
        self.mesh = cp_mesh
        self.group = cp_mesh.get_group()
        self.size = cp_mesh.size()
        self.rank = cp_mesh.get_local_rank()
        self.mode = mode
        self.balanced = balanced
        self.local_queries = mode == "allgather"

    # ---- the batch ---------------------------------------------------------------------

    def shard(self, inputs: torch.Tensor, targets: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Whole (B, T) inputs and targets -> this rank's (B, T/cp) inputs, targets and
        their global positions (new tensors; the arguments are not touched)."""
        B, T = inputs.shape
        mine = chunk_positions(T, self.size, self.rank, self.balanced, inputs.device)
        positions = mine.expand(B, -1)  # (B, T/cp): batch-shaped, so a pipeline splits it
        return inputs[:, mine], targets[:, mine], positions

    # ---- attention (tessel.models.attention.SequenceExchange) ----------------------------

    def _order(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """(T,) the index into the rank-major concatenation of every rank's positions of each
        position 0..T-1 (a permutation; the identity for contiguous pieces)."""
        gathered = torch.cat([chunk_positions(seq_len, self.size, r, self.balanced, device)
                              for r in range(self.size)])
        return torch.argsort(gathered)

    def exchange(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.mode == "allgather":
            return q, self._gather(k), self._gather(v)
        return self._to_heads(q), self._to_heads(k), self._to_heads(v)

    def restore(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.mode == "allgather" else self._to_sequence(y)

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        """(B, T/cp, H, hd) -> (B, T, H, hd) in position order; backward reduce-scatters.
        Gathered along dim 0 (the sequence moved there), which every torch >= 2.11 supports."""
        full = _all_gather(t.transpose(0, 1).contiguous(), 0, self.group)  # (T, B, H, hd)
        if self.balanced:
            full = full.index_select(0, self._order(full.shape[0], full.device))
        return full.transpose(0, 1)

    def _to_heads(self, t: torch.Tensor) -> torch.Tensor:
        """(B, T/cp, H, hd) sequence-sharded -> (B, T, H/cp, hd) head-sharded, position
        order: head group j goes to rank j, which receives every rank's tokens for it."""
        B, Tl, H, hd = t.shape
        cp = self.size
        send = t.reshape(B, Tl, cp, H // cp, hd).permute(2, 0, 1, 3, 4).contiguous()
        got = funcol.all_to_all_single_autograd(send, None, None, self.group)  # (cp, B, Tl, H/cp, hd)
        full = got.permute(1, 0, 2, 3, 4).reshape(B, cp * Tl, H // cp, hd)  # rank-major
        if not self.balanced:
            return full
        return full.index_select(1, self._order(cp * Tl, full.device))

    def _to_sequence(self, y: torch.Tensor) -> torch.Tensor:
        """(B, T, H/cp, hd) head-sharded, position order -> (B, T/cp, H, hd) of this rank's
        tokens (the inverse of `_to_heads`)."""
        B, T, Hc, hd = y.shape
        cp = self.size
        if self.balanced:
            # rank-major again: position order indexed by the gathered positions
            gathered = torch.cat([chunk_positions(T, cp, r, True, y.device) for r in range(cp)])
            y = y.index_select(1, gathered)
        send = y.reshape(B, cp, T // cp, Hc, hd).permute(1, 0, 2, 3, 4).contiguous()
        got = funcol.all_to_all_single_autograd(send, None, None, self.group)  # (cp, B, Tl, Hc, hd)
        return got.permute(1, 2, 0, 3, 4).reshape(B, T // cp, cp * Hc, hd)


# torch 2.13 deprecates all_gather_tensor_autograd for all_gather_single_autograd, which
# torch 2.11 (the GPU image) may lack: the same autograd-aware all-gather either way.
_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


def apply_context_parallel(model: Transformer, cp_mesh: DeviceMesh, mode: str,
                           balanced: bool) -> ContextParallel:
    """Place `model` (a whole model or a pipeline stage) on the cp mesh: every attention
    module exchanges its sequence through one `ContextParallel`, which is returned (the step
    shards its batches with it)."""
    cp = ContextParallel(cp_mesh, mode, balanced)
    model.context_parallel = cp
    for block in model.layers.values():
        block.attention.sequence = cp
    return cp
