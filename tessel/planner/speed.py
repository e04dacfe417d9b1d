"""Step time of one layout: compute from each matmul's FLOPs at an efficiency that depends on
its size, communication from message sizes, ring algorithms and link bandwidths with the
overlap tessel's implementation achieves, and each pipeline schedule's bubble.

Overlap, as implemented: DDP's bucketed all-reduce runs during the backward pass and FSDP2
prefetches its all-gathers and issues its reduce-scatters while blocks compute, so only what
exceeds the compute they hide behind is exposed; tensor-parallel collectives (DTensor),
context parallelism's exchange (each layer waits for its keys and values before the kernel
runs) and pipeline sends are not overlapped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tessel.config import ModelConfig
from tessel.models.loss import loss_pieces
from tessel.planner.calls import (
    GLOO_SCATTER,
    on_curve,
    ring_bytes,
    tp_calls,
    tp_calls_seconds,
)
from tessel.planner.calls import ring_seconds as _ring
from tessel.planner.hardware import GpuProfile
from tessel.planner.kept import unchecked_share
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

MATMUL_HALF_SIZE = 128  # a matmul whose smallest dimension is k runs at k/(k+128) of the rate
DDP_OVERLAP = 0.8  # fraction of the backward pass DDP's all-reduce hides behind
FSDP_OVERLAP = 0.85  # fraction of compute FSDP2's prefetched collectives hide behind
# On CPU processes (a profile with device_type "cpu") data-parallel collectives hide behind
# nothing: gloo moves the bytes on threads of the same process, which share its core with
# the computing thread, so a collective "in flight behind the backward" takes its time from
# the backward. Measured on 2 processes of this project's 2-core machine (demo model, 8.9 MB
# of gradients): DDP's backward with its all-reduce took 12-31 ms longer than without
# (no_sync), the all-reduce alone 8-17 ms.
CPU_OVERLAP = 0.0
# Recomputed work as a share of a micro-batch's: full checkpointing runs each block's forward
# again; matmuls (every matmul output kept) recomputes only element-wise work (its time, not
# its FLOPs, shows). The per-op `selective` policy's share is counted from the shapes of the
# matmuls it recomputes (`recompute_seconds`).
RECOMPUTE = {"none": 0.0, "matmuls": 0.03, "full": 1.0 / 3.0}
HOST_LINK_BYTES_PER_S = 25e9  # device <-> host, PCIe 5 x16 achievable per GPU
HOST_ADAM_PARAMS_PER_S = 1.5e9  # AdamW on the host, parameters per second per rank
ZERO_BUBBLE_FACTOR = 0.5  # credited half the interleaved bubble (not measured)
# Routed experts' grouped matmuls (torch._grouped_mm) run at this fraction of what dense
# matmuls of the same size reach. Not fitted: one published measurement, VeOmni PR #460
# (ByteDance-Seed/VeOmni, H100, torch._grouped_mm MoE forward, Qwen3-30B-A3B's expert shape:
# 32,768 tokens, 128 experts of 768, top-8): 242 TFLOP/s, 0.46 of the 530 TFLOP/s this model
# gives dense matmuls of that size (0.625 x 768/896 of 989), rounded to 0.5.
GROUPED_GEMM_EFFICIENCY = 0.5
# The search splits a sequence over cp ranks only while each keeps at least this many
# positions (cp from 8K sequences on, as NeMo advises): the model counts the exchange's bytes
# and calls but not the masked kernel's lower efficiency on short pieces, which would credit
# splitting short sequences with more than they give.
MIN_CP_POSITIONS = 4096
# train.fp8 (torchao's float8 linears, tensorwise scaling): the fraction of the FP8 peak x
# matmul efficiency its matmuls reach, casts and scales included (they run beside each
# matmul, memory-bound). Fitted on torchtitan's Float8 rows (Llama 3 8B, 8 and 128 H100s at
# 500 W with torch.compile: 8,532 and 8,380 tokens/s per GPU against 6,667 and 6,514 in bf16).
FP8_EFFICIENCY = 0.74
DDP_BUCKET_MB = 25  # tessel.parallel.fsdp's DDP gradient buckets (a test checks): one call each
# Collective calls of one layer's context-parallel exchange, one way: the keys' and values'
# all-gathers; Ulysses' all-to-alls of queries, keys, values and the attention output.
CP_CALLS = {"allgather": 2, "ulysses": 4}
# Expert parallelism's dispatch (or combine): the per-expert counts, then the tokens.
EP_CALLS_EACH_WAY = 2

ASSUMPTIONS = (
    f"compute: each matmul's FLOPs (causal attention at half its full-matrix FLOPs) at peak x "
    f"matmul_efficiency x k/(k+{MATMUL_HALF_SIZE}), k its smallest per-GPU dimension; full "
    "checkpointing adds a forward pass, selective 3%; AdamW at device memory bandwidth",
    "collectives: ring algorithm, 2(n-1)/n x bytes (all-reduce) or (n-1)/n (all-gather, "
    "reduce-scatter) at comm_efficiency x the per-GPU intra-node bandwidth when the group "
    f"fits in a node, else the inter-node bandwidth; DDP hides behind {DDP_OVERLAP:.0%} of "
    f"backward, FSDP behind {FSDP_OVERLAP:.0%} of compute (ZeRO-1, which gathers and "
    "reduce-scatters once per step, of one micro-batch's; on CPU processes behind nothing); "
    "tensor-parallel collectives and "
    "pipeline sends are exposed; every call also costs the profile's collective latency "
    f"(calls: a DDP bucket of {DDP_BUCKET_MB} MiB, an FSDP unit's gather or reduce-scatter, "
    "a tensor-parallel block's 4 (10 with sequence parallelism), a pipeline send, a "
    "context-parallel layer's 2 (Ulysses 4), an expert dispatch's 2); a profile measured on "
    "CPU processes prices tensor-parallel calls and DDP buckets instead at their sizes on its "
    "measured curve of a call's time (collective_curve; an all-gather at half an all-reduce "
    "of twice its bytes)",
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


def _size_efficiency(k: float) -> float:
    return k / (k + MATMUL_HALF_SIZE)


def micro_batch_compute(m: ModelConfig, layout: Layout, hw: GpuProfile, seq_len: int,
                        layers: int, last: bool, peak: float, moe_layers: int = 0,
                        fp8_peak: float | None = None) -> tuple[float, float]:
    """(seconds of one micro-batch's forward + backward on one GPU of a pipeline rank with
    `layers` blocks, `moe_layers` of them Mixture-of-Experts layers, of which attention)
    without recomputation. `fp8_peak`: the blocks' projections (train.fp8's float8 linears:
    attention's and the dense MLPs', shared experts' included) run at that peak x
    FP8_EFFICIENCY; attention, the router, routed experts and the head stay at `peak`."""
    tokens = layout.micro_batch * seq_len / layout.cp
    tp = layout.tp
    d, f, q, kv = m.d_model, m.ffn_hidden, m.q_dim, m.n_kv_heads * m.head_dim
    n_in = 2 if m.mlp == "swiglu" else 1
    rate = peak * hw.matmul_efficiency
    linear = fp8_peak * hw.matmul_efficiency * FP8_EFFICIENCY if fp8_peak else rate

    def matmuls(shapes: list[tuple[float, float]], rows: float, at: float) -> float:
        """Seconds of forward + backward of (K, N) matmuls over `rows` rows at rate `at`."""
        return sum(6 * rows * k * n / (at * _size_efficiency(min(rows, k, n))) for k, n in shapes)

    def mlp(hidden: float) -> list[tuple[float, float]]:
        return [(d, hidden / tp)] * n_in + [(hidden / tp, d)]

    # (K, N) of each matmul of a block on one tensor-parallel rank; M is `tokens`.
    attn_mm = matmuls([(d, q / tp), (d, kv / tp), (d, kv / tp), (q / tp, d)], tokens, linear)
    block = attn_mm + matmuls(mlp(f), tokens, linear)
    # Attention: QK^T and PV over the causal half of the (gathered) sequence, per head: each
    # context-parallel rank 1/cp of it (Ulysses: every row, heads/cp heads); contiguous
    # pieces leave the last rank (2cp-1)/cp of the mean.
    heads = m.n_heads / tp
    attn_flops = 6 * 2 * tokens * seq_len * m.head_dim * heads / 2
    if layout.cp > 1 and not layout.cp_load_balance and layout.cp_mode == "allgather":
        attn_flops *= (2 * layout.cp - 1) / layout.cp
    attention = attn_flops / (rate * _size_efficiency(m.head_dim))
    total = (layers - moe_layers) * (block + attention)
    if moe_layers:
        assert m.moe_ffn_hidden is not None
        h, k, E = m.moe_ffn_hidden, m.moe_top_k, m.moe_experts
        # The fp32 router at half the BF16 rate, the shared experts as a dense MLP, the routed
        # experts over tokens x top_k slots, each local expert's rows tokens x k x ep / E.
        # Under tensor parallelism MoE layers are not split: each rank runs its 1/tp of the
        # sequence through whole weights.
        moe_tokens = tokens / tp
        moe = attn_mm + attention + matmuls([(d, E)], moe_tokens, rate / 2)
        if m.moe_shared_experts:
            shared = m.moe_shared_experts * h
            moe += matmuls([(d, shared)] * n_in + [(shared, d)], moe_tokens, linear)
        slots = moe_tokens * k
        rows = slots * layout.ep / E
        moe += sum(6 * slots * a * b / (rate * GROUPED_GEMM_EFFICIENCY
                                        * _size_efficiency(min(rows, a, b)))
                   for a, b in [(d, h)] * n_in + [(h, d)])
        total += moe_layers * moe
    if last:
        v = m.padded_vocab_size / tp
        total += 6 * tokens * d * v / (rate * _size_efficiency(min(tokens, d, v)))
    return total, layers * attention


def recompute_seconds(m: ModelConfig, layout: Layout, hw: GpuProfile, seq_len: int,
                      t_mb: float, peak: float, layers: int, last: bool) -> float:
    """Seconds one micro-batch spends again in its backward: the share RECOMPUTE gives of its
    compute `t_mb` (full, matmuls), or the per-op policy's recomputed matmuls (the 2nd, 4th,
    6th of each block: wk, wo and w3 in a SwiGLU block, wk, wo and w2 in a GELU one), on the
    blocks checkpointing applies to; and the output projection's forward again for each
    piece of a chunked loss on the last stage."""
    ac = layout.activation_checkpointing
    share = 1.0 - unchecked_share(layout, m.n_layers)
    tokens = layout.micro_batch * seq_len / layout.cp
    tp, d = layout.tp, m.d_model
    rate = peak * hw.matmul_efficiency
    seconds = t_mb * RECOMPUTE.get(ac, 0.0) * share
    if ac == "selective":
        kv = m.n_kv_heads * m.head_dim
        hidden = m.ffn_hidden / tp
        even = [(d, kv / tp), (m.q_dim / tp, d),
                (d, hidden) if m.mlp == "swiglu" else (hidden, d)]
        seconds += share * layers * sum(
            2 * tokens * k * n / (rate * _size_efficiency(min(tokens, k, n))) for k, n in even)
    if last and loss_pieces(layout.loss_chunks, tokens, m.padded_vocab_size / tp) > 1:
        v = m.padded_vocab_size / tp
        seconds += 2 * tokens * d * v / (rate * _size_efficiency(min(tokens, d, v)))
    return seconds


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


def sync_wait(hw: GpuProfile, compute_s: float) -> float:
    """Seconds a synchronising collective waits for the slowest rank after `compute_s` of
    compute since the previous one: the ranks' random drift (sync_drift x sqrt(L)) or, after
    longer compute, their steady difference in speed (sync_skew x L), whichever is larger."""
    return max(hw.sync_drift * math.sqrt(compute_s), hw.sync_skew * compute_s)


def fsdp_calls(zero: int, micro_batches: int) -> tuple[int, int]:
    """(all-gathers, reduce-scatters) of each FSDP unit in a step: ZeRO-1 gathers the
    parameters and reduce-scatters the gradients once, ZeRO-2 gathers and reduce-scatters
    in every micro-batch, ZeRO-3 gathers again for the backward."""
    return {1: 1, 2: micro_batches, 3: 2 * micro_batches}[zero], 1 if zero == 1 else micro_batches


def estimate_step(
    m: ModelConfig, layout: Layout, hw: GpuProfile, seq_len: int, global_batch: int,
    precision: str, dp_overlap: float | None = None, optimizer: OptimizerSpec = ADAMW,
    fp8: bool = False,
) -> StepTime:
    """`dp_overlap` replaces the fraction of compute data-parallel communication hides
    behind (DDP_OVERLAP / FSDP_OVERLAP): 0 models an implementation that reduces gradients
    after the backward pass (used to replay published runs of such systems). `optimizer`:
    its update's memory traffic and, for Muon, its Newton-Schulz work and whole-matrix
    collectives (planner/optimizer.py), all in `optimizer_s`."""
    pp, v, tp, cp = layout.pp, layout.pp_virtual_stages, layout.tp, layout.cp
    micro_batches = global_batch // (layout.micro_batch * layout.dp)
    peak = hw.bf16_flops
    fp8_peak = hw.fp8_flops if fp8 else None  # train.fp8: the blocks' projections
    if precision == "fp32":
        peak = peak / 2  # TF32 tensor cores: half the BF16 rate
    n_stages = pp * v
    ranges = stage_layers(m, layout)

    # The busiest pipeline rank sets the pace.
    t_mb, busiest = 0.0, 0
    for rank in range(pp):
        ids = rank_stages(layout, rank)
        layers = sum(len(ranges[s]) for s in ids)
        moe = sum(moe_layer_count(m, ranges[s]) for s in ids)
        t, _ = micro_batch_compute(m, layout, hw, seq_len, layers, n_stages - 1 in ids, peak,
                                   moe, fp8_peak)
        if tp > 1:  # DTensor's host work per block (0 in GPU profiles: hidden, see GpuProfile)
            t += layers * hw.tp_block_overhead_s
        if t > t_mb:
            t_mb, busiest = t, rank
    busiest_ids = rank_stages(layout, busiest)
    t_recompute = recompute_seconds(
        m, layout, hw, seq_len, t_mb, peak,
        sum(len(ranges[s]) for s in busiest_ids), n_stages - 1 in busiest_ids)
    # Collectives are made again with the recomputed work, except under the per-op policy,
    # which keeps what they return.
    recompute = 0.0 if layout.activation_checkpointing == "selective" else t_recompute / t_mb
    t_mb += t_recompute
    compute = micro_batches * t_mb

    intra = hw.intra_node_gbps * 1e9 * hw.comm_efficiency
    inter = hw.inter_node_gbps * 1e9 * hw.comm_efficiency
    act_bytes = 2 if precision in ("bf16", "fp16", "fp8") else 4
    tokens = layout.micro_batch * seq_len / cp
    ids = rank_stages(layout, busiest)
    stage = rank_parameters(m, layout, busiest)
    layers = stage.layers

    # Tensor parallel: per block, two all-reduces forward and two backward (or the equal-volume
    # all-gather + reduce-scatter pairs of sequence parallelism), not overlapped.
    tp_bw = intra if tp <= hw.gpus_per_node else inter
    # MoE layers have attention's two only (their MLP is not split).
    collectives = 4 * (layers - stage.moe_layers) + 2 * stage.moe_layers
    lat = hw.collective_latency_s
    calls = tp_calls(layout, layers, stage.moe_layers, 0 in ids, n_stages - 1 in ids)
    per_mb = tp_calls_seconds(hw, layout, layout.micro_batch * seq_len / cp * m.d_model * act_bytes,
                              collectives, calls, 0 in ids, n_stages - 1 in ids, tp_bw)
    tp_comm = micro_batches * per_mb * (1 + recompute)
    tp_syncs = calls * (1 + recompute) if tp > 1 else 0

    # Context parallel: every layer's exchange in the forward, the backward and a
    # recomputation, not overlapped.
    passes = 2 + (layout.activation_checkpointing not in ("none", "selective"))
    cp_comm = micro_batches * passes * layers * (
        cp_exchange(m, layout, hw, seq_len, act_bytes)
        + (CP_CALLS[layout.cp_mode] * lat if cp > 1 else 0.0))
    cp_syncs = passes * layers * CP_CALLS[layout.cp_mode] if cp > 1 else 0

    # Expert parallelism: each MoE layer sends every token's top_k copies to the experts'
    # ranks and back (dispatch, combine) in the forward, the same again in the backward, and
    # the forward's again when full checkpointing recomputes it; not overlapped.
    ep_comm, ep_syncs = 0.0, 0
    if layout.ep > 1 and stage.moe_layers:
        passes = 2 + (1 if layout.activation_checkpointing == "full" else 0)
        # dispatch or combine of this rank's part of the sequence
        one_way = tokens / tp * m.moe_top_k * m.d_model * act_bytes
        ep_comm = micro_batches * stage.moe_layers * passes * 2 * (
            all_to_all(one_way, layout.ep, hw) + EP_CALLS_EACH_WAY * lat)
        ep_syncs = stage.moe_layers * passes * 2 * EP_CALLS_EACH_WAY

    # Ranks' drift: each collective above, and FSDP's gathers and reduce-scatters, waits
    # for the slowest rank after the compute since the one before (a micro-batch's spread
    # evenly over its collectives).
    syncs = tp_syncs + cp_syncs + ep_syncs
    if fsdp_active(layout) and layout.dp * cp > 1:
        syncs_with_dp = syncs + (layers + 1) * sum(fsdp_calls(layout.zero, micro_batches)) \
            / micro_batches
    else:
        syncs_with_dp = syncs
    drift = sync_wait(hw, t_mb / syncs_with_dp) if syncs_with_dp else 0.0
    tp_comm += micro_batches * tp_syncs * drift
    cp_comm += micro_batches * cp_syncs * drift
    ep_comm += micro_batches * ep_syncs * drift

    # Data parallel over dp x cp ranks (FSDP's shard group includes the cp ranks). Routed
    # experts are sharded over their own group, whose ranks are ep apart across the
    # dp_shard x tp ranks.
    params = stage.total
    experts = stage.experts
    dense = params - experts
    shard_group = layout.dp_shard * cp
    span = layout.dp_shard * cp * tp  # consecutive ranks one shard group covers
    shard_bw = intra if span <= hw.gpus_per_node else inter
    expert_group = layout.expert_dp_shard
    expert_bw = intra if layout.dp_shard * cp * tp <= hw.gpus_per_node else inter
    grad_bytes = 4.0 * params
    raw = 0.0
    if layout.dp * cp == 1:
        dp_comm = 0.0
    elif not fsdp_active(layout):
        dp_bw = intra if layout.dp * cp * tp <= hw.gpus_per_node else inter
        buckets = max(1, math.ceil(grad_bytes / (DDP_BUCKET_MB * 2**20)))
        if hw.collective_curve:  # each bucket at its size on the measured curve
            raw = buckets * on_curve(hw.collective_curve,
                                     ring_bytes(grad_bytes / buckets, layout.dp * cp, True))
        else:
            raw = _ring(grad_bytes, layout.dp * cp, dp_bw, all_reduce=True) + buckets * lat
        hide = DDP_OVERLAP if dp_overlap is None else dp_overlap
        if dp_overlap is None and hw.device_type == "cpu":
            hide = CPU_OVERLAP
        # its first bucket waits for the slowest rank after the step's whole compute when
        # nothing synchronised the ranks before (accumulation runs without), else after the
        # last micro-batch's last piece; the buckets after it follow at once
        raw += sync_wait(hw, compute) if not syncs else drift
        dp_comm = max(0.0, raw - hide * t_mb * 2 / 3)  # the last micro-batch's backward
    else:
        gathers, scatters = fsdp_calls(layout.zero, micro_batches)
        scatter = GLOO_SCATTER if hw.device_type == "cpu" else 1.0
        raw = (gathers * (_ring(act_bytes * dense, shard_group, shard_bw, all_reduce=False)
                          + _ring(act_bytes * experts, expert_group, expert_bw, all_reduce=False))
               + scatters * scatter * (
                   _ring(4.0 * dense, shard_group, shard_bw, all_reduce=False)
                   + _ring(4.0 * experts, expert_group, expert_bw, all_reduce=False)))
        # One all-gather and one reduce-scatter call per FSDP unit (each block, and the root
        # module's embeddings and output), as many times as the bytes above move.
        units = layers + 1
        raw += units * (gathers + scatters) * lat
        if layout.dp_replicate > 1:  # HSDP: sharded gradients all-reduced across replicas
            raw += _ring(4.0 * (dense / shard_group + experts / expert_group),
                         layout.dp_replicate, inter, all_reduce=True) + units * lat
        raw += units * (gathers + scatters) * drift
        hide = FSDP_OVERLAP if dp_overlap is None else dp_overlap
        if dp_overlap is None and hw.device_type == "cpu":
            hide = CPU_OVERLAP
        # ZeRO-1 gathers parameters once (behind the first micro-batch's forward) and
        # reduce-scatters gradients once (behind the last one's backward): one micro-batch
        # of compute to hide behind, however many there are. ZeRO-2/3 collectives run in
        # every micro-batch, behind all of the compute.
        window = t_mb if layout.zero == 1 else compute
        dp_comm = max(0.0, raw - hide * window)

    # Pipeline: each micro-batch's hidden state crosses every stage boundary both ways.
    pp_comm = bubble = 0.0
    if pp > 1:
        pp_bw = intra if layout.world <= hw.gpus_per_node else inter
        pp_comm = 2 * micro_batches * v * (tokens * m.d_model * act_bytes / tp / pp_bw + lat)
        if m.tie_embeddings:
            # Megatron's embedding group: the first and the last stage sum the tied
            # embedding's fp32 gradient (their shard of it) once per step, across nodes.
            emb_shard = m.padded_vocab_size * m.d_model / tp / (shard_group if fsdp_active(layout) else 1)
            pp_comm += _ring(4.0 * emb_shard, 2, inter, all_reduce=True)
        per_mb = t_mb + (tp_comm + ep_comm + cp_comm) / micro_batches
        bubble = (pp - 1) * per_mb / v
        if layout.pp_schedule == "zero-bubble":
            bubble *= ZERO_BUBBLE_FACTOR
        elif layout.pp_schedule in ("gpipe", "1f1b"):
            bubble = (pp - 1) * per_mb

    local_params = (dense / shard_group + experts / expert_group if fsdp_active(layout)
                    else params)
    optimizer_s = optimizer_step_time(m, layout, hw, stage, local_params, optimizer,
                                      shard_bw if fsdp_active(layout) else tp_bw)
    if tp > 1:  # DTensor's host work in clipping and the update (0 in GPU profiles)
        optimizer_s += layers * hw.tp_block_optimizer_s
    offload = 0.0
    if layout.offload != "none":
        # Gradients to the host, parameters both ways, AdamW on the host CPU.
        optimizer_s = 0.0
        offload = 12.0 * local_params / HOST_LINK_BYTES_PER_S + local_params / HOST_ADAM_PARAMS_PER_S
    if layout.offload == "params" and fsdp_active(layout):
        # FSDP2's CPU offload copies each shard to the device before every all-gather and
        # each reduced gradient shard back, micro-batch by micro-batch.
        gathers, scatters = fsdp_calls(layout.zero, micro_batches)
        offload += 4.0 * local_params * (gathers + scatters) / HOST_LINK_BYTES_PER_S
    raw_comm = tp_comm + raw + pp_comm + cp_comm + ep_comm
    return StepTime(compute, tp_comm, dp_comm, pp_comm, cp_comm, bubble, optimizer_s, offload,
                    raw_comm, ep_comm)


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
