"""What a collective call costs the planner: the bytes each rank sends in a ring, and tensor
parallelism's calls per micro-batch (`tessel.planner.speed` puts them in the step; on CPU
processes `tessel.planner.cpu` prices them on gloo's measured curve instead, which the gloo
probe, `tessel.scaling.gloo`, measures in the same ring bytes)."""

from __future__ import annotations

from dataclasses import dataclass

from tessel.planner.layout import Layout


def tp_calls(layout: Layout, layers: int, moe_layers: int, first: bool, last: bool) -> int:
    """Tensor-parallel collective calls of one micro-batch's forward and backward on a
    pipeline rank (each costs `collective_latency_s` beside its bytes; counted from
    tessel.parallel.tensor's plan). Per dense block: two all-reduces each way (with sequence
    parallelism two all-gather + reduce-scatter pairs each way, and the two norms' partial
    weight gradients summed); MoE blocks only attention's half. The first stage's
    vocabulary-parallel embedding adds one call each way; the last stage's output projection
    one each way, and the vocabulary-parallel loss three (maximum, sum of exponentials,
    target logit), with sequence parallelism the final norm's gradient too."""
    if layout.tp <= 1:
        return 0
    sp = layout.sequence_parallel
    per_dense, per_moe = (10, 5) if sp else (4, 2)
    calls = per_dense * (layers - moe_layers) + per_moe * moe_layers
    if first:
        calls += 2
    if last:
        calls += 2 + 3 + (1 if sp else 0)
    return calls


def ring_seconds(nbytes: float, n: int, bandwidth: float, all_reduce: bool) -> float:
    """Seconds of the ring's bytes at `bandwidth` (bytes/s), no latency."""
    return ring_bytes(nbytes, n, all_reduce) / bandwidth


def ring_bytes(nbytes: float, n: int, all_reduce: bool) -> float:
    """Bytes each of `n` ranks sends in a ring all-reduce (or all-gather / reduce-scatter)
    of `nbytes`."""
    return (2 if all_reduce else 1) * (n - 1) / n * nbytes if n > 1 else 0.0


@dataclass(frozen=True)
class TpTraffic:
    """One micro-batch's tensor-parallel calls on a pipeline rank (forward and backward):
    `calls` calls (`tp_calls`), `collectives` of which move the activation (`act` bytes) in
    an all-reduce or, with sequence parallelism, in an all-gather + reduce-scatter pair (the
    same bytes); the first stage's embedding and the last stage's output projection two of
    them each."""

    layout: Layout
    act: float
    collectives: int
    calls: int
    first: bool
    last: bool
    bandwidth: float
    """Bytes/s of the link the tensor-parallel group's ring runs over."""
    latency_s: float
    """Seconds every call costs beyond its bytes' time."""

    def seconds(self) -> float:
        """Each call's latency plus the collectives' ring bytes at the link's bandwidth."""
        if self.layout.tp <= 1:
            return 0.0
        per_collective = ring_seconds(self.act, self.layout.tp, self.bandwidth, all_reduce=True)
        return self.collectives * per_collective + self.calls * self.latency_s
