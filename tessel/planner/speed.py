"""Step time of one layout: compute from each matmul's FLOPs at an efficiency that depends on
its size, communication from message sizes, ring algorithms and link bandwidths with the
overlap tessel's implementation achieves, and each pipeline schedule's bubble.

Overlap, as implemented: DDP's bucketed all-reduce runs during the backward pass and FSDP2
prefetches its all-gathers and issues its reduce-scatters while blocks compute, so only what
exceeds the compute they hide behind is exposed; tensor-parallel collectives (DTensor),
context parallelism's exchange (each layer waits for its keys and values before the kernel
runs) and pipeline sends are not overlapped.

This is a GPU's model. What CPU processes add to it (gloo's calls, the ranks' drift, DTensor's
host work) is `tessel.planner.cpu`'s, asked through one object (`CpuTerms`) at the points
below where it adds or prices something; a GPU profile's adds nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tessel.config import ModelConfig
from tessel.planner.async_tp import hidden_seconds
from tessel.planner.calls import TpTraffic, tp_calls
from tessel.planner.calls import ring_seconds as _ring
from tessel.planner.compute import (
    GROUPED_GEMM_EFFICIENCY,
    MATMUL_HALF_SIZE,
    micro_batch_compute,
    recompute_seconds,
)
from tessel.planner.cpu import CpuTerms, Waits, cpu_terms
from tessel.planner.fp8 import Fp8Terms, gathered_bytes, tp_activation_bytes
from tessel.planner.hardware import GpuProfile
from tessel.planner.layout import Layout
from tessel.planner.memory import (
    StageParams,
    fsdp_active,
    moe_layer_count,
    rank_parameters,
    rank_stages,
    stage_layers,
)
from tessel.planner.optimizer import ADAMW, OptimizerSpec, muon_step

DDP_OVERLAP = 0.8  # fraction of the backward pass DDP's all-reduce hides behind
FSDP_OVERLAP = 0.85  # fraction of compute FSDP2's prefetched collectives hide behind
HOST_LINK_BYTES_PER_S = 25e9  # device <-> host, PCIe 5 x16 achievable per GPU
HOST_ADAM_PARAMS_PER_S = 1.5e9  # AdamW on the host, parameters per second per rank
ZERO_BUBBLE_FACTOR = 0.5  # credited half the interleaved bubble (not measured)
# The search splits a sequence over cp ranks only while each keeps at least this many
# positions (cp from 8K sequences on, as NeMo advises): the model counts the exchange's bytes
# and calls but not the masked kernel's lower efficiency on short pieces, which would credit
# splitting short sequences with more than they give.
MIN_CP_POSITIONS = 4096
DDP_BUCKET_MB = 25  # tessel.parallel.fsdp's DDP gradient buckets (a test checks): one call each
# Collective calls of one layer's context-parallel exchange, one way: the keys' and values'
# all-gathers; Ulysses' all-to-alls of queries, keys, values and the attention output.
CP_CALLS = {"allgather": 2, "ulysses": 4}
# Expert parallelism's dispatch (or combine): the per-expert counts, then the tokens.
EP_CALLS_EACH_WAY = 2

ASSUMPTIONS = (
    f"compute: each matmul's FLOPs (causal attention at half its full-matrix FLOPs) at peak x "
    f"matmul_efficiency x k/(k+{MATMUL_HALF_SIZE}), k its smallest per-GPU dimension; full "
    "checkpointing adds a forward pass, matmuls 3%, selective (per-op) the forward of the "
    "matmuls it recomputes (wk, wo, w3), each on the blocks it applies to; a loss in pieces "
    "the output projection's forward again; AdamW at device memory bandwidth",
    "collectives: ring algorithm, 2(n-1)/n x bytes (all-reduce) or (n-1)/n (all-gather, "
    "reduce-scatter) at comm_efficiency x the per-GPU intra-node bandwidth when the group "
    f"fits in a node, else the inter-node bandwidth; DDP hides behind {DDP_OVERLAP:.0%} of "
    f"backward, FSDP behind {FSDP_OVERLAP:.0%} of compute (ZeRO-1, which gathers and "
    "reduce-scatters once per step, of one micro-batch's); tensor-parallel collectives and "
    "pipeline sends are exposed; every call also costs the profile's collective latency "
    f"(calls: a DDP bucket of {DDP_BUCKET_MB} MiB, an FSDP unit's gather or reduce-scatter, "
    "a tensor-parallel block's 4 (10 with sequence parallelism), a pipeline send, a "
    "context-parallel layer's 2 (Ulysses 4), an expert dispatch's 2)",
    "context parallelism: each rank computes its 1/cp of every sequence's causal attention "
    "(head-tail chunks balance it; contiguous pieces cost the last rank (2cp-1)/cp of the "
    "mean). allgather: per layer the whole sequence's keys and values, 2 x micro_batch x "
    "seq_len x n_kv_heads/tp x head_dim x (cp-1)/cp bytes, all-gathered in the forward and "
    "their gradients reduce-scattered in the backward (ring); ulysses: per layer an all-to-all "
    "of the rank's queries, keys, values and attention output, (2 x q_dim + 2 x kv_dim)/tp x "
    "its tokens x (cp-1)/cp bytes, each way; again when checkpointing recomputes the layer "
    "(full or selective: the exchange is not a saved operator); over NVLink when the cp x tp "
    "ranks fit in a node, else over the NIC; exposed (the kernel waits for the exchange); "
    "the masked kernel's lower efficiency on short pieces is not modelled, so the search "
    f"splits a sequence only where each rank keeps {MIN_CP_POSITIONS:,} positions or more",
    f"MoE layers: routed experts' FLOPs for each token's top_k experts (active parameters) at "
    f"{GROUPED_GEMM_EFFICIENCY} x a dense matmul's rate (grouped GEMM), each expert's rows "
    "tokens x top_k x ep / experts (balanced routing); the fp32 router at half the BF16 rate; "
    "expert parallelism's all-to-all (dispatch + combine, forward and backward, and again "
    "under full recomputation: tokens x top_k x d_model x (ep-1)/ep bytes each) over NVLink "
    "when the ep group fits in a node, else the part to other nodes over the NIC; not "
    "overlapped with compute (tessel's dispatch is synchronous); expert gradients reduced "
    "over their own group (dp_shard x tp / ep ranks, spread across the dp_shard x tp ranks)",
    "pipeline bubble: (pp-1) x the busiest stage's micro-batch time, divided by v for "
    "interleaved 1F1B and by 2v for zero-bubble (PyTorch's interleaved zero-bubble splits each "
    "backward into input- and weight-gradient passes to fill it; credited half, not measured)",
)


@dataclass
class StepTime:
    compute_s: float
    tp_comm_s: float
    dp_comm_s: float
    pp_comm_s: float
    cp_comm_s: float
    bubble_s: float
    optimizer_s: float
    offload_s: float
    raw_comm_s: float = 0.0
    """All communication before overlap: how much the prediction leans on hiding it."""
    ep_comm_s: float = 0.0
    """Expert parallelism's all-to-all (token dispatch and combine), not overlapped."""

    @property
    def total(self) -> float:
        return (self.compute_s + self.tp_comm_s + self.dp_comm_s + self.pp_comm_s
                + self.cp_comm_s + self.ep_comm_s + self.bubble_s + self.optimizer_s
                + self.offload_s)


