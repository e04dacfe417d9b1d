"""Attention: projections, QK-norm (per head or per projection), RoPE, the masks and the
kernel, and the one place where context parallelism, document masks and the kernel meet.

Sequence layout. Without context parallelism a rank holds every position of its sequences.
With it, a rank holds some of them: `positions` (B, T_local), the global index of each local
token in its sample. Positions, RoPE and masks always come from those global positions and
from the whole sample's document ids, never from the local part alone.

Context parallelism is a property of the attention module on the mesh: `Attention.sequence`
(None here; a `SequenceExchange` placed by `tessel.parallel.context`) moves keys and values
(all-gather) or heads (Ulysses) between the ranks that share the sequence, inside the
forward, with autograd-aware collectives. The kernel is whatever the device has: SDPA with
an explicit mask on CPU (and wherever attention dropout is on), FlexAttention's block
mask on CUDA, SDPA's own causal kernels where no mask is needed. Nothing here patches
PyTorch functions, and nothing here starts a collective itself.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from tessel.models.variants import rms_norm

if TYPE_CHECKING:  # the config imports the presets from this package
    from tessel.config import ModelConfig

AttentionMask = torch.Tensor | BlockMask
"""A mask: a dense (B, 1, T_q, T_kv) additive one for SDPA (CPU, or with attention dropout,
which FlexAttention lacks), or FlexAttention's block mask (CUDA)."""


