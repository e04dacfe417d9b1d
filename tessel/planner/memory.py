"""Per-GPU memory of one layout, for the busiest pipeline rank.

Exact (counted from the model's shapes as tessel shards them): parameters, gradients and
optimizer state under every ZeRO stage and offload, and the compute copies of the weights
(FSDP's gathered bf16 parameters, autocast's weight casts). Activations come from the
tensors the model really saves (`probe.py`), times the micro-batches each pipeline schedule
keeps in flight. The rest is stated as assumptions (ASSUMPTIONS, printed by `tessel plan`).

`allocated` is what torch.cuda.max_memory_allocated() would show; `total` adds the CUDA
context, communicator buffers and allocator fragmentation, and is what must fit.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from tessel.config import LoraConfig, ModelConfig
from tessel.models.loss import loss_pieces
from tessel.models.transformer import block_norms, qk_norm_params
from tessel.parallel.checkpointing import checkpointed_blocks
from tessel.parallel.dims import stage_layer_counts
from tessel.parallel.fsdp import data_parallel_kind
from tessel.planner.kept import (
    context_buffers,
    head_bytes,
    moe_layer_count,
    shared_per_token,
    stage_counts,
    unchecked_share,
)
from tessel.planner.layout import Layout
from tessel.planner.lora import adapter_parameters, base_block_matmul_bytes, cast_elements
from tessel.planner.optimizer import ADAMW, OptimizerSpec, muon_transient_bytes
from tessel.planner.probe import activation_profile, context_profile
from tessel.planner.saved import ActivationProfile, layer_bytes, rank_profile
from tessel.planner.schedule import in_flight, peak_in_flight, pipeline_order

GIB = 2**30
CUDA_CONTEXT_BYTES = 0.75 * GIB  # the CUDA context and kernel images, outside the allocator
NCCL_BYTES = 0.5 * GIB  # communicator buffers, outside the allocator
FRAGMENTATION = 0.05  # caching allocator: reserved above allocated
ADAM_BYTES = 8  # exp_avg + exp_avg_sq, fp32
MASTER_BYTES = 4  # parameters are fp32; bf16 exists only as compute copies
GRAD_BYTES = 4  # gradients are fp32 (FSDP reduces in fp32)
# The head's transient during the loss: logits in the compute dtype, their fp32 copy and the
# fp32 gradient, per vocabulary entry of a token.
HEAD_TRANSIENT_FP32_COPIES = 2

ASSUMPTIONS = (
    "parameters and gradients fp32, optimizer state as the optimizer's line says, all sharded over "
    "dp_shard x cp under ZeRO >= 1 (routed experts: moe_experts / ep per rank, sharded over "
    "the experts' own group of dp_shard x tp / ep ranks); compute copies: FSDP gathers bf16 "
    "parameters (ZeRO-1/2: all, kept from forward to backward; ZeRO-3: the root module and "
    "two blocks), DDP's autocast keeps one bf16 copy of the matmul weights",
    "activations: the tensors tessel's model saves for backward, measured on a probe of the "
    "real code (flash-style attention: no seq x seq matrix without a mask; a dense mask, on "
    "CPU or with attention dropout, one additive mask in the compute dtype shared by every "
    "layer; FlexAttention's block masks, on CUDA, counted as nothing), times "
    "the micro-batches in flight: gpipe all, 1f1b pp - rank, interleaved 1F1B the peak of "
    "PyTorch's own action order (each stage's chunk weighed by its size); zero-bubble 1.75 x "
    "its warm-up count (a rough bound: deferred weight passes keep graphs longer; not "
    "proposed by the search)",
    "activation checkpointing (every block or every N-th): full keeps each block's input; matmuls "
    "every matmul and attention output; selective attention outputs, what collectives return, "
    "every other matmul output; the loss in pieces no logits, one piece's at a time",
    "MoE layers: what an MoE layer saves is measured on a probe MoE block (permuted token "
    "copies, expert hidden units, fp32 router logits, ...) assuming balanced routing (every "
    "rank's experts get tokens x top_k slots); expert parallelism adds the dispatch and "
    "combine buffers of one layer (2 x tokens x top_k x d_model in the compute dtype)",
    "context parallelism: a rank's activations are those of its micro_batch x seq_len / cp "
    "tokens, measured on the probe run as one rank of cp 2 with a stand-in exchange of the "
    "real shapes; allgather also keeps, per layer, the whole sequence's keys and values as "
    "the kernel takes them (KV heads / tp per position: the kernel reads grouped-query "
    "attention as it is; the size of cp x its own tokens' keys and values) and, on CPU, one "
    "dense mask of its rows over the whole sequence (always, under cp); ulysses keeps its "
    "head-sharded queries, keys, values and output (the size of its own tokens'), a copy "
    "of the output and, with documents, a mask over "
    "the whole sequence; buffers: one layer's gathered keys and values (ulysses: the "
    "all-to-all's send and receive buffers)",
    "LoRA (lora.enabled): the frozen base has no gradients or AdamW state (the blocks' "
    "projections held in lora.base_dtype, routed experts float32), the adapters have both; "
    "activations measured on the probe with the run's adapters (a frozen matmul keeps no "
    "input for its weight's gradient; every adapter keeps A x; the first block, whose "
    "input needs no gradient, keeps nothing before its first adapter); autocast's weight "
    "copies (bf16 without FSDP): the fp32 frozen weights and the adapters, the first "
    "block's counted in full; step time as for full training (an upper bound)",
    f"outside the allocator: {CUDA_CONTEXT_BYTES / GIB:.2f} GiB CUDA context + "
    f"{NCCL_BYTES / GIB:.2f} GiB communicators; fragmentation {FRAGMENTATION:.0%} of allocated",
)


@dataclass
class Memory:
    """Bytes on the busiest GPU of the layout (`stage`: its pipeline rank)."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    communication: float
    margin: float
    stage: int = 0
    saved: float = 0.0
    """Of `activations`, the tensors saved for backward (the rest is transient)."""
    host: float = 0.0
    """Bytes this rank keeps in host memory (offload)."""
    weights: float = 0.0
    """Of `parameters`, the weights as stored, without the copies compute makes of them."""

    @property
    def allocated(self) -> float:
        return (self.parameters + self.gradients + self.optimizer + self.activations
                + self.communication)

    @property
    def total(self) -> float:
        return self.allocated + self.margin

    def gib(self) -> dict[str, float]:
        keys = ("parameters", "gradients", "optimizer", "activations", "communication", "margin")
        out = {k: round(getattr(self, k) / GIB, 3) for k in keys}
        out["allocated"] = round(self.allocated / GIB, 3)
        out["total"] = round(self.total / GIB, 3)
        if self.host:
            out["host"] = round(self.host / GIB, 3)
        return out


