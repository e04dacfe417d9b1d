"""What CPU processes add to the GPU time model (`tessel.planner.speed`): the terms `tessel
scale --measure` measures on this machine and a profile of CPU processes carries, in one
place behind one interface (`CpuTerms`, from `cpu_terms(profile)`).

The GPU model prices a step from FLOPs, ring bytes, link bandwidths and its overlap rules,
and asks a `CpuTerms` at a few fixed points what to add or price instead. A built-in GPU
profile carries none of these terms and gets `NO_TERMS`, which adds nothing and prices
nothing instead: the GPU prediction is the GPU model's alone. The terms, each measured
between local gloo processes (`tessel/scaling/gloo.py`, `tessel/scaling/tp_cost.py`):

- gloo's threads share the computing thread's core, so on a profile with device_type "cpu"
  data-parallel collectives hide behind nothing (CPU_OVERLAP), and gloo has no
  reduce-scatter of its own (GLOO_SCATTER);
- a call's time against its ring bytes (an all-reduce of S bytes on n ranks: 2 (n - 1) / n x
  S) is no line between CPU processes (gloo on the project's 2-core machine: 0.6-1.5 ms at
  1-4 KB, 1.6-2.5 ms at 64 KB-2 MB, 12 ms at 16 MB): where a profile has a measured curve
  (collective_curve), tensor-parallel calls and DDP's buckets are priced on it, piecewise
  linear, its last slope beyond it, its first point below it (`on_curve`), instead of
  collective_latency_s + bytes / bandwidth;
- ranks that compute the same work drift apart, and a synchronising collective (tensor-,
  context-, expert- or data-parallel) waits for the slowest: independent noise in each
  rank's operators adds up like a random walk, sync_drift x sqrt(L) after L seconds of
  compute, or, after longer compute such as DDP's one all-reduce after a step's whole
  forward and backward, in proportion to it, sync_skew x L, as if one rank's core ran
  steadily slower; the larger counts (`CpuTerms.wait`). Measured over segments of 8, 32 and
  128 ms: sync_drift 0.004-0.052 on the project's 2-core virtual machine (a collective waited
  0.3-1.4 ms after 7-12 ms of compute and 2-10 ms after 110-190 ms), sync_skew 0.017-0.069;
  GPU kernels' times vary far less;
- DTensor's host work per tensor-parallel block (tp_block_overhead_s per micro-batch,
  tp_block_optimizer_s per optimizer step: sharding propagation, redistribution with its
  copies, wrapping, the sharded matmuls' lower rate), measured on the config's blocks over a
  fake process group, whose collectives move nothing; on a GPU the host issues kernels ahead
  of the device and the time hides behind them (torch.compile removes most of it).

How far they can be trusted: docs/scaling.md ("How far CPU predictions can be trusted"). They
describe one machine at one time (the drift moved 0.004-0.052 within one hour on the
project's 2-core machine); they are measured again by every sweep, not carried to GPUs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tessel.planner.calls import TpTraffic, ring_bytes, ring_seconds
from tessel.planner.hardware import GpuProfile
from tessel.planner.layout import Layout

# On CPU processes (a profile with device_type "cpu") data-parallel collectives hide behind
# nothing: gloo moves the bytes on threads of the same process, which share its core with
# the computing thread, so a collective "in flight behind the backward" takes its time from
# the backward. Measured on 2 processes of this project's 2-core machine (demo model, 8.9 MB
# of gradients): DDP's backward with its all-reduce took 12-31 ms longer than without
# (no_sync), the all-reduce alone 8-17 ms.
CPU_OVERLAP = 0.0
# gloo (CPU processes) has no reduce-scatter of its own: torch 2.11-2.13 runs one as a whole
# all-reduce and keeps the rank's slice (a profiled sequence-parallel step shows one
# `gloo:all_reduce` per reduce-scatter call), twice a reduce-scatter's bytes. Sequence
# parallelism's all-gather + reduce-scatter pairs then move 1.5 all-reduces' bytes, not one.
GLOO_SCATTER = 2.0  # a reduce-scatter's bytes on gloo, in reduce-scatters

ASSUMPTIONS = (
    "CPU processes (a profile with device_type \"cpu\"): data-parallel collectives hide behind "
    "nothing (gloo's threads share the computing thread's core), and a reduce-scatter moves "
    "an all-reduce's bytes (gloo has none of its own); a profile measured on CPU processes "
    "prices tensor-parallel calls and DDP buckets instead at their sizes on its measured curve "
    "of a call's time (collective_curve; an all-gather at half an all-reduce of twice its "
    "bytes)",
    "ranks' drift (the profile's sync_drift and sync_skew, measured on CPU processes, 0 for "
    "GPUs): every tensor-, context- or expert-parallel collective, FSDP gather and "
    "reduce-scatter, and DDP's first bucket of the step waits for the slowest rank the larger "
    "of sync_drift x sqrt(L) and sync_skew x L, L the compute seconds since the previous "
    "collective; a micro-batch's compute is spread evenly between its collectives",
    "tensor parallelism's cost beyond a tp-th of a block's compute (DTensor's host work, "
    "its copies, the sharded matmuls' rate) per block and micro-batch: the profile's "
    "tp_block_overhead_s, added to compute, and per block and optimizer step "
    "tp_block_optimizer_s (measured on CPU processes; 0 for GPUs, where the host runs ahead "
    "of the kernels)",
)


@dataclass(frozen=True)
class Waits:
    """Seconds a collective waits for the slowest rank: each synchronising call of the
    model-parallel and FSDP collectives, and DDP's first bucket of the step."""

    per_call: float = 0.0
    first_bucket: float = 0.0


