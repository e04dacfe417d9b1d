"""One decoder-only transformer covering GPT-2/GPT-3 and Llama shapes.

Variants (all from `ModelConfig`): learned or rotary positions, LayerNorm or RMSNorm, GELU MLP
or SwiGLU, multi-head or grouped-query attention, a head width of its own and QK-norm (Qwen3,
per head; OLMo 2, per projection), tied or untied embeddings, biases on or off (or on q/k/v
only: Qwen2), norms before the sub-layers or after them (OLMo 2).
Nothing here knows about parallelism. Blocks live in a ModuleDict keyed "0".."L-1" so that a
pipeline stage can drop blocks and keep the checkpoint names of the rest.

Build on the meta device and initialise afterwards (`build_model`), so any shape can be
instantiated without memory.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tessel.models.attention import (  # noqa: F401 (document_* and apply_rope: public here too)
    Attention,
    AttentionMask,
    SequenceExchange,
    apply_rope,
    attention_mask,
    document_block_mask,
    document_causal_mask,
    document_positions,
)
from tessel.models.loss import chunked_loss_sum, chunked_row_losses
from tessel.models.moe import MoE
from tessel.models.variants import (
    attention_share,
    rms_norm,
    scale_embeddings,
    softcap,
    uses_local_table,
)

if TYPE_CHECKING:  # the config imports the presets from this package
    from tessel.config import ModelConfig


def _norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return rms_norm(cfg.d_model, cfg)  # (1 + weight) under model.norm_offset
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


def rope_frequencies(head_dim: int, max_seq_len: int, theta: float, device=None,
                     scaling: tuple[float, float, float, int] | None = None,
                     linear: float = 1.0) -> torch.Tensor:
    """cos/sin table of shape (max_seq_len, head_dim/2, 2) in float32. `scaling` = (factor,
    low_freq_factor, high_freq_factor, original_max_seq_len): Llama 3.1's frequency scaling;
    `linear`: every frequency divided by it (transformers' "linear" RoPE, Gemma 3)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is not None:
        inv = llama3_inv_freq(inv, *scaling)
    if linear != 1.0:
        inv = inv / linear
    t = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(t, inv)  # (T, hd/2)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low: float, high: float,
                    original: int) -> torch.Tensor:
    """Llama 3.1's RoPE frequency scaling (Meta's reference, as transformers computes it):
    long wavelengths are divided by `factor`, short ones kept, the band between them
    interpolated."""
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig, hidden: int | None = None):
        """`hidden`: the MLP's hidden size, cfg.ffn_hidden unless given (MoE shared experts)."""
        super().__init__()
        hidden = hidden or cfg.ffn_hidden
        self.gated = cfg.mlp != "gelu"
        self.gate = F.silu if cfg.mlp == "swiglu" else _gelu_tanh  # GeGLU: Gemma
        self.w1 = nn.Linear(cfg.d_model, hidden, bias=cfg.bias)
        self.w2 = nn.Linear(hidden, cfg.d_model, bias=cfg.bias)
        self.w3 = nn.Linear(cfg.d_model, hidden, bias=cfg.bias) if self.gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(self.gate(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        """`index`: the block's layer number, which decides whether its MLP is an MoE layer
        (cfg.is_moe_layer). Either way it is called `feed_forward`."""
        super().__init__()
        # model.norm_placement: norms on the sub-layers' inputs ("pre"), on their outputs
        # before the residual add ("post", OLMo 2), or both ("sandwich"); None where absent,
        # so a model keeps only the parameters (and state dict names) it has.
        pre, post = cfg.norm_placement != "post", cfg.norm_placement != "pre"
        self.attention_norm = _norm(cfg) if pre else None
        self.attention = Attention(cfg)
        self.post_attention_norm = _norm(cfg) if post else None
        self.ffn_norm = _norm(cfg) if pre else None
        self.feed_forward: nn.Module = _mlp(cfg, index)
        self.post_ffn_norm = _norm(cfg) if post else None
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.local = cfg.is_local_layer(index)
        """Whether this block attends through the sliding window (model.sliding_window):
        the model hands it the local mask and RoPE table."""

    def forward(self, x: torch.Tensor, freqs: torch.Tensor | None,
                mask: AttentionMask | None = None, sharded: bool = False) -> torch.Tensor:
        """`sharded`: x holds this rank's part of the sequence (context parallelism)."""
        a = self.attention(_normed(self.attention_norm, x), freqs, mask, sharded)
        x = x + self.resid_dropout(_normed(self.post_attention_norm, a))
        f = self.feed_forward(_normed(self.ffn_norm, x))
        return x + self.resid_dropout(_normed(self.post_ffn_norm, f))


def _normed(norm: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
    return x if norm is None else norm(x)


def _mlp(cfg: ModelConfig, index: int) -> nn.Module:
    """Block `index`'s MLP: dense, or an MoE layer with its shared experts."""
    if not cfg.is_moe_layer(index):
        return FeedForward(cfg)
    assert cfg.moe_ffn_hidden is not None
    shared = cfg.moe_shared_experts * cfg.moe_ffn_hidden
    return MoE(cfg, FeedForward(cfg, shared) if shared else None)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # padded_vocab_size rows: ids from vocab_size up are padding (model.vocab_pad_to).
        self.tok_embeddings = nn.Embedding(cfg.padded_vocab_size, cfg.d_model)
        self.embeds = True
        """Whether forward embeds token ids: False on a pipeline stage after the first, which
        may still hold `tok_embeddings` as the tied output projection's weight."""
        self.pos_embeddings = (
            nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.position == "learned" else None
        )
        self.emb_dropout = nn.Dropout(cfg.dropout)
        self.context_parallel: SequenceExchange | None = None
        """Context parallelism (tessel.parallel.context): the exchange every attention module
        of this model holds; None without. Forward reads its degree and mode."""
        self.loss_chunks = 1
        """Pieces the output projection and loss run in when forward is given the targets
        (parallel.loss_chunks): only one piece's logits exist at once."""
        self.row_losses = False
        """With the targets: each row's summed loss, (B,), instead of the micro-batch's (1,)
        (preference tuning, tessel.train.dpo_run: each row is a reply)."""
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm = _norm(cfg)
        self.output = nn.Linear(cfg.d_model, cfg.padded_vocab_size, bias=False)
        self.tie_weights()
        # Not persistent: derived from the config, recomputed by init_buffers.
        self.register_buffer("rope_freqs", self._rope_table(), persistent=False)
        # The local layers' own table (model.rope_local_theta); None: they use rope_freqs.
        self.register_buffer("rope_local_freqs", self._rope_table(local=True), persistent=False)
        # Added to the logits: -inf at the padding ids, so they are never predicted and get
        # no gradient; None without padding. Sharded like the logits under tensor
        # parallelism (tessel.parallel.tensor places it).
        self.register_buffer("vocab_mask", self._vocab_mask(), persistent=False)

    def tie_weights(self) -> None:
        """Share the embedding with the output projection when configured. `to_empty`
        materialises each module's parameters separately and so unties them: call again."""
        if self.cfg.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight

    def _rope_table(self, local: bool = False) -> torch.Tensor | None:
        """The global layers' table (rope_theta, scaled), or with `local` the local layers'
        own (rope_local_theta, unscaled; None when they have none)."""
        cfg = self.cfg
        if local:
            if not uses_local_table(cfg):
                return None
            assert cfg.rope_local_theta is not None
            return rope_frequencies(cfg.head_dim, cfg.max_seq_len, cfg.rope_local_theta)
        if cfg.position != "rope":
            return None
        scaling, linear = None, 1.0
        if cfg.rope_scaling_factor != 1.0 and cfg.rope_scaling_type == "linear":
            linear = cfg.rope_scaling_factor
        elif cfg.rope_scaling_factor != 1.0:
            scaling = (cfg.rope_scaling_factor, cfg.rope_low_freq_factor,
                       cfg.rope_high_freq_factor, cfg.rope_original_max_seq_len)
        return rope_frequencies(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta,
                                scaling=scaling, linear=linear)

    def _vocab_mask(self, device: torch.device | str | None = None) -> torch.Tensor | None:
        """(padded_vocab_size,) float32: 0 for real ids, -inf for padding; None if none."""
        cfg = self.cfg
        if cfg.padded_vocab_size == cfg.vocab_size:
            return None
        mask = torch.zeros(cfg.padded_vocab_size, device=device)
        mask[cfg.vocab_size:] = float("-inf")
        return mask

    def initial_value(self, name: str, shape: torch.Size, seed: int) -> torch.Tensor:
        """The initial value of parameter `name` (full, unsharded, float32, on CPU).

        Each parameter draws from its own generator seeded by (seed, name), so its value does
        not depend on which other parameters a process holds: a pipeline stage or a shard
        gets exactly the weights of the single-process model (GPT-2 scheme).
        """
        cfg = self.cfg
        if len(shape) == 1:  # norm weights and biases
            # model.norm_offset: x * (1 + weight), so a unit scale is a zero weight
            unit = 0.0 if cfg.norm_offset else 1.0
            return torch.full(shape, unit if name.endswith("norm.weight") else 0.0)
        gen = torch.Generator(device="cpu").manual_seed(
            (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63
        )
        resid_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        # Residual output projections (attention, MLP, experts) get the scaled std; the MoE
        # router gets init_std like every other input projection.
        std = (resid_std if name.endswith(("wo.weight", "w2.weight", "experts.w2"))
               else cfg.init_std)
        if name in VOCAB_PARAMS and shape[0] > cfg.vocab_size:
            # The real rows are what the unpadded model draws; the padding rows are zero
            # (and stay zero: they get no gradient).
            real = torch.randn((cfg.vocab_size, *shape[1:]), generator=gen,
                               dtype=torch.float32) * std
            return torch.cat([real, real.new_zeros((shape[0] - cfg.vocab_size, *shape[1:]))])
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic initialisation from `seed` on whatever device the (plain, unsharded)
        parameters are. Call after `to_empty` when the model was built on meta."""
        for name, p in self.named_parameters():
            p.copy_(self.initial_value(name, p.shape, seed))
        self.init_buffers()

    def init_buffers(self, fill: Callable[[torch.Tensor, torch.Tensor], None] | None = None
                     ) -> None:
        """Recompute the non-persistent buffers (the RoPE table, the vocabulary mask, MoE
        statistics) on their device and zero the MoE balancing bias (persistent, but zero at
        initialisation; a checkpoint restores it later), after `to_empty`. `fill(buffer,
        full value)` copies this rank's share of a buffer the parallel layer placed (the
        vocabulary mask, sharded like the logits under tensor parallelism:
        `tessel.models.init.Placement.fill`); None: every buffer is whole here."""
        if self.rope_freqs is not None:
            self.rope_freqs = self._rope_table().to(self.rope_freqs.device)
        if self.rope_local_freqs is not None:
            self.rope_local_freqs = self._rope_table(local=True).to(self.rope_local_freqs.device)
        for module in self.modules():
            if isinstance(module, MoE):  # a fresh model: no balancing bias yet, no statistics
                module.expert_bias.zero_()
                module.reset_stats()
        mask = self.vocab_mask
        if mask is not None:
            if fill is None:
                self.vocab_mask = self._vocab_mask(mask.device)
            else:
                fill(mask, self._vocab_mask(mask.device))

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None,
                targets: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: (B, T) int64 -> logits (B, T, padded_vocab_size) in the compute dtype, -inf
        at the padding ids; with `targets` (B, T), the summed next-token loss instead, shape (1,)
        (`loss.token_loss_sum`; each row's, (B,), under `row_losses`), over `loss_chunks`
        pieces whose logits are recomputed in backward, so the whole logits never exist at once.

        doc_ids: optional (B, T_sample) document index of each position of the whole sample;
        attention then stays inside each document of a packed sequence, and positions
        (learned or RoPE) restart at 0 where each document starts, so a packed document is
        computed exactly as if it were alone in its sequence.
        positions: optional (B, T) global position of each token in its sample when `tokens`
        are this rank's part of it (context parallelism, `tessel.parallel.context`); then
        T_sample = T x the context-parallel degree. None: tokens are the whole sample.
        """
        T = tokens.shape[1]
        cp = self.context_parallel
        sharded = positions is not None and cp is not None
        # Each token's position for learned embeddings and RoPE: from the whole sample's
        # documents, then this rank's tokens of it.
        where = positions if sharded else None  # (B, T) or None for 0..T-1
        if doc_ids is not None:
            in_doc = document_positions(doc_ids)  # (B, T_sample)
            where = in_doc.gather(1, positions) if sharded else in_doc
        # A pipeline stage lacks the parts other stages hold (see tessel.parallel.pipeline):
        # without embeddings its input is the previous stage's hidden state (B, T, C); without
        # the head it returns its hidden state.
        if self.embeds:
            h = self.tok_embeddings(tokens)  # (B, T, C)
            if self.cfg.embed_scale:  # Gemma: x sqrt(d_model)
                h = scale_embeddings(h, self.cfg.d_model)
            if self.pos_embeddings is not None:  # (T, C), or (B, T, C) per token
                h = h + self.pos_embeddings(
                    where if where is not None else torch.arange(T, device=tokens.device))
            h = self.emb_dropout(h)
        else:
            h = tokens
        freqs = self.rope_freqs  # the table, sliced to T in attention
        local_freqs = self.rope_local_freqs if self.rope_local_freqs is not None else freqs
        if freqs is not None and where is not None:
            freqs = freqs[where]  # (B, T, hd/2, 2): each token's own position
            local_freqs = local_freqs[where] if self.rope_local_freqs is not None else freqs
        kv_len = T * cp.size if sharded else T
        # The queries' dtype: autocast's, else the hidden state's.
        device = tokens.device.type
        dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                 else h.dtype)
        mask = self._mask(doc_ids, positions if sharded else None, kv_len, tokens, dtype)
        local_mask = mask
        window = self.cfg.sliding_window
        if window is not None and window < kv_len:  # a window as long as the sequence: none
            local_mask = self._mask(doc_ids, positions if sharded else None, kv_len, tokens,
                                    dtype, window)
        for block in self.layers.values():
            if block.local:
                h = block(h, local_freqs, local_mask, sharded)
            else:
                h = block(h, freqs, mask, sharded)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        if targets is not None and self.row_losses:
            return chunked_row_losses(self.logits, h, targets, self.loss_chunks)  # (B,)
        if targets is not None:
            # (1,): a pipeline stage's output needs a batch dimension to be merged.
            return chunked_loss_sum(self.logits, h, targets, self.loss_chunks).reshape(1)
        return self.logits(h)

    def _mask(self, doc_ids: torch.Tensor | None, positions: torch.Tensor | None, kv_len: int,
              tokens: torch.Tensor, dtype: torch.dtype, window: int | None = None
              ) -> AttentionMask | None:
        """The global layers' mask, or with `window` the local layers'; `positions`: this
        rank's global positions under context parallelism, else None."""
        if doc_ids is None and positions is None and window is None:
            return None  # plain causal attention: SDPA's own kernel
        cp = self.context_parallel
        flex = tokens.is_cuda and not (self.training and self.cfg.dropout > 0)
        # Under all-gather context parallelism the kernel runs this rank's query rows
        # against every key; under Ulysses every row (for a share of the heads).
        rows = positions if positions is not None and cp is not None and cp.local_queries else None
        return attention_mask(doc_ids, rows, kv_len, tokens.device, flex, dtype, window)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(..., C) final hidden states -> (..., padded_vocab_size) logits, -inf at padding
        (soft-capped first under model.final_logit_softcap)."""
        logits = self.output(h)
        if self.cfg.final_logit_softcap is not None:
            logits = softcap(logits, self.cfg.final_logit_softcap)
        if self.vocab_mask is not None:
            logits = logits + self.vocab_mask.to(logits.dtype)
        return logits


VOCAB_PARAMS = ("tok_embeddings.weight", "output.weight")
"""Parameters with one row per vocabulary id (padded_vocab_size rows)."""


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu", seed: int = 0) -> Transformer:
    """Build on meta, materialise on `device`, initialise from `seed`."""
    with torch.device("meta"):
        model = Transformer(cfg)
    if torch.device(device).type == "meta":
        return model
    model.to_empty(device=device)
    model.tie_weights()
    model.init_weights(seed)
    return model


# ---- analytic formulas (checked against the built model by the tests) ------------------


def _linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def _mlp_params(cfg: ModelConfig, hidden: int) -> tuple[int, int]:
    """(matmul weights, all parameters) of one dense MLP with `hidden` units."""
    d, n_mats = cfg.d_model, 3 if cfg.mlp != "gelu" else 2
    bias = (2 * hidden if cfg.mlp != "gelu" else hidden) + d if cfg.bias else 0
    return n_mats * d * hidden, n_mats * d * hidden + bias


def _moe_params(cfg: ModelConfig) -> tuple[int, int, int]:
    """(active matmul weights per token, all matmul weights, all parameters) of one MoE
    layer: router, routed experts (top_k of them active), shared experts (always active)."""
    assert cfg.moe_ffn_hidden is not None
    d, E, f = cfg.d_model, cfg.moe_experts, cfg.moe_ffn_hidden
    expert = (3 if cfg.mlp != "gelu" else 2) * d * f  # no biases
    shared_mm, shared_all = (_mlp_params(cfg, cfg.moe_shared_experts * f)
                             if cfg.moe_shared_experts else (0, 0))
    router = E * d
    return (router + cfg.moe_top_k * expert + shared_mm, router + E * expert + shared_mm,
            router + E * expert + shared_all)


def _block_params(cfg: ModelConfig, index: int) -> tuple[int, int, int]:
    """(active matmul weights per token, all matmul weights, all parameters) of block
    `index`; active = all for a dense block."""
    d, q, kv = cfg.d_model, cfg.q_dim, cfg.n_kv_heads * cfg.head_dim
    attn_mm = 2 * d * q + 2 * d * kv
    qkv_bias = cfg.bias or cfg.qkv_bias
    attn = (_linear(d, q, qkv_bias) + _linear(q, d, cfg.bias) + 2 * _linear(d, kv, qkv_bias)
            + block_norms(cfg) * _norm_params(cfg) + qk_norm_params(cfg))
    if cfg.is_moe_layer(index):
        active, mm, total = _moe_params(cfg)
    else:
        mm, total = _mlp_params(cfg, cfg.ffn_hidden)
        active = mm
    return attn_mm + active, attn_mm + mm, attn + total


def qk_norm_params(cfg: ModelConfig, tp: int = 1) -> int:
    """QK-norm's weights on one of `tp` tensor-parallel ranks: one head's width each for q
    and k (replicated), or each whole projection's (split like the projection's columns)."""
    if not cfg.qk_norm:
        return 0
    if cfg.qk_norm_scope == "head":
        return 2 * cfg.head_dim
    return (cfg.q_dim + cfg.n_kv_heads * cfg.head_dim) // tp


def block_norms(cfg: ModelConfig) -> int:
    """Norms on a block's residual stream: two (before or after each sub-layer), or four."""
    return 4 if cfg.norm_placement == "sandwich" else 2


def _norm_params(cfg: ModelConfig) -> int:
    return cfg.d_model * (2 if cfg.norm == "layernorm" and cfg.bias else 1)


def param_count(cfg: ModelConfig, exclude_embeddings: bool = False) -> int:
    """Exact number of parameters (a tied output matrix counted once; every expert)."""
    d, V = cfg.d_model, cfg.padded_vocab_size  # padding rows are real memory
    emb = V * d + (cfg.max_seq_len * d if cfg.position == "learned" else 0)
    total = sum(_block_params(cfg, i)[2] for i in range(cfg.n_layers)) + _norm_params(cfg)
    total += 0 if cfg.tie_embeddings else V * d
    return total if exclude_embeddings else total + emb


def active_param_count(cfg: ModelConfig, exclude_embeddings: bool = False) -> int:
    """Parameters one token uses: param_count less the routed experts it is not sent to
    (each MoE layer: experts - top_k of them). Equal to param_count for a dense model."""
    idle = 0
    if cfg.moe_experts:
        assert cfg.moe_ffn_hidden is not None
        expert = (3 if cfg.mlp != "gelu" else 2) * cfg.d_model * cfg.moe_ffn_hidden
        idle = cfg.n_moe_layers * (cfg.moe_experts - cfg.moe_top_k) * expert
    return param_count(cfg, exclude_embeddings) - idle


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward = 3x forward), attention included.

    6 * (matmul weights a token uses, output projection included) + 12 * n_layers * q_dim
    * seq_len: the PaLM-paper formula (Chowdhery et al. 2022, appendix B) used by nanoGPT's
    MFU, with the queries' width (n_heads x head_dim, d_model unless model.head_dim says
    otherwise) where the paper has d_model. It counts the full attention score matrix (no
    causal halving) and ignores norms, activations and the softmax. In MoE layers a token
    uses the router, its top_k routed experts and the shared experts (active parameters, as
    DeepSeek-V3 and Megatron count); the permutation and the weighted combine are not
    counted. A local layer (model.sliding_window) counts the share of that work its window
    leaves (`window_flops_share`: min(window, position) keys per query against the causal
    layer's position), so the same matrix shrinks as the causal triangle does.
    """
    active = sum(_block_params(cfg, i)[0] for i in range(cfg.n_layers))
    n_matmul = active + cfg.padded_vocab_size * cfg.d_model  # padding: real work
    share = attention_share(cfg, seq_len)
    if share == 1.0:
        return 6 * n_matmul + 12 * cfg.n_layers * cfg.q_dim * seq_len
    return 6 * n_matmul + round(12 * cfg.n_layers * share * cfg.q_dim * seq_len)
