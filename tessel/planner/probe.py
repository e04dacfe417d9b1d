"""Activation memory from the tensors tessel's own model saves for backward.

Rather than a formula that drifts from the code, the planner runs the real model (one block,
embeddings, head and loss) once on a small probe shape on the CPU, in the precision regime
of the run, and records every tensor autograd saves (saved-tensor hooks, `record.py`), once
per storage, together with the module that saved it. Each is then scaled to the real model by its width
per token, and split by what tensor parallelism does to it, which follows from where it was
saved:

- `replicated`: inputs of the column-parallel matmuls (wq/wk/wv, w1/w3, the head), i.e. the
  gathered sequence under any tp; token ids;
- `sequence`: the residual stream around the norms and dropout: / tp with sequence
  parallelism, full without;
- `sharded`: heads, key/values, attention statistics, MLP hidden units, the inputs of the
  row-parallel matmuls and the vocabulary-sharded logits: / tp.

Probe widths are chosen pairwise distinct (d_model 60, key/value width 20, ffn 104, vocab
88, 6 heads, 2 key/value heads, 8 positions; with model.head_dim of its own, query width 84
and key/value width 28), so a tensor's width per token says what it scales with: d_model,
query or key/value width, ffn_hidden, vocabulary, heads, key/value heads (QK-norm's
statistics), positions (masks), heads x positions (attention probabilities of the math
kernel). A saved tensor of any other width stops the
planner with an error rather than a guess.

Context parallelism (`context_profile`): the same probe runs as one rank of cp 2, its
attention modules exchanging through `ShapeExchange`, which returns tensors of the shapes
tessel.parallel.context's exchange returns (no process group: shapes are all that saving
depends on). The rank holds 8 of the 16 positions; a saved tensor's width per local token
then also says how it grows with cp: twice the query or key/value width is the kernel's keys
and values over the whole sequence (all-gather mode: times cp), 16 per token is a mask row
over the whole sequence (times seq_len), 32 a Ulysses rank's whole-sequence mask (times
seq_len x cp); Ulysses' head-sharded whole-sequence tensors have the widths of local ones.

LoRA (`activation_profile(..., lora)`): the probe's block carries the run's adapters
(targets, dropout, lora.base_dtype; `tessel.planner.lora.probe_adapters`) at rank 5, a width
of its own: what an adapter saves at width rank (A x, for B's gradient) is scaled to
lora.rank and held whole by every tensor-parallel rank (A's input is the gathered sequence,
or its output is all-reduced); the rest by where it was saved, as above. Frozen matmuls keep
no input for their weight's gradient, frozen norms none for theirs, the frozen head and
embeddings nothing of their own. Because the embeddings are frozen, the first block's
input needs no gradient and what runs before its first adapter keeps nothing: it is probed
as it is (`first`), and the block of every later one (and of every later pipeline stage,
whose input needs a gradient) with an input that needs one. Measured on
tests/distributed/test_layouts.py's LoRA layouts (4 layers, rank 4 on all seven
projections, fp32), a rank keeps 8-15% less than the same layout trained in full, but under
selective checkpointing 66% more (it keeps the output of every matmul, B's included).

Selective activation checkpointing keeps the outputs of the operators its policy's
`tessel.parallel.checkpointing.KeepRule` keeps (recorded for each policy by a dispatch mode
during the same probe); full checkpointing keeps each block's input. What the per-op policy
keeps of tensor parallelism's collectives (the probe runs without them) is counted from the
shapes: two gathered sub-layer inputs and two reduced projection outputs per block.

Mixture-of-Experts layers are probed the same way, by a second 1-block model whose block is
an MoE layer, with widths of its own that are pairwise distinct (d_model 64, 7 experts, top 3,
expert hidden 24, one shared expert of 24; per token: 64, 7 router logits, 3 chosen slots,
3 x 64 permuted copies, 3 x 24 expert hidden units, 24 shared hidden units, 1). Its MLP's
saved tensors replace the dense MLP's in an MoE block. d_model 64 (not 60) because the
grouped matmul needs 16-byte rows in bf16, and the per-expert loop it would fall back to
saves per-expert slices that do not scale per token. MoE layers under tensor parallelism run
with sequence parallelism, each rank on its own part of the sequence, so everything an MoE
layer saves counts as `sequence` (divided by tp).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from tessel.config import LoraConfig, ModelConfig
from tessel.planner.exchange import ShapeExchange
from tessel.planner.lora import PROBE_RANK
from tessel.planner.record import BATCH, POSITIONS, Saved, run_probe
from tessel.planner.saved import ActivationProfile, ContextProfile, Kept, SavedBytes

# Probe shape. Widths per token, all distinct: see the module docstring.
_B, _T = BATCH, POSITIONS
_CP = 2  # the context-parallel probe: one rank of 2, holding _T of _CP * _T positions
_D, _HEADS, _FFN, _VOCAB = 60, 6, 104, 88
_HD = _D // _HEADS
_OWN_HD = 14  # a model with its own head width (model.head_dim): queries 84, key/values 28

# The MoE probe's widths per token: see the module docstring.
_MOE_D, _MOE_HEADS, _MOE_E, _MOE_K, _MOE_H = 64, 8, 7, 3, 24
_FFN_MODULE = "feed_forward"  # a block's MLP, dense or MoE (and its shared experts)

# Where a tensor was saved -> how tensor parallelism splits it.
_COLUMN_INPUTS = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1",
                  "feed_forward.w3", "output")
_ROW_LINEARS = ("attention.wo", "feed_forward.w2")
_SEQUENCE_MODULES = ("attention_norm", "ffn_norm", "post_attention_norm", "post_ffn_norm", "norm",
                     "block", "resid_dropout", "emb_dropout")
_SHARDED_MODULES = ("attention", "attention.q_norm", "attention.k_norm", "feed_forward", "loss")

# Regimes: how the trainer runs a precision. FSDP (zero >= 1) gathers bf16 parameters, so
# its residual stream is bf16; DDP and one process keep fp32 parameters under autocast.
REGIMES = ("fp32", "bf16", "bf16_params", "fp16")


def _probe_config(m: ModelConfig, dropout: float) -> ModelConfig:
    """A dense 1-block model (an MoE model's dense layers and everything outside its MLPs)."""
    kv = _HEADS if m.n_kv_heads == m.n_heads else 2
    head_dim = _HD if m.q_dim == m.d_model else _OWN_HD
    return m.model_copy(update={
        "preset": None, "d_model": _D, "n_heads": _HEADS, "n_kv_heads": kv, "ffn_hidden": _FFN,
        "head_dim": head_dim,
        "n_layers": 1, "vocab_size": _VOCAB, "vocab_pad_to": 1, "max_seq_len": _CP * _T,
        "dropout": dropout, "moe_experts": 0, "moe_shared_experts": 0,
    })  # unpadded: the vocabulary width is _VOCAB, scaled to the real padded_vocab_size


def _moe_probe_config(m: ModelConfig, dropout: float) -> ModelConfig:
    """A 1-block model whose block is an MoE layer like `m`'s, at the MoE probe widths."""
    return m.model_copy(update={
        "preset": None, "d_model": _MOE_D, "n_heads": _MOE_HEADS, "n_kv_heads": _MOE_HEADS,
        "ffn_hidden": _FFN, "n_layers": 1, "vocab_size": _VOCAB, "vocab_pad_to": 1,
        "max_seq_len": _T, "dropout": dropout, "moe_experts": _MOE_E, "moe_top_k": _MOE_K,
        "moe_shared_experts": 1 if m.moe_shared_experts else 0, "moe_ffn_hidden": _MOE_H,
        "moe_first_dense_layers": 0, "moe_every": 1,
    })


def _scale(rec: Saved, m: ModelConfig, probe: ModelConfig, mode: str | None = None,
           rank: int = 0) -> tuple[str, float]:
    """(kind, bytes per token of the real model): kind is the width class; "const" for the
    few small tensors without a batch dimension (positions), which do not grow with it.
    `mode`: the record is from the context-parallel probe in that cp mode (per local token;
    "g": per cp, "t"/"ht": per position of the whole sequence, "tc": per position and cp).
    `rank`: the run's LoRA rank, when the probe had adapters ("r": at width PROBE_RANK)."""
    n = 1
    for s in rec.shape:
        n *= s
    if n % (_B * _T) and (not rec.shape or rec.shape[0] != _B):
        return "const", 0.0
    width = n // (_B * _T) if n % (_B * _T) == 0 else None
    kv_probe = probe.n_kv_heads * probe.head_dim
    kv_real = m.n_kv_heads * m.head_dim
    whole = _T if mode is None else _CP * _T  # positions of the whole sequence
    widths = {
        _D: ("d", m.d_model / _D), _FFN: ("f", m.ffn_hidden / _FFN),
        _VOCAB: ("v", m.padded_vocab_size / _VOCAB), _HEADS: ("h", m.n_heads / _HEADS),
        1: ("1", 1.0), whole: ("t", None), _HEADS * whole: ("ht", None),
    }
    if probe.q_dim != _D:  # queries and attention output of a model with its own head width
        widths[probe.q_dim] = ("q", m.q_dim / probe.q_dim)
    if kv_probe != probe.q_dim:
        widths[kv_probe] = ("kv", kv_real / kv_probe)
    if probe.n_kv_heads != _HEADS:  # QK-norm's statistics per key head
        widths[probe.n_kv_heads] = ("kvh", m.n_kv_heads / probe.n_kv_heads)
    if rank:  # an adapter's A x
        widths[PROBE_RANK] = ("r", rank / PROBE_RANK)
    if mode == "allgather":  # keys/values of the whole sequence, as the kernel takes them
        widths[_CP * kv_probe] = ("g", kv_real / kv_probe)
        widths[_CP * probe.q_dim] = ("g", m.q_dim / probe.q_dim)
    elif mode == "ulysses":  # a mask over the whole sequence for every query row
        widths[_CP * whole] = ("tc", None)
    if width not in widths:
        raise RuntimeError(
            f"activation probe: a tensor of shape {rec.shape} saved in {rec.where!r} has a "
            "width the planner does not know; update tessel/planner/probe.py"
        )
    kind, factor = widths[width]
    per_token = rec.nbytes / (_B * _T)
    if kind == "t":  # bytes per token per position: scaled by seq_len later
        return kind, per_token / whole
    if kind == "tc":
        return kind, per_token / (whole * _CP)
    if kind == "ht":
        return kind, per_token / whole * m.n_heads / _HEADS
    if kind == "g":
        return kind, per_token * factor / _CP
    return kind, per_token * factor


@dataclass
class _Parts:
    """Bytes per token of a probe's saved tensors, by where they are and how they scale."""

    block: SavedBytes
    embedding: SavedBytes
    head: SavedBytes
    per_position: float = 0.0
    mask_per_position: float = 0.0
    gathered: SavedBytes = SavedBytes()
    per_position_cp: float = 0.0
    head_vocab: SavedBytes = SavedBytes()
    head_input: SavedBytes = SavedBytes()


def _split(records: list[Saved], m: ModelConfig, probe: ModelConfig, selective: bool = False,
           mode: str | None = None, rank: int = 0) -> _Parts:
    """The records summed by part and tensor-parallel class (`mode`, `rank`: see _scale)."""
    parts = {p: [0.0, 0.0, 0.0] for p in ("block", "embedding", "head", "gathered",
                                          "head_vocab", "head_input")}
    positions = {"t": 0.0, "ht": 0.0, "tc": 0.0}
    for rec in records:
        kind, size = _scale(rec, m, probe, mode, rank)
        where = rec.where
        part = ("embedding" if where in ("tok_embeddings", "pos_embeddings", "emb_dropout")
                else "head" if where in ("norm", "output", "loss") else "block")
        if kind == "const":
            continue
        if kind in positions:
            positions[kind] += size
            continue
        if kind == "g":
            part = "gathered"
        if where == "loss" and kind == "1":
            cls = 0  # the targets: every tensor-parallel rank holds them all
        elif kind == "r":
            cls = 0  # A x of the whole sequence: A's input gathered, or its output all-reduced
        elif where in _COLUMN_INPUTS or where in ("tok_embeddings", "pos_embeddings"):
            cls = 2 if (selective and where != "output") else 0  # selective: the matmul outputs
        elif where in _ROW_LINEARS:
            cls = 0 if selective else 2  # outputs: partial sums, full size; inputs: local
        elif where in _SEQUENCE_MODULES:
            cls = 1
        elif where in _SHARDED_MODULES:
            cls = 2
        else:
            raise RuntimeError(f"activation probe: a tensor saved in {where!r} is not classified")
        parts[part][cls] += size
        if part == "head" and kind == "v":
            parts["head_vocab"][cls] += size
        elif where == "output":  # the output projection's input (or its autocast copy)
            parts["head_input"][cls] += size
    b = {k: SavedBytes(*v) for k, v in parts.items()}
    return _Parts(b["block"], b["embedding"], b["head"], positions["t"] + positions["ht"],
                  positions["t"], b["gathered"], positions["tc"], b["head_vocab"],
                  b["head_input"])


def activation_profile(m: ModelConfig, regime: str, document_mask: bool = False,
                       lora: LoraConfig | None = None) -> ActivationProfile:
    """Saved bytes per token of model `m` in `regime` (see REGIMES); with `lora`, of the
    model with the run's adapters (`first`: its first block's, see ActivationProfile)."""
    if regime not in REGIMES:
        raise ValueError(f"unknown precision regime {regime!r}")
    return _profile(m.model_dump_json(), regime, document_mask, _json(lora))


def _json(lora: LoraConfig | None) -> str | None:
    return lora.model_dump_json() if lora is not None and lora.enabled else None


@functools.lru_cache(maxsize=128)
def _profile(model_json: str, regime: str, document_mask: bool,
             lora_json: str | None = None) -> ActivationProfile:
    m = ModelConfig.model_validate_json(model_json)
    if lora_json is None:
        return _measure(m, regime, document_mask)
    # A LoRA model's embeddings are frozen: the first block's input needs no gradient, so
    # what runs before its first adapter keeps nothing. Every later block's does.
    lora = LoraConfig.model_validate_json(lora_json)
    return replace(_measure(m, regime, document_mask, lora, later_block=True),
                   first=_measure(m, regime, document_mask, lora))


def _measure(m: ModelConfig, regime: str, document_mask: bool, lora: LoraConfig | None = None,
             later_block: bool = False) -> ActivationProfile:
    probe = _probe_config(m, m.dropout)
    rank = lora.rank if lora is not None else 0
    saved, kept_outputs, casts = run_probe(probe, regime, document_mask, lora=lora,
                                           later_block=later_block)
    parts = _split(saved, m, probe, rank=rank)
    block = parts.block
    block_input = _block_input(m, regime)
    kept = _kept(kept_outputs, m, probe, block_input, rank=rank)
    cast_elements = sum(c.shape[0] * c.shape[1] for c in casts)
    cast_bytes = sum(c.nbytes for c in casts)
    moe_block, router_copy = None, 0.0
    if m.moe_experts:
        moe_block, kept, router_copy = _moe_profile(
            m, regime, document_mask, block, kept, [r for r in saved if _in_mlp(r)],
            {p: [r for r in out if _in_mlp(r)] for p, out in kept_outputs.items()}, probe, lora)
    gathered, reduced = _collective_outputs(m, regime)
    return ActivationProfile(
        block=block, kept=kept, block_input=block_input,
        per_position=parts.per_position, mask_per_position=parts.mask_per_position,
        embedding=parts.embedding, head=parts.head, head_vocab=parts.head_vocab,
        head_input=parts.head_input,
        weight_casts_per_param=cast_bytes / cast_elements if cast_elements else 0.0,
        moe_block=moe_block, tp_gathered=gathered, tp_reduced=reduced,
        moe_router_copy=router_copy,
    )


def _kept(outputs: dict[str, list[Saved]], m: ModelConfig, probe: ModelConfig,
          block_input: SavedBytes, mode: str | None = None, rank: int = 0) -> dict[str, Kept]:
    """What a block keeps under each selective policy: its kept outputs and its input."""
    kept = {}
    for policy, records in outputs.items():
        parts = _split(_block_outputs(records), m, probe, selective=True, mode=mode, rank=rank)
        kept[policy] = Kept(parts.block + block_input, parts.per_position + parts.per_position_cp,
                            gathered=parts.gathered)
    return kept


def _collective_outputs(m: ModelConfig, regime: str) -> tuple[float, float]:
    """Per token and block, (gathered, reduced) bytes the per-op policy keeps of tensor
    parallelism's collectives: the two gathered sub-layer inputs (sequence parallelism; in the
    residual stream's dtype) and the two reduced projection outputs (in the compute dtype)."""
    residual = 2 if regime == "bf16_params" else 4
    compute = 4 if regime == "fp32" else 2
    return 2 * residual * m.d_model, 2 * compute * m.d_model


def _block_input(m: ModelConfig, regime: str) -> SavedBytes:
    """What a block saves of its own input: the first norm's input, in the residual dtype."""
    return SavedBytes(sequence=(2 if regime == "bf16_params" else 4) * m.d_model)


def _block_outputs(selective_outputs: list[Saved]) -> list[Saved]:
    """The blocks' kept operator outputs (the head's are not checkpointed)."""
    return [r for r in selective_outputs
            if r.where not in ("norm", "output", "loss", "tok_embeddings")]


def context_profile(m: ModelConfig, regime: str, document_mask: bool, mode: str,
                    lora: LoraConfig | None = None) -> ContextProfile:
    """Saved bytes per local token of a context-parallel rank of model `m` in cp mode `mode`
    (dense layers; an MoE layer's MLP is as without cp, on the rank's own tokens); `lora`:
    as in activation_profile."""
    if regime not in REGIMES:
        raise ValueError(f"unknown precision regime {regime!r}")
    return _context(m.model_dump_json(), regime, document_mask, mode, _json(lora))


@functools.lru_cache(maxsize=128)
def _context(model_json: str, regime: str, document_mask: bool, mode: str,
             lora_json: str | None = None) -> ContextProfile:
    m = ModelConfig.model_validate_json(model_json)
    if lora_json is None:
        return _measure_context(m, regime, document_mask, mode)
    lora = LoraConfig.model_validate_json(lora_json)
    return replace(_measure_context(m, regime, document_mask, mode, lora, later_block=True),
                   first=_measure_context(m, regime, document_mask, mode, lora))


def _measure_context(m: ModelConfig, regime: str, document_mask: bool, mode: str,
                     lora: LoraConfig | None = None, later_block: bool = False) -> ContextProfile:
    probe = _probe_config(m, m.dropout)
    rank = lora.rank if lora is not None else 0
    saved, kept_outputs, _ = run_probe(probe, regime, document_mask,
                                       ShapeExchange(mode, _CP), lora, later_block)
    parts = _split(saved, m, probe, mode=mode, rank=rank)
    return ContextProfile(
        block=parts.block, gathered=parts.gathered, per_position=parts.per_position,
        mask_per_position=parts.mask_per_position, per_position_cp=parts.per_position_cp,
        kept=_kept(kept_outputs, m, probe, _block_input(m, regime), mode, rank),
        embedding=parts.embedding, head=parts.head, head_vocab=parts.head_vocab,
        head_input=parts.head_input)


def _in_mlp(rec: Saved) -> bool:
    return rec.where == _FFN_MODULE or rec.where.startswith(_FFN_MODULE + ".")


def _moe_profile(m: ModelConfig, regime: str, document_mask: bool, block: SavedBytes,
                 kept: dict[str, Kept], dense_mlp: list[Saved],
                 dense_mlp_kept: dict[str, list[Saved]], probe: ModelConfig,
                 lora: LoraConfig | None = None
                 ) -> tuple[SavedBytes, dict[str, Kept], float]:
    """An MoE block: the dense block with its MLP's saved tensors replaced by an MoE layer's
    (measured on the MoE probe), without and under each selective policy (`kept`, returned
    with each policy's moe_block); and the router's per-micro-batch weight copy. With `lora`
    the MoE layer is frozen (adapters on its attention only) and its input needs a gradient
    (the attention's adapters see to it)."""
    saved, moe_kept, casts = run_probe(_moe_probe_config(m, m.dropout), regime, document_mask,
                                       lora=lora, later_block=lora is not None)
    rank = lora.rank if lora is not None else 0
    mlp = _moe_bytes([r for r in saved if _in_mlp(r)], m)
    router = ((_MOE_E, _MOE_D), (_MOE_D, _MOE_E))  # saved transposed by the matmul
    router_copy = sum(c.nbytes for c in casts if c.shape in router and c.where == _FFN_MODULE)
    with_moe = {}
    for policy, k in kept.items():
        dense = _split(dense_mlp_kept[policy], m, probe, selective=True, rank=rank).block
        moe = _moe_bytes([r for r in moe_kept[policy] if _in_mlp(r)], m)
        with_moe[policy] = replace(k, moe_block=k.block - dense + moe)
    return (block - _split(dense_mlp, m, probe, rank=rank).block + mlp, with_moe,
            router_copy * m.moe_experts * m.d_model / (_MOE_E * _MOE_D))


def _moe_bytes(records: list[Saved], m: ModelConfig) -> SavedBytes:
    """Bytes per token of the real model's MoE layer from the MoE probe's saved tensors,
    each scaled by what its width per token is (see the module docstring)."""
    assert m.moe_ffn_hidden is not None
    k, h = m.moe_top_k, m.moe_ffn_hidden
    widths = {_MOE_D: m.d_model / _MOE_D, _MOE_E: m.moe_experts / _MOE_E, _MOE_K: k / _MOE_K,
              _MOE_K * _MOE_D: k * m.d_model / (_MOE_K * _MOE_D), _MOE_H: m.moe_shared_experts * h / _MOE_H,
              _MOE_K * _MOE_H: k * h / (_MOE_K * _MOE_H), 1: 1.0}
    total = 0.0
    for rec in records:
        n = 1
        for s in rec.shape:
            n *= s
        if n % (_B * _T):
            continue  # per-expert counts and offsets: no token dimension
        width = n // (_B * _T)
        if width not in widths:
            raise RuntimeError(
                f"activation probe: a tensor of shape {rec.shape} saved in the MoE layer "
                f"({rec.where!r}) has a width the planner does not know; update "
                "tessel/planner/probe.py"
            )
        total += rec.nbytes / (_B * _T) * widths[width]
    return SavedBytes(sequence=total)  # each tp rank routes its own part of the sequence