class SequenceExchange(Protocol):
    """How the ranks that share a sequence (context parallelism) meet in attention."""

    size: int
    """Ranks the sequence is split over."""
    local_queries: bool
    """True: the kernel runs this rank's query rows against the whole sequence's keys
    (all-gather of K/V); False: every query row, for a share of the heads (Ulysses)."""

    def exchange(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v: (B, T_local, heads, hd) after RoPE -> what the kernel takes, keys and
        values over the whole sequence in position order."""
        ...

    def restore(self, y: torch.Tensor) -> torch.Tensor:
        """The kernel's output -> (B, T_local, heads, hd) of this rank's tokens."""
        ...


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x: (B, T, H, hd) by freqs: (T, hd/2, 2), the same
    positions for every sequence, or (B, T, hd/2, 2), each sequence's own (documents)."""
    xf = x.float().unflatten(-1, (-1, 2))  # (B, T, H, hd/2, 2)
    cos, sin = freqs[..., None, :, 0], freqs[..., None, :, 1]  # ([B,] T, 1, hd/2)
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        assert cfg.head_dim is not None and cfg.n_kv_heads is not None
        self.head_dim = cfg.head_dim
        kv_dim = cfg.n_kv_heads * cfg.head_dim
        # q_dim = d_model unless model.head_dim says otherwise (Qwen3: 32 x 128 on 2048).
        qkv_bias = cfg.bias or cfg.qkv_bias  # Qwen2: biases on q, k, v only
        self.wq = nn.Linear(cfg.d_model, cfg.q_dim, bias=qkv_bias)
        self.wk = nn.Linear(cfg.d_model, kv_dim, bias=qkv_bias)
        self.wv = nn.Linear(cfg.d_model, kv_dim, bias=qkv_bias)
        self.wo = nn.Linear(cfg.q_dim, cfg.d_model, bias=cfg.bias)
        # QK-norm: one RMSNorm over head_dim for all query heads, one for all key heads
        # (Qwen3), or one over each whole projection (OLMo 2); None without it, so other
        # models keep their parameters and state dict.
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if cfg.qk_norm and cfg.qk_norm_scope == "head":
            self.q_norm = rms_norm(cfg.head_dim, cfg)  # (1 + weight) under model.norm_offset
            self.k_norm = rms_norm(cfg.head_dim, cfg)
        elif cfg.qk_norm:
            self.q_norm = ProjectionNorm(cfg.q_dim, cfg.norm_eps, cfg.norm_offset)
            self.k_norm = ProjectionNorm(kv_dim, cfg.norm_eps, cfg.norm_offset)
        self.per_head_norm = cfg.qk_norm_scope == "head"
        self.dropout = cfg.dropout
        self.scale = cfg.query_scale
        """The scores' factor (model.query_scale); None: the kernel's 1 / sqrt(head_dim)."""
        self.sequence: SequenceExchange | None = None
        """Context parallelism (tessel.parallel.context): how this rank's part of the
        sequence meets the others'; None = every position is here."""

    def forward(self, x: torch.Tensor, freqs: torch.Tensor | None,
                mask: AttentionMask | None = None, sharded: bool = False) -> torch.Tensor:
        """x: (B, T, C); freqs: the RoPE table (T_max, hd/2, 2) or each token's own
        (B, T, hd/2, 2); mask: from `attention_mask` (None: causal); sharded: x holds this
        rank's part of the sequence (context parallelism) -> (B, T, C)."""
        B, T, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if not self.per_head_norm and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # the whole projections (OLMo 2)
        # Head counts come from the shapes (-1), not the config: under tensor parallelism
        # each rank holds n_heads/tp query heads and n_kv_heads/tp key/value heads.
        q = q.view(B, T, -1, self.head_dim)
        k = k.view(B, T, -1, self.head_dim)
        v = v.view(B, T, -1, self.head_dim)
        if self.per_head_norm and self.q_norm is not None and self.k_norm is not None:
            # Per head, before RoPE. In the weight's dtype (fp32 under autocast, as
            # transformers normalises): a bf16 input with an fp32 weight has no fused kernel
            # and warns.
            dtype = self.q_norm.weight.dtype
            q, k = self.q_norm(q.to(dtype)).type_as(q), self.k_norm(k.to(dtype)).type_as(k)
        if freqs is not None:
            if freqs.dim() == 3:  # the whole table: positions 0..T-1
                freqs = freqs[:T]
            q, k = apply_rope(q, freqs), apply_rope(k, freqs)
        exchange = self.sequence if sharded else None
        if exchange is not None:
            # Keys/values after RoPE (each rotated by its own global position) and before
            # the grouped-query expansion: GQA models move only their KV heads.
            q, k, v = exchange.exchange(q, k, v)
        y = attend(q, k, v, mask, self.dropout if self.training else 0.0, self.scale)
        if exchange is not None:
            y = exchange.restore(y)
        return self.wo(y.reshape(B, T, -1))  # (B, T, C)


class ProjectionNorm(nn.Module):
    """RMSNorm over a whole projection's output, all heads together (OLMo 2's QK-norm),
    computed in float32 and scaled by the weight before the cast back, as OLMo 2 does.

    Written as plain sums rather than `F.rms_norm` so that it runs unchanged on a tensor
    whose last dimension is split over ranks (tensor parallelism gives each rank some heads:
    `tessel.parallel.tensor` hands it a DTensor sharded there, whose sum of squares is then
    one all-reduce of a value per token)."""

    def __init__(self, width: int, eps: float, offset: bool = False):
        super().__init__()
        self.width = width
        self.eps = eps
        self.offset = offset
        """model.norm_offset: scale by (1 + weight), a zero weight meaning a unit scale."""
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., width) -> the same shape and dtype."""
        xf = x.float()
        mean_square = xf.pow(2).sum(-1, keepdim=True) / self.width
        scale = self.weight + 1 if self.offset else self.weight
        return (scale * (xf * torch.rsqrt(mean_square + self.eps))).to(x.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None,
           dropout: float = 0.0, scale: float | None = None) -> torch.Tensor:
    """The kernel. q: (B, T_q, H, hd), k, v: (B, T_kv, H_kv, hd) with H a multiple of H_kv;
    mask None means causal with T_q = T_kv; scale: the scores' factor (None: 1 / sqrt(hd))
    -> (B, T_q, H, hd).

    Grouped-query attention goes to the kernel as it is (`enable_gqa`): CPU's SDPA kernel,
    CUDA's flash kernel and FlexAttention read each KV head for its query group, so the keys
    and values kept for backward are the KV heads' (under all-gather context parallelism the
    whole sequence's: n_heads / n_kv_heads times less than repeated ones). CUDA's
    memory-efficient kernel, the one that takes a dense mask (attention dropout with
    documents), needs equal head counts: there they are repeated first."""
    gqa = k.shape[2] != q.shape[2]
    if gqa and q.is_cuda and isinstance(mask, torch.Tensor):
        rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        gqa = False
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, hd)
    if isinstance(mask, BlockMask):  # CUDA: FlexAttention's fused kernel
        y = _flex_attention()(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
    else:
        # Without a mask SDPA may pick the flash kernel; an explicit mask already contains
        # the causal part.
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           dropout_p=dropout, scale=scale, enable_gqa=gqa)
    return y.transpose(1, 2)  # (B, T_q, H, hd)


# ---- masks -----------------------------------------------------------------------------


def attention_mask(doc_ids: torch.Tensor | None, rows: torch.Tensor | None, kv_len: int,
                   device: torch.device, flex: bool, dtype: torch.dtype,
                   window: int | None = None) -> AttentionMask | None:
    """The mask of one forward: causal, and within each document when `doc_ids` (B, T_kv)
    gives the whole sample's documents; `rows` (B, T_q) are the global positions of the query
    rows (context parallelism), None for all kv_len of them in order. `flex`: FlexAttention's
    block mask (CUDA) instead of a dense one. None: plain causal attention (SDPA's own
    kernel). `window`: a local layer's mask, which also hides keys `window` or more
    positions before the query (model.sliding_window; global positions, so context
    parallelism sees the window the whole sequence would).

    A dense mask is additive, in `dtype` (the queries' dtype): 0 where a key is seen, -inf
    where not. SDPA turns a boolean mask into exactly this in every layer it is handed to,
    and autograd keeps each layer's copy for backward (a (T_q, T_kv) float matrix per layer:
    under context parallelism more than the rank's whole share of activations at long
    sequences); made once here, every layer uses and keeps the same one."""
    if rows is None and window is None:
        if doc_ids is None:
            return None
        if flex:
            return document_block_mask(doc_ids)
        return _additive(document_causal_mask(doc_ids), dtype)
    if rows is None and flex:
        return _window_block_mask(doc_ids, kv_len, window, device)
    if rows is None:  # a window over the whole sequence: every position is a query row
        batch = doc_ids.shape[0] if doc_ids is not None else 1
        rows = torch.arange(kv_len, device=device).expand(batch, -1)
    if flex:
        return _rows_block_mask(rows, doc_ids, kv_len, window)
    kv = torch.arange(kv_len, device=device)
    allowed = rows[:, :, None] >= kv  # (B, T_q, T_kv): causal from the global positions
    if window is not None:
        allowed = allowed & (rows[:, :, None] - kv < window)
    if doc_ids is not None:
        allowed = allowed & (doc_ids.gather(1, rows)[:, :, None] == doc_ids[:, None, :])
    return _additive(allowed[:, None], dtype)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as SDPA would convert it: 0 where True, -inf where False."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, float("-inf"))


def _rows_block_mask(rows: torch.Tensor, doc_ids: torch.Tensor | None, kv_len: int,
                     window: int | None = None) -> BlockMask:
    """FlexAttention block mask of query rows at global positions `rows` against every key,
    within `window` positions back when given."""
    B, Tq = rows.shape
    if doc_ids is None:
        def causal(b, h, q, kv):  # noqa: ANN001, ANN202, ARG001 (FlexAttention's mask_mod)
            return rows[b, q] >= kv
    else:
        row_docs = doc_ids.gather(1, rows)

        def causal(b, h, q, kv):  # noqa: ANN001, ANN202, ARG001
            return (rows[b, q] >= kv) & (row_docs[b, q] == doc_ids[b, kv])

    allowed = causal
    if window is not None:
        def allowed(b, h, q, kv):  # noqa: ANN001, ANN202
            return causal(b, h, q, kv) & (rows[b, q] - kv < window)

    create = _create_block_mask() if rows.is_cuda else create_block_mask
    return create(allowed, B, None, Tq, kv_len, device=rows.device)


def _window_block_mask(doc_ids: torch.Tensor | None, T: int, window: int | None,
                       device: torch.device) -> BlockMask:
    """FlexAttention block mask of a local layer over the whole sequence: causal, within
    `window` positions back and, with `doc_ids`, within each document (no document: one
    mask for every sequence of the batch)."""
    if doc_ids is None:
        def allowed(b, h, q, kv):  # noqa: ANN001, ANN202, ARG001 (FlexAttention's mask_mod)
            return (q >= kv) & (q - kv < window)
    else:
        def allowed(b, h, q, kv):  # noqa: ANN001, ANN202, ARG001
            return (q >= kv) & (q - kv < window) & (doc_ids[b, q] == doc_ids[b, kv])

    batch = doc_ids.shape[0] if doc_ids is not None else None
    create = _create_block_mask() if torch.device(device).type == "cuda" else create_block_mask
    return create(allowed, batch, None, T, T, device=device)


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids -> (B, T) int64 position of each token inside its document (0 at
    each document's first token, and at the sequence's first, as Megatron's
    reset_position_ids)."""
    T = doc_ids.shape[1]
    index = torch.arange(T, device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def document_block_mask(doc_ids: torch.Tensor) -> BlockMask:
    """(B, T) document ids -> FlexAttention block mask, causal and within each document: no
    (T, T) tensor, and the kernel skips the blocks that are wholly masked."""
    B, T = doc_ids.shape

    def same_document(b, h, q, kv):  # noqa: ANN001, ARG001 (FlexAttention's mask_mod signature)
        return (q >= kv) & (doc_ids[b, q] == doc_ids[b, kv])

    # Compiled on CUDA (eagerly it evaluates all T x T pairs); the CPU never trains with it.
    create = _create_block_mask() if doc_ids.is_cuda else create_block_mask
    return create(same_document, B, None, T, T, device=doc_ids.device)


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids -> (B, 1, T, T) bool: causal and within the same document."""
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal)[:, None]


@functools.cache
def _flex_attention():  # noqa: ANN202
    """flex_attention compiled once: uncompiled it materialises the full score matrix (a
    compiled model inlines it into its own graph)."""
    return torch.compile(flex_attention)


@functools.cache
def _create_block_mask():  # noqa: ANN202
    """create_block_mask compiled once: eagerly it evaluates the mask over all T x T pairs."""
    return torch.compile(create_block_mask)
