"""Activation memory from the tensors tessel's own model saves for backward.

Rather than a formula that drifts from the code, the planner runs the real model (one block,
embeddings, head and loss) once on a small probe shape on the CPU, in the precision regime
of the run, and records every tensor autograd saves (saved-tensor hooks), once per storage,
together with the module that saved it. Each is then scaled to the real model by its width
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

Selective activation checkpointing keeps the outputs of the operators in
`tessel.parallel.apply.SAVE_OPS` (recorded by a dispatch mode during the same probe); full
checkpointing keeps each block's input.

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

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tessel.config import ModelConfig
from tessel.models.loss import token_loss_sum
from tessel.models.transformer import Transformer
from tessel.parallel.apply import SAVE_OPS
from tessel.parallel.context import chunk_positions
from tessel.planner.exchange import ShapeExchange
from tessel.planner.saved import ActivationProfile, ContextProfile, SavedBytes

# Probe shape. Widths per token, all distinct: see the module docstring.
_B, _T = 2, 8
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
_SEQUENCE_MODULES = ("attention_norm", "ffn_norm", "norm", "block", "resid_dropout", "emb_dropout")
_SHARDED_MODULES = ("attention", "attention.q_norm", "attention.k_norm", "feed_forward", "loss")

# Regimes: how the trainer runs a precision. FSDP (zero >= 1) gathers bf16 parameters, so
# its residual stream is bf16; DDP and one process keep fp32 parameters under autocast.
REGIMES = ("fp32", "bf16", "bf16_params", "fp16")


class _ModuleStack:
    """The qualified name of the module running now, from forward hooks."""

    def __init__(self, model: nn.Module):
        self.stack = ["loss"]  # outside every module: the loss
        self.handles = []
        for name, module in model.named_modules():
            if not name:
                continue
            self.handles.append(module.register_forward_pre_hook(self._enter(name)))
            self.handles.append(module.register_forward_hook(self._leave))

    def _enter(self, name: str):  # noqa: ANN202
        def hook(_module: nn.Module, _args: tuple) -> None:
            self.stack.append(name)
        return hook

    def _leave(self, _module: nn.Module, _args: tuple, _out: object) -> None:
        self.stack.pop()

    @property
    def current(self) -> str:
        return self.stack[-1]

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _where(qualified: str) -> str:
    """'layers.0.attention.wq' -> 'attention.wq'; 'layers.0' -> 'block'; 'norm' -> 'norm'."""
    parts = qualified.split(".")
    if parts[0] == "layers":
        rest = ".".join(parts[2:])
        return rest or "block"
    return qualified


class _OutputRecorder(TorchDispatchMode):
    """Records the outputs of the operators selective checkpointing keeps."""

    def __init__(self, modules: _ModuleStack):
        super().__init__()
        self.modules = modules
        self.outputs: list[tuple[str, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if func in SAVE_OPS:
            for t in out if isinstance(out, tuple) else (out,):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    self.outputs.append((self.modules.current, t))
        return out


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


@contextlib.contextmanager
def _autocast(regime: str) -> Iterator[None]:
    if regime in ("bf16", "bf16_params"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yield
    elif regime == "fp16":
        with torch.autocast("cpu", dtype=torch.float16):
            yield
    else:
        yield


@dataclass
class _Saved:
    where: str
    shape: tuple[int, ...]
    nbytes: int


def _run_probe(probe: ModelConfig, regime: str, document_mask: bool,
               exchange: ShapeExchange | None = None
               ) -> tuple[list[_Saved], list[_Saved], list[_Saved]]:
    """(saved tensors, selective-checkpointing outputs, weight casts) of one forward of a
    1-block model plus its loss, each storage once; with `exchange`, of context-parallel
    rank 0 of exchange.size."""
    torch.manual_seed(0)
    model = Transformer(probe)
    whole, positions = _T, None
    if exchange is not None:
        whole = _T * exchange.size
        positions = chunk_positions(whole, exchange.size, 0, True).expand(_B, -1)
        model.context_parallel = exchange
        for block in model.layers.values():
            block.attention.sequence = exchange
    model.train()
    if regime == "bf16_params":  # FSDP's gathered parameters are bf16
        model.to(torch.bfloat16)
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    param_shapes = {tuple(p.shape) for p in model.parameters()}
    modules = _ModuleStack(model)
    records: dict[int, _Saved] = {}
    casts: dict[int, _Saved] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in own or storage.nbytes() == 0:
            return t
        rec = _Saved(_where(modules.current), tuple(t.shape), storage.nbytes())
        shape = tuple(t.shape)
        if ((t.dim() == 2 and t.shape[0] != _B * _T
             and (shape in param_shapes or shape[::-1] in param_shapes))
                or (t.dim() == 3 and shape in param_shapes)):  # 3-D: grouped expert weights
            casts.setdefault(ptr, rec)  # a weight's low-precision (or fp32 router) copy
        elif ptr not in records or rec.nbytes > records[ptr].nbytes:
            records[ptr] = rec
        return t

    tokens = torch.randint(0, probe.vocab_size, (_B, _T))
    targets = torch.randint(0, probe.vocab_size, (_B, _T))
    docs = (torch.tensor([[0] * (whole // 2) + [1] * (whole - whole // 2)] * _B)
            if document_mask else None)
    recorder = _OutputRecorder(modules)
    # What the model hands every block besides the hidden state (the document mask and the
    # per-document RoPE table): built once per forward and shared by all blocks, so not a
    # block's own activation (planner/memory.py counts it once per micro-batch).
    shared: set[int] = set()

    def block_inputs(_module: torch.nn.Module, args: tuple) -> None:
        shared.update(a.untyped_storage().data_ptr() for a in args[1:]
                      if isinstance(a, torch.Tensor) and a is not model.rope_freqs)

    hooks = [b.register_forward_pre_hook(block_inputs) for b in model.layers.values()]
    try:
        with _autocast(regime), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with recorder:
                logits = model(tokens, docs, positions)
            loss = token_loss_sum(logits, targets)
    finally:
        modules.close()
        for hook in hooks:
            hook.remove()
    del loss
    saved = [r for p, r in records.items() if p not in shared]
    selective: dict[int, _Saved] = {}
    for where, t in recorder.outputs:
        ptr = t.untyped_storage().data_ptr()
        selective.setdefault(ptr, _Saved(_where(where), tuple(t.shape), t.untyped_storage().nbytes()))
    return saved, list(selective.values()), list(casts.values())


def _scale(rec: _Saved, m: ModelConfig, probe: ModelConfig, mode: str | None = None
           ) -> tuple[str, float]:
    """(kind, bytes per token of the real model): kind is the width class; "const" for the
    few small tensors without a batch dimension (positions), which do not grow with it.
    `mode`: the record is from the context-parallel probe in that cp mode (per local token;
    "g": per cp, "t"/"ht": per position of the whole sequence, "tc": per position and cp)."""
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


def _split(records: list[_Saved], m: ModelConfig, probe: ModelConfig, selective: bool = False,
           mode: str | None = None) -> _Parts:
    """The records summed by part and tensor-parallel class (`mode`: see _scale)."""
    parts = {p: [0.0, 0.0, 0.0] for p in ("block", "embedding", "head", "gathered")}
    positions = {"t": 0.0, "ht": 0.0, "tc": 0.0}
    for rec in records:
        kind, size = _scale(rec, m, probe, mode)
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
    b = {k: SavedBytes(*v) for k, v in parts.items()}
    return _Parts(b["block"], b["embedding"], b["head"], positions["t"] + positions["ht"],
                  positions["t"], b["gathered"], positions["tc"])


def activation_profile(m: ModelConfig, regime: str, document_mask: bool = False) -> ActivationProfile:
    """Saved bytes per token of model `m` in `regime` (see REGIMES)."""
    if regime not in REGIMES:
        raise ValueError(f"unknown precision regime {regime!r}")
    return _profile(m.model_dump_json(), regime, document_mask)


@functools.lru_cache(maxsize=128)
def _profile(model_json: str, regime: str, document_mask: bool) -> ActivationProfile:
    m = ModelConfig.model_validate_json(model_json)
    probe = _probe_config(m, m.dropout)
    saved, selective_outputs, casts = _run_probe(probe, regime, document_mask)
    parts = _split(saved, m, probe)
    block = parts.block
    block_input = _block_input(m, regime)
    selective = _split(_block_outputs(selective_outputs), m, probe, selective=True)
    sel_block = selective.block
    cast_elements = sum(c.shape[0] * c.shape[1] for c in casts)
    cast_bytes = sum(c.nbytes for c in casts)
    moe = {}
    if m.moe_experts:
        moe = _moe_profile(m, regime, document_mask, block, sel_block + block_input,
                           [r for r in saved if _in_mlp(r)],
                           [r for r in selective_outputs if _in_mlp(r)], probe)
    return ActivationProfile(
        block=block, block_selective=sel_block + block_input, block_input=block_input,
        per_position=parts.per_position, mask_per_position=parts.mask_per_position,
        per_position_selective=selective.per_position, embedding=parts.embedding,
        head=parts.head,
        weight_casts_per_param=cast_bytes / cast_elements if cast_elements else 0.0,
        **moe,
    )


def _block_input(m: ModelConfig, regime: str) -> SavedBytes:
    """What a block saves of its own input: the first norm's input, in the residual dtype."""
    return SavedBytes(sequence=(2 if regime == "bf16_params" else 4) * m.d_model)