NO_WAITS = Waits()


@dataclass(frozen=True)
class CpuTerms:
    """The interface the GPU time model asks; the defaults (`NO_TERMS`) add nothing."""

    overlap: float | None = None
    """The share of compute data-parallel collectives hide behind, where the caller gives
    none (None: the GPU model's own, DDP_OVERLAP / FSDP_OVERLAP)."""
    scatter: float = 1.0
    """A reduce-scatter's bytes, in reduce-scatters (GLOO_SCATTER on CPU processes)."""
    curve: tuple[tuple[float, float], ...] = ()
    """GpuProfile.collective_curve: a call's seconds against its ring bytes per rank."""
    drift: float = 0.0
    """GpuProfile.sync_drift."""
    skew: float = 0.0
    """GpuProfile.sync_skew."""
    block_s: float = 0.0
    """GpuProfile.tp_block_overhead_s."""
    block_optimizer_s: float = 0.0
    """GpuProfile.tp_block_optimizer_s."""

    def dp_overlap(self, given: float | None) -> float | None:
        """The overlap the data-parallel collectives get: the caller's, else this one's."""
        return self.overlap if given is None else given

    def block_seconds(self, layout: Layout, layers: int) -> float:
        """Host seconds `layers` tensor-parallel blocks add to one micro-batch's compute."""
        return layers * self.block_s if layout.tp > 1 else 0.0

    def optimizer_seconds(self, layout: Layout, layers: int) -> float:
        """Host seconds `layers` tensor-parallel blocks add to an optimizer step."""
        return layers * self.block_optimizer_s if layout.tp > 1 else 0.0

    def wait(self, compute_s: float) -> float:
        """Seconds a synchronising collective waits for the slowest rank after `compute_s` of
        compute since the previous one: the ranks' random drift (sync_drift x sqrt(L)) or,
        after longer compute, their steady difference in speed (sync_skew x L), whichever is
        larger."""
        return max(self.drift * math.sqrt(compute_s), self.skew * compute_s)

    def waits(self, t_mb: float, compute_s: float, syncs: float, fsdp_syncs: float) -> Waits:
        """The waits of a step whose micro-batch (`t_mb` seconds) makes `syncs` synchronising
        model-parallel calls and `fsdp_syncs` FSDP gathers and reduce-scatters, its compute
        spread evenly between them; DDP's first bucket waits after the step's whole compute
        (`compute_s`) when nothing synchronised the ranks before (accumulation runs without),
        else after the last micro-batch's last piece."""
        every = syncs + fsdp_syncs
        per_call = self.wait(t_mb / every) if every else 0.0
        return Waits(per_call, self.wait(compute_s) if not syncs else per_call)

    def tp_seconds(self, traffic: TpTraffic, gpu_s: float) -> float:
        """Seconds of one micro-batch's tensor-parallel calls: the GPU model's `gpu_s` (each
        call's latency, the collectives' ring bytes at the link's bandwidth), or on CPU
        processes gloo's: a reduce-scatter at GLOO_SCATTER times its bytes and, with a
        measured curve, each call at its own size on it (its latency included): the
        activation's all-reduces, or all-gathers and reduce-scatters, the first stage's
        embedding and the last stage's output projection two calls of them alike; the other
        calls (norms' weight gradients, the loss's statistics) move next to nothing."""
        layout, act = traffic.layout, traffic.act
        tp, sp = layout.tp, layout.sequence_parallel
        if tp <= 1 or not (self.curve or (sp and self.scatter != 1.0)):
            return gpu_s
        if not self.curve:  # an all-gather (half) and a reduce-scatter (half, or more)
            per_collective = ring_seconds(act, tp, traffic.bandwidth, all_reduce=True)
            per_collective *= (1 + self.scatter) / 2
            return traffic.collectives * per_collective + traffic.calls * traffic.latency_s
        if sp:
            # An all-gather is an all-reduce's second half: half the time of an all-reduce
            # whose ring sends twice its bytes (gloo on the project's machine: all-gathers of
            # 4-64 KB took 0.4-0.6 ms, all-reduces of them 0.9-2.2 ms).
            big = 2 * traffic.collectives
            gather = on_curve(self.curve, 2 * ring_bytes(act, tp, False)) / 2
            each = (gather + on_curve(self.curve, self.scatter * ring_bytes(act, tp, False))) / 2
        else:
            big, each = traffic.collectives, on_curve(self.curve, ring_bytes(act, tp, True))
        big += 2 * traffic.first + 2 * traffic.last
        return big * each + max(0, traffic.calls - big) * self.curve[0][1]

    def ddp_seconds(self, gpu_s: float, grad_bytes: float, buckets: int, ranks: int) -> float:
        """Seconds of DDP's all-reduce of `grad_bytes` in `buckets` over `ranks`: the GPU
        model's `gpu_s`, or each bucket at its size on a measured curve."""
        if not self.curve:
            return gpu_s
        return buckets * on_curve(self.curve, ring_bytes(grad_bytes / buckets, ranks, True))


