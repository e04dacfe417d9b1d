"""The parts of Mistral and Gemma that Llama lacks, each behind a `model.*` field that is off
by default: RMSNorm with (1 + weight) (`model.norm_offset`), the embedding scale, soft-capped
logits, and the RoPE table of the local (sliding-window) layers. The sliding-window masks
themselves are built with the others in `tessel.models.attention.attention_mask`."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # the config imports the presets from this package
    from tessel.config import ModelConfig


class OffsetRMSNorm(nn.RMSNorm):
    """Gemma's RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + weight), computed in float32 and
    cast back at the end (transformers' Gemma3RMSNorm: (x * w).to(dtype), not
    x.to(dtype) * w as Llama). A subclass of nn.RMSNorm so that every placement of norms
    (sequence parallelism, FSDP, the probes) treats it as one; the weight starts at 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


def rms_norm(dim: int, cfg: ModelConfig) -> nn.RMSNorm:
    """An RMSNorm over `dim` with the model's epsilon, with (1 + weight) under
    model.norm_offset."""
    return (OffsetRMSNorm if cfg.norm_offset else nn.RMSNorm)(dim, eps=cfg.norm_eps)


def scale_embeddings(h: torch.Tensor, d_model: int) -> torch.Tensor:
    """h * sqrt(d_model), the factor rounded to float32 and then to h's dtype, as
    transformers' Gemma3TextScaledWordEmbedding does (bfloat16: sqrt(3072) is 55.5)."""
    factor = torch.tensor(math.sqrt(d_model), dtype=torch.float32, device=h.device)
    return h * factor.to(h.dtype)


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap), in transformers' order of operations (Gemma 2)."""
    return torch.tanh(logits / cap) * cap


def uses_local_table(cfg: ModelConfig) -> bool:
    """Whether the local layers have a RoPE table of their own (model.rope_local_theta)."""
    return (cfg.position == "rope" and cfg.rope_local_theta is not None
            and any(cfg.is_local_layer(i) for i in range(cfg.n_layers)))


def window_flops_share(window: int | None, seq_len: int) -> float:
    """The share of a causal layer's attention work a sliding window leaves: the keys its
    queries see, sum over positions p = 1..seq_len of min(window, p), over the causal
    layer's sum of p (1 without a window, or with one at least seq_len long)."""
    if window is None or window >= seq_len:
        return 1.0
    full = seq_len * (seq_len + 1) / 2
    seen = window * (window + 1) / 2 + (seq_len - window) * window
    return seen / full


def attention_share(cfg: ModelConfig, seq_len: int) -> float:
    """The mean over the model's layers of `window_flops_share`: the share of causal
    attention work its layers do at `seq_len` (1 with no local layer)."""
    if cfg.sliding_window is None:  # no local layer (asked per candidate by the planner)
        return 1.0
    local = sum(cfg.is_local_layer(i) for i in range(cfg.n_layers))
    if not local:
        return 1.0
    share = window_flops_share(cfg.sliding_window, seq_len)
    return (cfg.n_layers - local + local * share) / cfg.n_layers
