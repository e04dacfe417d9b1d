"""What a collective call costs the planner: the bytes each rank sends in a ring, a measured
curve of a call's time against them (CPU processes), and tensor parallelism's calls per
micro-batch (`tessel.planner.speed` puts them in the step; the gloo probe,
`tessel.scaling.gloo`, measures the curve in the same ring bytes)."""

from __future__ import annotations

from tessel.planner.hardware import GpuProfile
from tessel.planner.layout import Layout

# gloo (CPU processes) has no reduce-scatter of its own: torch 2.11-2.13 runs one as a whole
# all-reduce and keeps the rank's slice (a profiled sequence-parallel step shows one
# `gloo:all_reduce` per reduce-scatter call), twice a reduce-scatter's bytes. Sequence
# parallelism's all-gather + reduce-scatter pairs then move 1.5 all-reduces' bytes, not one.
GLOO_SCATTER = 2.0  # a reduce-scatter's bytes on gloo, in reduce-scatters


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


def on_curve(curve: tuple[tuple[float, float], ...], sent: float) -> float:
    """Seconds of a call whose ranks each send `sent` bytes, on a measured curve of
    (bytes, seconds) points (GpuProfile.collective_curve): piecewise linear between them,
    the last segment's slope beyond them, the first point's time below it (a call costs at
    least that)."""
    if sent <= curve[0][0]:
        return curve[0][1]
    for (b0, t0), (b1, t1) in zip(curve, curve[1:]):
        if sent <= b1 or (b1, t1) == curve[-1]:
            return max(curve[0][1], t0 + (t1 - t0) * (sent - b0) / (b1 - b0))
    return curve[0][1]  # unreachable: a curve has at least two points


def tp_calls_seconds(hw: GpuProfile, layout: Layout, act: float, collectives: int, calls: int,
                     first: bool, last: bool, bandwidth: float) -> float:
    """Seconds of one micro-batch's `calls` tensor-parallel collective calls (forward and
    backward; `tp_calls`), `collectives` of which move the activation (`act` bytes) in an
    all-reduce or, with sequence parallelism, in an all-gather + reduce-scatter pair.

    Without a measured curve: each call's latency plus the collectives' bytes at
    `bandwidth`. With one (CPU processes): each call at its own size on the curve (its
    latency included): the activation's all-reduces, or all-gathers and reduce-scatters,
    the first stage's embedding and the last stage's output projection two calls of them
    alike; the other calls (norms' weight gradients, the loss's statistics) move next to
    nothing."""
    tp = layout.tp
    if tp <= 1:
        return 0.0
    scatter = GLOO_SCATTER if hw.device_type == "cpu" else 1.0
    curve = hw.collective_curve
    if not curve:
        per_collective = ring_seconds(act, tp, bandwidth, all_reduce=True)
        if layout.sequence_parallel:  # an all-gather (half) and a reduce-scatter (half, or more)
            per_collective *= (1 + scatter) / 2
        return collectives * per_collective + calls * hw.collective_latency_s
    if layout.sequence_parallel:
        # An all-gather is an all-reduce's second half: half the time of an all-reduce whose
        # ring sends twice its bytes (gloo on the project's machine: all-gathers of 4-64 KB
        # took 0.4-0.6 ms, all-reduces of them 0.9-2.2 ms).
        big = 2 * collectives
        gather = on_curve(curve, 2 * ring_bytes(act, tp, False)) / 2
        each = (gather + on_curve(curve, scatter * ring_bytes(act, tp, False))) / 2
    else:
        big, each = collectives, on_curve(curve, ring_bytes(act, tp, True))
    big += 2 * first + 2 * last
    return big * each + max(0, calls - big) * curve[0][1]