def _block_outputs(selective_outputs: list[_Saved]) -> list[_Saved]:
    """The blocks' kept operator outputs (the head's are not checkpointed)."""
    return [r for r in selective_outputs
            if r.where not in ("norm", "output", "loss", "tok_embeddings")]


def context_profile(m: ModelConfig, regime: str, document_mask: bool, mode: str) -> ContextProfile:
    """Saved bytes per local token of a context-parallel rank of model `m` in cp mode `mode`
    (dense layers; an MoE layer's MLP is as without cp, on the rank's own tokens)."""
    if regime not in REGIMES:
        raise ValueError(f"unknown precision regime {regime!r}")
    return _context(m.model_dump_json(), regime, document_mask, mode)


@functools.lru_cache(maxsize=128)
def _context(model_json: str, regime: str, document_mask: bool, mode: str) -> ContextProfile:
    m = ModelConfig.model_validate_json(model_json)
    probe = _probe_config(m, m.dropout)
    saved, selective_outputs, _ = _run_probe(probe, regime, document_mask, ShapeExchange(mode, _CP))
    parts = _split(saved, m, probe, mode=mode)
    selective = _split(_block_outputs(selective_outputs), m, probe, selective=True, mode=mode)
    return ContextProfile(
        block=parts.block, gathered=parts.gathered, per_position=parts.per_position,
        mask_per_position=parts.mask_per_position, per_position_cp=parts.per_position_cp,
        block_selective=selective.block + _block_input(m, regime),
        per_position_selective=selective.per_position + selective.per_position_cp,
        embedding=parts.embedding, head=parts.head)