@dataclass(frozen=True)
class StageParams:
    """Parameter counts on one tensor-parallel rank of a pipeline rank's stages."""

    total: int
    block: int
    """One block."""
    root: int
    """Outside the blocks: embeddings, final norm, head (FSDP's root unit)."""
    matmul: int
    """Matmul weights (what autocast casts): the blocks' and the head's."""
    layers: int
    head_matmul: int = 0
    """The head's matmul weights (0 off the last stage)."""
    experts: int = 0
    """Of `total`, the routed experts' weights on one expert-parallel rank (moe_experts / ep
    of each MoE layer's experts): sharded over the experts' own group, not dp_shard."""
    moe_layers: int = 0
    """Of `layers`, the Mixture-of-Experts layers."""


def stage_parameters(m: ModelConfig, layers: int, first: bool, last: bool, tp: int,
                     moe_layers: int = 0, ep: int = 1) -> StageParams:
    """Parameters held by one tensor-parallel (and expert-parallel) rank of a pipeline rank
    with `layers` blocks, `moe_layers` of them Mixture-of-Experts layers, the embeddings if
    `first`, the final norm and head if `last`. Column-parallel weights and biases and
    row-parallel weights are split by tp, and so is projection-wide QK-norm; row-parallel
    biases, norms and per-head QK-norm are replicated; embedding and head split over the
    vocabulary. An MoE layer has the fp32 router (moe_experts x d_model), moe_experts / ep
    routed experts (no biases) and its shared experts, a dense MLP of moe_shared_experts x
    moe_ffn_hidden; none of it split by tp (MoE layers run on each tp rank's tokens)."""
    d, f, q, kv = m.d_model, m.ffn_hidden, m.q_dim, m.n_kv_heads * m.head_dim
    n_in = 2 if m.mlp != "gelu" else 1  # w1 (and w3)
    norm = d * (2 if m.norm == "layernorm" and m.bias else 1)

    def mlp(hidden: int, split: int) -> tuple[int, int]:
        """(matmul weights, all parameters) of a dense MLP split over `split` ranks."""
        mm = n_in * d * hidden // split + hidden * d // split
        return mm, mm + ((n_in * hidden // split + d) if m.bias else 0)

    attn_mm = (d * q + 2 * d * kv) // tp + q * d // tp
    attn = (attn_mm + ((q + 2 * kv) // tp if m.bias or m.qkv_bias else 0) + (d if m.bias else 0)
            + block_norms(m) * norm + qk_norm_params(m, tp))
    dense_mm, dense_all = mlp(f, tp)
    expert_layer = moe_mm = moe_all = 0
    if moe_layers:
        assert m.moe_ffn_hidden is not None
        h = m.moe_ffn_hidden
        expert_layer = m.moe_experts // ep * (n_in + 1) * d * h
        shared_mm, shared_all = (mlp(m.moe_shared_experts * h, 1) if m.moe_shared_experts
                                 else (0, 0))
        moe_mm = expert_layer + shared_mm  # the router runs in fp32: autocast casts no copy
        moe_all = m.moe_experts * d + expert_layer + shared_all
    dense = layers - moe_layers
    # The largest block (FSDP's unit); a dense block's size when the stage has no MoE layer.
    block = max(attn + dense_all if dense or not moe_layers else 0,
                attn + moe_all if moe_layers else 0)
    matmul = dense * (attn_mm + dense_mm) + moe_layers * (attn_mm + moe_mm)
    blocks = dense * (attn + dense_all) + moe_layers * (attn + moe_all)
    root = 0
    head_matmul = 0
    if first:
        root += m.padded_vocab_size * d // tp + (m.max_seq_len * d if m.position == "learned" else 0)
    if last:
        root += norm
        head_matmul = m.padded_vocab_size * d // tp
        if not (m.tie_embeddings and first):
            root += head_matmul
    return StageParams(blocks + root, block, root, matmul + head_matmul, layers, head_matmul,
                       moe_layers * expert_layer, moe_layers)


def stage_layers(m: ModelConfig, layout: Layout) -> list[range]:
    """The layer indices of each pipeline stage, first to last (as tessel splits them:
    consecutive layers, stage s on pipeline rank s mod pp)."""
    return _stage_ranges(m.n_layers, layout.pp, layout.pp_virtual_stages,
                         layout.pp_layers_first, layout.pp_layers_last)


@functools.lru_cache(maxsize=4096)  # the search asks for the same splits thousands of times
def _stage_ranges(n_layers: int, pp: int, virtual: int, first: int, last: int) -> list[range]:
    n_stages = pp * virtual
    counts = stage_layer_counts(n_layers, n_stages, first, last, virtual)
    starts = [sum(counts[:s]) for s in range(n_stages + 1)]
    return [range(starts[s], starts[s + 1]) for s in range(n_stages)]


def rank_stages(layout: Layout, rank: int) -> list[int]:
    """The stage indices pipeline rank `rank` holds."""
    return [rank + v * layout.pp for v in range(layout.pp_virtual_stages)]


def rank_parameters(m: ModelConfig, layout: Layout, rank: int) -> StageParams:
    """Parameters of one tensor- and expert-parallel rank of pipeline rank `rank`, before
    data-parallel sharding."""
    ranges = stage_layers(m, layout)
    ids = rank_stages(layout, rank)
    return stage_parameters(m, sum(len(ranges[s]) for s in ids), 0 in ids,
                            len(ranges) - 1 in ids, layout.tp,
                            sum(moe_layer_count(m, ranges[s]) for s in ids), layout.ep)


def parameter_elements(m: ModelConfig, layout: Layout, lora: LoraConfig | None = None,
                       muon: bool = False) -> int:
    """Parameter elements held by all ranks together (= AdamW exp_avg elements), as the
    real run's local shards add up (FSDP's padding left out): each pipeline rank's dense
    weights once per tensor-parallel rank and data-parallel replica, its routed experts once
    per expert-parallel rank and replica (sharded, not copied, over their own group). With
    `lora`: the adapters' elements alone (what AdamW holds state for in a LoRA run). With
    `muon`: those of Muon's matrices alone, the blocks' matmul weights (its momentum
    buffers' elements)."""
    copies = layout.dp_replicate if fsdp_active(layout) else layout.dp * layout.cp
    total = 0
    for rank in range(layout.pp):
        p = rank_parameters(m, layout, rank)
        if lora is not None:
            total += adapter_parameters(m, lora, p.layers, p.moe_layers, layout.tp) * (
                layout.tp * copies)
            continue
        # With ep = 1 the routed experts are whole on every tp rank; ep > 1 splits them over
        # ep ranks borrowed from dp_shard x tp, and shards, not copies, them over the rest.
        expert_copies = layout.ep if layout.ep > 1 else layout.tp
        dense = p.matmul - p.head_matmul if muon else p.total
        total += ((dense - p.experts) * layout.tp + p.experts * expert_copies) * copies
    return total


def precision_regime(precision: str, layout: Layout) -> str:
    """How the trainer runs `precision` under `layout` (see probe.REGIMES)."""
    if precision == "bf16":
        return "bf16_params" if fsdp_active(layout) else "bf16"
    return precision


def fsdp_active(layout: Layout) -> bool:
    """The trainer shards with FSDP when zero >= 1 and there is more than one replica."""
    return layout.zero >= 1 and layout.dp * layout.cp > 1


def estimate_memory(
    m: ModelConfig, layout: Layout, seq_len: int, global_batch: int, precision: str,
    document_mask: bool = False, lora: LoraConfig | None = None, flex_attention: bool = False,
    optimizer: OptimizerSpec = ADAMW,
) -> Memory:
    """Memory of the busiest pipeline rank (`lora`: a LoRA run's, see rank_memory;
    `flex_attention`, `optimizer`: see memory_by_rank)."""
    ranks = memory_by_rank(m, layout, seq_len, global_batch, precision, document_mask, lora,
                           flex_attention, optimizer)
    return max(ranks, key=lambda mem: mem.total)


def memory_by_rank(
    m: ModelConfig, layout: Layout, seq_len: int, global_batch: int, precision: str,
    document_mask: bool = False, lora: LoraConfig | None = None, flex_attention: bool = False,
    optimizer: OptimizerSpec = ADAMW,
) -> list[Memory]:
    """Memory of each pipeline rank (every data-, context- and tensor-parallel rank of it
    alike). `flex_attention`: masks are FlexAttention block masks (what tessel uses on CUDA
    without attention dropout), so no dense (T_q, T_kv) mask is built or saved; False: SDPA
    with a dense boolean mask (CPU), as the probe measures. `optimizer`: its state's size
    (planner/optimizer.py)."""
    ranges = stage_layers(m, layout)
    micro_batches = global_batch // (layout.micro_batch * layout.dp)
    regime = precision_regime(precision, layout)
    dense = not flex_attention or m.dropout > 0
    context = (context_profile(m, regime, document_mask, layout.cp_mode, lora) if layout.cp > 1
               else None)
    acts = rank_profile(activation_profile(m, regime, document_mask, lora), context, layout.cp,
                        dense)
    out = []
    for rank in range(layout.pp):
        params = rank_parameters(m, layout, rank)
        stages = {s: stage_counts(m, layout, ranges[s]) for s in rank_stages(layout, rank)}
        mem = rank_memory(m, layout, seq_len, precision, params, stages, rank, acts,
                          micro_batches, document_mask, lora, dense, optimizer)
        mem.stage = rank
        out.append(mem)
    return out


def rank_memory(
    m: ModelConfig, layout: Layout, seq_len: int, precision: str, p: StageParams,
    stages: dict[int, tuple[int, int]], rank: int, acts: ActivationProfile, micro_batches: int,
    document_mask: bool = False, lora: LoraConfig | None = None, dense_mask: bool = True,
    optimizer_spec: OptimizerSpec = ADAMW,
) -> Memory:
    """Memory of pipeline rank `rank`, which holds `stages` (stage index -> (its layers, of
    which MoE layers)); `acts` as `rank_profile` gives it, `dense_mask` as it was given
    there. With `lora` only the adapters have gradients and AdamW state; the
    frozen base keeps its (sharded) weights and compute copies, its blocks' projections in
    lora.base_dtype; the gradients in flight to FSDP's reduce-scatter are the adapters';
    activations are what the model with the run's adapters saves (`acts` measured with
    them: `activation_profile(..., lora)`, the first block's as `acts.first`)."""
    n_stages = layout.pp * layout.pp_virtual_stages
    compute = 2 if precision in ("bf16", "fp16") else 4
    parameters, weights, gradients, optimizer, host, trains = _state(
        m, layout, seq_len, compute, p, acts, micro_batches, lora, optimizer_spec)
    saved_bytes, activations = _activations(
        m, layout, seq_len, compute, trains, stages, rank, acts, micro_batches, document_mask,
        dense_mask, n_stages - 1 in stages)
    communication = _communication(m, layout, seq_len, compute, trains, optimizer_spec)
    allocated = parameters + gradients + optimizer + activations + communication
    margin = CUDA_CONTEXT_BYTES + (NCCL_BYTES if layout.world > 1 else 0.0) + FRAGMENTATION * allocated
    return Memory(parameters, gradients, optimizer, activations, communication, margin,
                  saved=saved_bytes, host=host, weights=weights)


def _fsdp(layout: Layout) -> tuple[bool, bool]:
    """(FSDP2 runs, replicated data parallelism beside tp/pp: FSDP2 over a group of one)."""
    replicate = data_parallel_kind(layout.zero, layout.dp * layout.cp, layout.tp,
                                   layout.pp) == "replicate"
    return fsdp_active(layout) or replicate, replicate


def _state(m: ModelConfig, layout: Layout, seq_len: int, compute: int, p: StageParams,
           acts: ActivationProfile, micro_batches: int, lora: LoraConfig | None,
           optimizer_spec: OptimizerSpec) -> tuple[float, float, float, float, float, StageParams]:
    """(parameters with their compute copies, the stored weights alone, gradients, optimizer
    state, host bytes, the parameters that train): exact counts as tessel shards them."""
    fsdp, replicate = _fsdp(layout)
    shard = layout.dp_shard * layout.cp if fsdp_active(layout) else 1
    offload_params = layout.offload == "params" and fsdp
    offload_optimizer = layout.offload == "optimizer"
    # Routed experts are sharded over their own group (efsdp), the rest over dp_shard x cp;
    # FSDP pads the last shard up.
    expert_shard = layout.expert_dp_shard if fsdp_active(layout) else 1
    local = -(-(p.total - p.experts) // shard) + -(-p.experts // expert_shard)
    host = 0.0
    # Parameters: fp32 masters (sharded under FSDP) plus the copies compute uses.
    master = 0.0 if offload_params else MASTER_BYTES * local
    if fsdp and (layout.zero in (1, 2) or replicate):
        copies = compute * p.total  # gathered at forward, kept to the backward
    elif fsdp:
        copies = compute * (p.root + 2 * p.block)
    elif compute == 2:
        # Autocast's weight casts, saved for backward; checkpointed blocks (and a loss in
        # pieces, the head) make theirs again in backward.
        pieces = loss_pieces(layout.loss_chunks, layout.micro_batch * seq_len / layout.cp,
                             m.padded_vocab_size / layout.tp)
        head_cast = p.head_matmul if pieces == 1 else 0
        cast = head_cast + (p.matmul - p.head_matmul) * unchecked_share(layout, m.n_layers)
        copies = acts.weight_casts_per_param * cast
    else:
        copies = 0.0
    parameters = master + copies

    trained, trained_local = p.total, local
    if lora is not None:
        trained = adapter_parameters(m, lora, p.layers, p.moe_layers, layout.tp)
        trained_local = -(-trained // shard)
        # The blocks' projections: lora.base_dtype (routed experts stay float32).
        block_mm = p.matmul - p.head_matmul - p.experts
        base_bytes = MASTER_BYTES * local - (
            MASTER_BYTES - base_block_matmul_bytes(lora)) * -(-block_mm // shard)
        master = (0.0 if offload_params else base_bytes) + MASTER_BYTES * trained_local
        if not fsdp and compute == 2:
            copies = acts.weight_casts_per_param * cast_elements(
                lora, block_mm, p.experts, p.head_matmul, trained,
                layout.activation_checkpointing)
        parameters = master + copies
        p = replace(p, total=trained, block=trained // max(p.layers, 1))  # what trains
        local = trained_local

    # Gradients: fp32; sharded under FSDP, with ZeRO-1's unsharded accumulation buffer.
    if not fsdp:
        gradients = GRAD_BYTES * p.total
    else:
        gradients = 0.0 if offload_params else GRAD_BYTES * local
        if (layout.zero == 1 or replicate) and micro_batches > 1:
            gradients += GRAD_BYTES * p.total  # accumulated unsharded until the last micro-batch
    # Muon's matrices: the blocks' matmul weights (routed experts sharded over their group)
    muon_local = (-(-(p.matmul - p.head_matmul - p.experts) // shard)
                  + -(-p.experts // expert_shard)) if optimizer_spec.muon else 0
    optimizer = (0.0 if (offload_params or offload_optimizer)
                 else optimizer_spec.state_bytes(local, muon_local))
    if offload_params:
        host = (MASTER_BYTES + GRAD_BYTES + ADAM_BYTES) * local
    elif offload_optimizer:
        host = ADAM_BYTES * local + (MASTER_BYTES + GRAD_BYTES) * local  # + pinned staging
    return parameters, master, gradients, optimizer, host, p


def _activations(m: ModelConfig, layout: Layout, seq_len: int, compute: int, p: StageParams,
                 stages: dict[int, tuple[int, int, int, int]], rank: int,
                 acts: ActivationProfile, micro_batches: int, document_mask: bool,
                 dense_mask: bool, last: bool) -> tuple[float, float]:
    """(bytes saved for backward by the micro-batches in flight, those plus the largest
    transient: a block recomputed, or the loss's logits)."""
    n_stages = layout.pp * layout.pp_virtual_stages
    tokens = layout.micro_batch * seq_len / layout.cp
    tp, sp = layout.tp, layout.sequence_parallel
    ac, every = layout.activation_checkpointing, layout.activation_checkpointing_every
    per_position = acts.per_position * seq_len
    moe_block = acts.moe_block or acts.block
    kept_layer, kept_moe = layer_bytes(acts, ac, tp, sp, seq_len)
    per_layer, per_moe_layer = layer_bytes(acts, "none", tp, sp, seq_len)
    # per MoE layer and micro-batch, whatever its tokens
    router_copy = acts.moe_router_copy * unchecked_share(layout, m.n_layers)
    first_layer = 0.0  # what the model's first block keeps beyond a later one (LoRA: < 0)
    if acts.first is not None:
        moe_first = bool(m.moe_experts) and m.is_moe_layer(0)
        first_ac = ac if 0 in checkpointed_blocks(m.n_layers, every) else "none"
        first_layer = (layer_bytes(acts.first, first_ac, tp, sp, seq_len)[moe_first]
                       - layer_bytes(acts, first_ac, tp, sp, seq_len)[moe_first])
    # A chunked loss keeps no logits: each piece makes its own again in backward.
    pieces = loss_pieces(layout.loss_chunks, tokens, m.padded_vocab_size / tp)
    head = head_bytes(acts, pieces)
    # With documents (and under context parallelism) every block is handed the same mask
    # and, with RoPE, each token's rotation (head_dim float32s): one per micro-batch, kept
    # until its backward whatever the checkpointing.
    shared = shared_per_token(m, layout, seq_len, document_mask, dense_mask, compute)
    layers = p.layers
    chunk = {}  # bytes one micro-batch saves in each stage of this rank
    for s, (n, n_moe, checked, checked_moe) in stages.items():
        chunk[s] = (per_layer * (n - n_moe - checked) + kept_layer * checked
                    + per_moe_layer * (n_moe - checked_moe) + kept_moe * checked_moe)
        chunk[s] += acts.embedding.per_token(tp, sp) if s == 0 else 0.0
        chunk[s] += first_layer if s == 0 and n else 0.0
        chunk[s] += shared if n else 0.0
        chunk[s] += head.per_token(tp, sp) if s == n_stages - 1 else 0.0
        chunk[s] = chunk[s] * tokens + router_copy * n_moe
    order = pipeline_order(layout, rank, micro_batches)
    if order is not None and layout.pp_schedule != "zero-bubble":
        saved_bytes = peak_in_flight(order, chunk)
    else:
        saved_bytes = sum(chunk.values()) * in_flight(layout, rank, micro_batches)
    activations = saved_bytes
    transient = 0.0
    if ac != "none" and layers:
        # The block being recomputed holds its full activations during its backward.
        largest = acts.block.per_token(tp, sp) if layers > p.moe_layers else 0.0
        if p.moe_layers:
            largest = max(largest, moe_block.per_token(tp, sp))
        transient = (largest + per_position) * tokens
    if last:
        # The loss's logits: all at once, or one piece's (kept and made) at a time.
        vocab = m.padded_vocab_size / tp
        piece = (compute + 4 * HEAD_TRANSIENT_FP32_COPIES) * vocab
        if pieces > 1:
            piece += acts.head_vocab.per_token(tp, sp)
        transient = max(transient, piece * tokens / pieces)
    activations += transient
    return saved_bytes, activations


def _communication(m: ModelConfig, layout: Layout, seq_len: int, compute: int, p: StageParams,
                   optimizer_spec: OptimizerSpec) -> float:
    """Buffers that live in the allocator for communication."""
    fsdp, _ = _fsdp(layout)
    offload_params = layout.offload == "params" and fsdp
    tokens = layout.micro_batch * seq_len / layout.cp
    tp = layout.tp
    communication = 0.0
    if fsdp and not offload_params:
        # A block's unsharded gradients in flight to the reduce-scatter (compute dtype and
        # the fp32 copy it reduces), two blocks deep.
        communication += 2 * (compute + GRAD_BYTES) * p.block
    elif fsdp:
        communication += 2 * (compute + GRAD_BYTES) * p.block + compute * 2 * p.block
    if layout.pp > 1:  # send and receive buffers of one micro-batch's hidden state, both ways
        communication += 4 * tokens * m.d_model * compute
    if tp > 1:  # a gathered sub-layer input in flight
        communication += 2 * tokens * m.d_model * compute
    communication += context_buffers(m, layout, tokens, compute)
    if layout.ep > 1 and p.moe_layers:  # one MoE layer's dispatch (or combine) send + receive
        communication += 2 * tokens * m.moe_top_k * m.d_model * compute
    if optimizer_spec.muon and p.layers:  # a whole matrix and its result, in the step
        communication += muon_transient_bytes(m, p.moe_layers > 0)
    return communication