NO_TERMS = CpuTerms()


def cpu_terms(hw: GpuProfile) -> CpuTerms:
    """The terms `hw` carries: NO_TERMS for a GPU profile without measured ones (every
    built-in one); a CPU profile's gloo rules (CPU_OVERLAP, GLOO_SCATTER) and whatever was
    measured into it (a GPU profile a user gave such keys gets those alone)."""
    cpu = hw.device_type == "cpu"
    terms = CpuTerms(overlap=CPU_OVERLAP if cpu else None, scatter=GLOO_SCATTER if cpu else 1.0,
                     curve=hw.collective_curve, drift=hw.sync_drift, skew=hw.sync_skew,
                     block_s=hw.tp_block_overhead_s,
                     block_optimizer_s=hw.tp_block_optimizer_s)
    return NO_TERMS if terms == NO_TERMS else terms


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


def sync_wait(hw: GpuProfile, compute_s: float) -> float:
    """Seconds a synchronising collective waits for the slowest rank after `compute_s` of
    compute on profile `hw` (`CpuTerms.wait`)."""
    return cpu_terms(hw).wait(compute_s)


def stretched(hw: GpuProfile, factor: float) -> GpuProfile:
    """`hw` with the terms of it that are communication `factor` times slower (calibration
    on a measured sweep, `tessel.planner.sweep_fit`): the ranks' drift and skew (a
    collective's wait) and each call's time on the measured curve."""
    return dataclasses.replace(hw, sync_drift=hw.sync_drift * factor,
                               sync_skew=hw.sync_skew * factor,
                               collective_curve=tuple((b, t * factor)
                                                      for b, t in hw.collective_curve))
