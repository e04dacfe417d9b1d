"""A stand-in for context parallelism's sequence exchange, for the activation probe."""

from __future__ import annotations

import torch


class ShapeExchange:
    """A `tessel.models.attention.SequenceExchange` without a process group, for the probe:
    tensors of the shapes tessel.parallel.context's exchange returns, made by copying this
    rank's part (torch.cat, which saves nothing for backward, as the real collectives)."""

    def __init__(self, mode: str, size: int):
        self.size = size
        self.local_queries = mode == "allgather"
        self.returned: list[torch.Tensor] = []
        """What the real exchange's collectives would have returned (the per-op checkpointing
        policy keeps those)."""

    def exchange(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.local_queries:  # (B, T/cp, H, hd) -> (B, T, H, hd), sequence-major like the gather's
            k, v = (torch.cat([t.transpose(0, 1)] * self.size).transpose(0, 1) for t in (k, v))
            self.returned += [k, v]
            return q, k, v
        # (B, T/cp, H, hd) -> (B, T, H/cp, hd)
        out = tuple(torch.cat([t[:, :, : t.shape[2] // self.size]] * self.size, dim=1)
                    for t in (q, k, v))
        self.returned += out
        return out  # type: ignore[return-value]

    def restore(self, y: torch.Tensor) -> torch.Tensor:
        if self.local_queries:
            return y
        out = torch.cat([y[:, : y.shape[1] // self.size]] * self.size, dim=2)  # (B, T/cp, H, hd)
        self.returned.append(out)
        return out