def _in_mlp(rec: _Saved) -> bool:
    return rec.where == _FFN_MODULE or rec.where.startswith(_FFN_MODULE + ".")


def _moe_profile(m: ModelConfig, regime: str, document_mask: bool, block: SavedBytes,
                 block_selective: SavedBytes, dense_mlp: list[_Saved],
                 dense_mlp_selective: list[_Saved], probe: ModelConfig) -> dict[str, object]:
    """An MoE block: the dense block with its MLP's saved tensors replaced by an MoE layer's
    (measured on the MoE probe), under no and selective checkpointing; and the router's
    per-micro-batch weight copy."""
    saved, selective, casts = _run_probe(_moe_probe_config(m, m.dropout), regime, document_mask)
    mlp = _moe_bytes([r for r in saved if _in_mlp(r)], m)
    mlp_selective = _moe_bytes([r for r in selective if _in_mlp(r)], m)
    router = ((_MOE_E, _MOE_D), (_MOE_D, _MOE_E))  # saved transposed by the matmul
    router_copy = sum(c.nbytes for c in casts if c.shape in router and c.where == _FFN_MODULE)
    return {
        "moe_block": block - _split(dense_mlp, m, probe).block + mlp,
        "moe_block_selective": (block_selective
                                - _split(dense_mlp_selective, m, probe, selective=True).block
                                + mlp_selective),
        "moe_router_copy": router_copy * m.moe_experts * m.d_model / (_MOE_E * _MOE_D),
    }


def _moe_bytes(records: list[_Saved], m: ModelConfig) -> SavedBytes:
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