def all_to_all(nbytes: float, n: int, hw: GpuProfile, stride: int = 1) -> float:
    """Seconds for each of `n` ranks, `stride` apart, to send `nbytes` spread evenly over the
    group (1/n of it stays local): over NVLink when the group fits in a node, else the part
    to ranks of the same node over NVLink and the rest over the NIC, at the same time."""
    if n <= 1:
        return 0.0
    intra = hw.intra_node_gbps * 1e9 * hw.comm_efficiency
    inter = hw.inter_node_gbps * 1e9 * hw.comm_efficiency
    per_node = max(hw.gpus_per_node // stride, 1)
    if n <= per_node:
        return nbytes * (n - 1) / n / intra
    same = per_node - 1
    return max(nbytes * same / n / intra, nbytes * (n - 1 - same) / n / inter)


def cp_exchange(m: ModelConfig, layout: Layout, hw: GpuProfile, seq_len: int,
                act_bytes: int) -> float:
    """Seconds of one layer's context-parallel exchange for one micro-batch, one way (the
    forward's, or its backward's, which moves as much): the all-gather of the whole
    sequence's keys and values (ring over the cp ranks, tp apart), or Ulysses' all-to-alls
    of queries, keys, values and the attention output."""
    cp, tp = layout.cp, layout.tp
    kv = m.n_kv_heads * m.head_dim / tp
    if cp == 1:
        return 0.0
    if layout.cp_mode == "ulysses":
        tokens = layout.micro_batch * seq_len / cp
        return all_to_all(tokens * (2 * m.q_dim / tp + 2 * kv) * act_bytes, cp, hw, stride=tp)
    fits = cp * tp <= hw.gpus_per_node
    bandwidth = (hw.intra_node_gbps if fits else hw.inter_node_gbps) * 1e9 * hw.comm_efficiency
    return _ring(2 * layout.micro_batch * seq_len * kv * act_bytes, cp, bandwidth, all_reduce=False)


def fsdp_calls(zero: int, micro_batches: int) -> tuple[int, int]:
    """(all-gathers, reduce-scatters) of each FSDP unit in a step: ZeRO-1 gathers the
    parameters and reduce-scatters the gradients once, ZeRO-2 gathers and reduce-scatters
    in every micro-batch, ZeRO-3 gathers again for the backward."""
    return {1: 1, 2: micro_batches, 3: 2 * micro_batches}[zero], 1 if zero == 1 else micro_batches


@dataclass(frozen=True)
class _Step:
    """What every part of a step's time is priced from: the busiest pipeline rank's
    micro-batch compute and what it holds."""

    m: ModelConfig
    layout: Layout
    hw: GpuProfile
    seq_len: int
    micro_batches: int
    t_mb: float
    """Seconds of one micro-batch's compute, recomputation included."""
    recompute: float
    """The share of t_mb the collectives are made again for (0 under the per-op policy)."""
    stage: StageParams
    ids: list[int]
    n_stages: int
    act_bytes: int
    cpu: CpuTerms
    """What CPU processes add (`tessel.planner.cpu`; nothing for a GPU profile)."""
    fp8: Fp8Terms | None = None
    """train.fp8's terms (None without)."""

    @property
    def compute(self) -> float:
        return self.micro_batches * self.t_mb

    @property
    def tokens(self) -> float:
        return self.layout.micro_batch * self.seq_len / self.layout.cp

    @property
    def intra(self) -> float:
        return self.hw.intra_node_gbps * 1e9 * self.hw.comm_efficiency

    @property
    def inter(self) -> float:
        return self.hw.inter_node_gbps * 1e9 * self.hw.comm_efficiency

    def within(self, ranks: int) -> float:
        """The link of a group of `ranks` consecutive ranks: NVLink if it fits in a node."""
        return self.intra if ranks <= self.hw.gpus_per_node else self.inter


def estimate_step(
    m: ModelConfig, layout: Layout, hw: GpuProfile, seq_len: int, global_batch: int,
    precision: str, dp_overlap: float | None = None, optimizer: OptimizerSpec = ADAMW,
    fp8: Fp8Terms | None = None, async_tp: bool = False,
) -> StepTime:
    """`dp_overlap` replaces the fraction of compute data-parallel communication hides
    behind (DDP_OVERLAP / FSDP_OVERLAP): 0 models an implementation that reduces gradients
    after the backward pass (used to replay published runs of such systems). `optimizer`:
    its update's memory traffic and, for Muon, its Newton-Schulz work and whole-matrix
    collectives (planner/optimizer.py), all in `optimizer_s`. `fp8`: train.fp8's terms
    (planner/fp8.py); `async_tp`: parallel.async_tp, whose hidden transfers
    (planner/async_tp.py) come off the tensor-parallel time."""
    s = _busiest(m, layout, hw, seq_len, global_batch // (layout.micro_batch * layout.dp),
                 precision, fp8, cpu_terms(hw))
    tp_comm, tp_syncs = _tensor_parallel(s)
    if async_tp:
        tp_comm -= s.micro_batches * (1 + s.recompute) * hidden_seconds(
            m, layout, hw, s.tokens, tp_activation_bytes(fp8, s.act_bytes, layout),
            s.stage.layers, s.stage.moe_layers, s.within(layout.tp), fp8, hw.bf16_flops)
    cp_comm, cp_syncs = _context_parallel(s)
    ep_comm, ep_syncs = _expert_parallel(s)
    # What each synchronising collective waits for the slowest rank (CPU processes' drift;
    # nothing on a GPU profile): the calls above, FSDP's gathers and reduce-scatters.
    syncs = tp_syncs + cp_syncs + ep_syncs
    fsdp_syncs = 0
    if fsdp_active(layout) and layout.dp * layout.cp > 1:
        fsdp_syncs = (s.stage.layers + 1) * sum(
            fsdp_calls(layout.zero, s.micro_batches)) / s.micro_batches
    waits = s.cpu.waits(s.t_mb, s.compute, syncs, fsdp_syncs)
    tp_comm += s.micro_batches * tp_syncs * waits.per_call
    cp_comm += s.micro_batches * cp_syncs * waits.per_call
    ep_comm += s.micro_batches * ep_syncs * waits.per_call
    dp_comm, raw = _data_parallel(s, s.cpu.dp_overlap(dp_overlap), waits)
    pp_comm, bubble = _pipeline(s, tp_comm + ep_comm + cp_comm)
    optimizer_s, offload = _optimizer_and_offload(s, optimizer)
    raw_comm = tp_comm + raw + pp_comm + cp_comm + ep_comm
    return StepTime(s.compute, tp_comm, dp_comm, pp_comm, cp_comm, bubble, optimizer_s, offload,
                    raw_comm, ep_comm)


def _busiest(m: ModelConfig, layout: Layout, hw: GpuProfile, seq_len: int,
             micro_batches: int, precision: str, fp8: Fp8Terms | None, cpu: CpuTerms) -> _Step:
    """The pipeline rank whose micro-batch takes longest (it sets the pace), with its
    recomputation."""
    pp = layout.pp
    peak = hw.bf16_flops
    if precision == "fp32":
        peak = peak / 2  # TF32 tensor cores: half the BF16 rate
    n_stages = pp * layout.pp_virtual_stages
    ranges = stage_layers(m, layout)
    t_mb, busiest = 0.0, 0
    for rank in range(pp):
        ids = rank_stages(layout, rank)
        layers = sum(len(ranges[s]) for s in ids)
        moe = sum(moe_layer_count(m, ranges[s]) for s in ids)
        t, _ = micro_batch_compute(m, layout, hw, seq_len, layers, n_stages - 1 in ids, peak,
                                   moe, fp8)
        t += cpu.block_seconds(layout, layers)  # DTensor's host work (CPU processes)
        if t > t_mb:
            t_mb, busiest = t, rank
    ids = rank_stages(layout, busiest)
    t_recompute = recompute_seconds(m, layout, hw, seq_len, t_mb, peak,
                                    sum(len(ranges[s]) for s in ids), n_stages - 1 in ids)
    # Collectives are made again with the recomputed work, except under the per-op policy,
    # which keeps what they return.
    recompute = 0.0 if layout.activation_checkpointing == "selective" else t_recompute / t_mb
    act_bytes = 2 if precision in ("bf16", "fp16", "fp8") else 4
    return _Step(m, layout, hw, seq_len, micro_batches, t_mb + t_recompute, recompute,
                 rank_parameters(m, layout, busiest), ids, n_stages, act_bytes, cpu, fp8=fp8)


def _tensor_parallel(s: _Step) -> tuple[float, float]:
    """(seconds, synchronising calls) of tensor parallelism's collectives in a step: per
    block two all-reduces forward and two backward (or the equal-volume all-gather +
    reduce-scatter pairs of sequence parallelism), not overlapped; MoE layers have
    attention's two only (their MLP is not split)."""
    layout, stage, last = s.layout, s.stage, s.n_stages - 1 in s.ids
    layers = stage.layers
    collectives = 4 * (layers - stage.moe_layers) + 2 * stage.moe_layers
    calls = tp_calls(layout, layers, stage.moe_layers, 0 in s.ids, last)
    # train.fp8 tensorwise: the all-gather half of each collective in float8
    per_element = tp_activation_bytes(s.fp8, s.act_bytes, layout)
    traffic = TpTraffic(layout, s.tokens * s.m.d_model * per_element, collectives, calls,
                        0 in s.ids, last, s.within(layout.tp), s.hw.collective_latency_s)
    per_mb = s.cpu.tp_seconds(traffic, traffic.seconds())
    tp_syncs = calls * (1 + s.recompute) if layout.tp > 1 else 0
    return s.micro_batches * per_mb * (1 + s.recompute), tp_syncs


def _context_parallel(s: _Step) -> tuple[float, float]:
    """(seconds, synchronising calls) of every layer's exchange in the forward, the backward
    and a recomputation that does not keep what it returned, not overlapped."""
    layout = s.layout
    passes = 2 + (layout.activation_checkpointing not in ("none", "selective"))
    lat = s.hw.collective_latency_s
    cp_comm = s.micro_batches * passes * s.stage.layers * (
        cp_exchange(s.m, layout, s.hw, s.seq_len, s.act_bytes)
        + (CP_CALLS[layout.cp_mode] * lat if layout.cp > 1 else 0.0))
    cp_syncs = passes * s.stage.layers * CP_CALLS[layout.cp_mode] if layout.cp > 1 else 0
    return cp_comm, cp_syncs


def _expert_parallel(s: _Step) -> tuple[float, float]:
    """(seconds, synchronising calls): each MoE layer sends every token's top_k copies to the
    experts' ranks and back (dispatch, combine) in the forward, the same again in the
    backward, and the forward's again when full checkpointing recomputes it; not overlapped."""
    layout, stage = s.layout, s.stage
    if not (layout.ep > 1 and stage.moe_layers):
        return 0.0, 0
    passes = 2 + (1 if layout.activation_checkpointing == "full" else 0)
    # dispatch or combine of this rank's part of the sequence
    one_way = s.tokens / layout.tp * s.m.moe_top_k * s.m.d_model * s.act_bytes
    ep_comm = s.micro_batches * stage.moe_layers * passes * 2 * (
        all_to_all(one_way, layout.ep, s.hw) + EP_CALLS_EACH_WAY * s.hw.collective_latency_s)
    return ep_comm, stage.moe_layers * passes * 2 * EP_CALLS_EACH_WAY


def _data_parallel(s: _Step, dp_overlap: float | None, waits: Waits) -> tuple[float, float]:
    """(exposed seconds, raw seconds) of data parallelism over dp x cp ranks (FSDP's shard
    group includes the cp ranks): DDP's bucketed all-reduce, or FSDP's gathers and
    reduce-scatters (routed experts over their own group, ep apart across dp_shard x tp)."""
    layout, hw = s.layout, s.hw
    if layout.dp * layout.cp == 1:
        return 0.0, 0.0
    if not fsdp_active(layout):
        return _ddp(s, dp_overlap, waits)
    dense, experts = s.stage.total - s.stage.experts, s.stage.experts
    shard_group = layout.dp_shard * layout.cp
    shard_bw = s.within(layout.dp_shard * layout.cp * layout.tp)
    expert_group, expert_bw = layout.expert_dp_shard, shard_bw
    gathers, scatters = fsdp_calls(layout.zero, s.micro_batches)
    scatter = s.cpu.scatter  # a reduce-scatter's bytes (gloo has none of its own)
    # train.fp8 with float8 all-gather: the converted weights move at 1 byte
    gathered = gathered_bytes(s.fp8, s.act_bytes * dense, s.act_bytes, s.m, layout.tp,
                              s.stage.layers, s.stage.moe_layers)
    raw = (gathers * (_ring(gathered, shard_group, shard_bw, all_reduce=False)
                      + _ring(s.act_bytes * experts, expert_group, expert_bw, all_reduce=False))
           + scatters * scatter * (
               _ring(4.0 * dense, shard_group, shard_bw, all_reduce=False)
               + _ring(4.0 * experts, expert_group, expert_bw, all_reduce=False)))
    # One all-gather and one reduce-scatter call per FSDP unit (each block, and the root
    # module's embeddings and output), as many times as the bytes above move.
    units = s.stage.layers + 1
    lat = hw.collective_latency_s
    raw += units * (gathers + scatters) * lat
    if layout.dp_replicate > 1:  # HSDP: sharded gradients all-reduced across replicas
        raw += _ring(4.0 * (dense / shard_group + experts / expert_group),
                     layout.dp_replicate, s.inter, all_reduce=True) + units * lat
    raw += units * (gathers + scatters) * waits.per_call
    hide = FSDP_OVERLAP if dp_overlap is None else dp_overlap
    # ZeRO-1 gathers parameters once (behind the first micro-batch's forward) and
    # reduce-scatters gradients once (behind the last one's backward): one micro-batch
    # of compute to hide behind, however many there are. ZeRO-2/3 collectives run in
    # every micro-batch, behind all of the compute.
    window = s.t_mb if layout.zero == 1 else s.compute
    return max(0.0, raw - hide * window), raw


def _ddp(s: _Step, dp_overlap: float | None, waits: Waits) -> tuple[float, float]:
    """(exposed, raw) seconds of DDP's all-reduce of the fp32 gradients in buckets."""
    layout, hw = s.layout, s.hw
    grad_bytes = 4.0 * s.stage.total
    buckets = max(1, math.ceil(grad_bytes / (DDP_BUCKET_MB * 2**20)))
    ranks = layout.dp * layout.cp
    raw = (_ring(grad_bytes, ranks, s.within(ranks * layout.tp), all_reduce=True)
           + buckets * hw.collective_latency_s)
    raw = s.cpu.ddp_seconds(raw, grad_bytes, buckets, ranks)
    hide = DDP_OVERLAP if dp_overlap is None else dp_overlap
    # its first bucket waits for the slowest rank (the buckets after it follow at once)
    raw += waits.first_bucket
    return max(0.0, raw - hide * s.t_mb * 2 / 3), raw  # the last micro-batch's backward


def _pipeline(s: _Step, model_parallel_comm: float) -> tuple[float, float]:
    """(send/receive seconds, bubble seconds): each micro-batch's hidden state crosses every
    stage boundary both ways; the bubble is (pp - 1) of the busiest stage's micro-batch."""
    layout, m = s.layout, s.m
    pp, v, tp = layout.pp, layout.pp_virtual_stages, layout.tp
    if pp == 1:
        return 0.0, 0.0
    pp_comm = 2 * s.micro_batches * v * (s.tokens * m.d_model * s.act_bytes / tp
                                         / s.within(layout.world)
                                         + s.hw.collective_latency_s)
    if m.tie_embeddings:
        # Megatron's embedding group: the first and the last stage sum the tied
        # embedding's fp32 gradient (their shard of it) once per step, across nodes.
        shard_group = layout.dp_shard * layout.cp
        emb_shard = m.padded_vocab_size * m.d_model / tp / (
            shard_group if fsdp_active(layout) else 1)
        pp_comm += _ring(4.0 * emb_shard, 2, s.inter, all_reduce=True)
    per_mb = s.t_mb + model_parallel_comm / s.micro_batches
    bubble = (pp - 1) * per_mb / v
    if layout.pp_schedule == "zero-bubble":
        bubble *= ZERO_BUBBLE_FACTOR
    elif layout.pp_schedule in ("gpipe", "1f1b"):
        bubble = (pp - 1) * per_mb
    return pp_comm, bubble


def _optimizer_and_offload(s: _Step, optimizer: OptimizerSpec) -> tuple[float, float]:
    """(optimizer seconds, offload seconds) of a step on the busiest rank."""
    layout, hw, stage = s.layout, s.hw, s.stage
    dense, experts = stage.total - stage.experts, stage.experts
    fsdp = fsdp_active(layout)
    local_params = (dense / (layout.dp_shard * layout.cp) + experts / layout.expert_dp_shard
                    if fsdp else stage.total)
    link = s.within(layout.dp_shard * layout.cp * layout.tp) if fsdp else s.within(layout.tp)
    optimizer_s = optimizer_step_time(s.m, layout, hw, stage, local_params, optimizer, link)
    optimizer_s += s.cpu.optimizer_seconds(layout, stage.layers)  # DTensor's host work
    offload = 0.0
    if layout.offload != "none":
        # Gradients to the host, parameters both ways, AdamW on the host CPU.
        optimizer_s = 0.0
        offload = 12.0 * local_params / HOST_LINK_BYTES_PER_S + local_params / HOST_ADAM_PARAMS_PER_S
    if layout.offload == "params" and fsdp:
        # FSDP2's CPU offload copies each shard to the device before every all-gather and
        # each reduced gradient shard back, micro-batch by micro-batch.
        gathers, scatters = fsdp_calls(layout.zero, s.micro_batches)
        offload += 4.0 * local_params * (gathers + scatters) / HOST_LINK_BYTES_PER_S
    return optimizer_s, offload


def optimizer_step_time(m: ModelConfig, layout: Layout, hw: GpuProfile, stage: StageParams,
                        local_params: float, optimizer: OptimizerSpec, bandwidth: float) -> float:
    """Seconds of one optimizer step on a rank holding `local_params` elements of `stage`:
    the element-wise update at device memory bandwidth; Muon adds its share of Newton-Schulz
    at the matmul rate and the gather and return of whole matrices over `bandwidth`."""
    fsdp = fsdp_active(layout)
    muon_local = 0.0
    if optimizer.muon:
        muon_total = stage.matmul - stage.head_matmul
        muon_local = muon_total * local_params / max(stage.total, 1)
    seconds = optimizer.step_bytes(local_params, muon_local) / (hw.hbm_gbps * 1e9)
    if optimizer.muon and stage.layers:
        work = muon_step(m, layout, stage.layers, stage.moe_layers, optimizer.ns_steps, fsdp)
        seconds += work.flops / (hw.bf16_flops * hw.matmul_efficiency)
        seconds += work.comm_bytes / bandwidth
    return seconds
