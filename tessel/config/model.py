"""The [model] section: the model's shape, its preset and the checks that run when it is
built (they never touch the disk).

The fields fixed by the weights of `model.init_from` come in through the validation context
(see `ModelConfig._apply_preset`); `SHAPE_FIELDS` are the ones such weights fix.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, ValidationInfo, model_validator

from tessel.config.base import Section
from tessel.config.load import INIT_FIELDS
from tessel.models.presets import PRESETS


class ModelConfig(Section):
    preset: str | None = "demo"
    """Named shape (`tessel presets` lists them). It fills the shape fields below; any field
    set explicitly wins over the preset."""
    n_layers: int = Field(4, gt=0)
    """Number of transformer blocks."""
    d_model: int = Field(192, gt=0)
    """Hidden size."""
    n_heads: int = Field(6, gt=0)
    """Attention (query) heads; `d_model` must be divisible by it."""
    n_kv_heads: int | None = Field(None, gt=0)
    """Key/value heads: equal to `n_heads` for multi-head attention, fewer for grouped-query
    attention (must divide `n_heads`). Defaults to `n_heads`."""
    vocab_size: int = Field(2048, gt=0)
    """Token ids the model predicts over; must hold every token id of the tokenizer."""
    vocab_pad_to: int = Field(128, gt=0)
    """Embedding and output rows: vocab_size rounded up to a multiple of this (Megatron's
    --make-vocab-size-divisible-by; GPT-2's 50,257 ids get 50,304 rows), so that tp divides
    them and matmuls get round sizes. The extra ids are never predicted. Independent of tp,
    so checkpoints reshard freely. 1 = no padding (runs saved before this setting)."""
    max_seq_len: int = Field(256, gt=0)
    """Longest sequence the model accepts (size of the learned position table)."""
    ffn_hidden: int | None = Field(None, gt=0)
    """MLP hidden size. Defaults to 4*d_model for GELU and to the Llama rule
    (2/3 of 4*d_model, rounded up to a multiple of 256) for SwiGLU."""
    position: Literal["learned", "rope"] = "learned"
    """Learned absolute position embeddings (GPT) or rotary embeddings (Llama)."""
    rope_theta: float = Field(10000.0, gt=0)
    """RoPE base frequency (Llama 3 uses 500000)."""
    rope_scaling_factor: float = Field(1.0, ge=1)
    """Llama 3.1's RoPE frequency scaling for long context: wavelengths above
    rope_original_max_seq_len / rope_low_freq_factor are divided by this factor, those below
    / rope_high_freq_factor kept, the band between interpolated. 1 = no scaling."""
    rope_low_freq_factor: float = Field(1.0, gt=0)
    """Llama 3 RoPE scaling: the low-frequency bound (see rope_scaling_factor)."""
    rope_high_freq_factor: float = Field(4.0, gt=0)
    """Llama 3 RoPE scaling: the high-frequency bound (see rope_scaling_factor)."""
    rope_original_max_seq_len: int = Field(8192, gt=0)
    """Llama 3 RoPE scaling: the context length the model was first trained at."""
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    """Normalisation layer."""
    norm_eps: float = Field(1e-5, gt=0)
    """Epsilon of the normalisation layers."""
    mlp: Literal["gelu", "swiglu"] = "gelu"
    """GELU MLP (GPT) or gated SwiGLU (Llama)."""
    tie_embeddings: bool = True
    """Share the input embedding with the output projection."""
    bias: bool = True
    """Biases in linear layers and LayerNorm (GPT-2 style) or none (Llama style)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on embeddings, attention and residual branches."""
    init_std: float = Field(0.02, gt=0)
    """Standard deviation of the normal weight initialisation; residual output projections
    are scaled by 1/sqrt(2*n_layers) as in GPT-2."""
    init_from: str | None = None
    """Start from these weights instead of a random initialisation (a new run only): a
    Hugging Face model directory (config.json + safetensors; GPT-2 or Llama), a directory
    written by `tessel convert hf-to-tessel` or `tessel checkpoint consolidate`, or a tessel
    run or checkpoint directory. Its shape fills the model fields; explicit ones must agree."""

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any, info: ValidationInfo) -> Any:
        """Shape sources, weakest first: the preset, the weights of init_from (whose shape
        cannot be changed: an explicit field that disagrees is an error), explicit fields.

        The fields the weights fix are not read here (validation never touches the disk):
        whoever loads the weights passes them as the validation context's `init_fields`
        (`tessel.checkpoint.init_from.load_config`). A config that already states every
        field (a resolved config.toml, `with_overrides`) needs none."""
        if not isinstance(data, Mapping):
            return data
        init = dict((info.context or {}).get(INIT_FIELDS) or {})
        from_weights = bool(init) or (isinstance(data.get("init_from"), str)
                                      and bool(data.get("init_from")))
        default = None if from_weights else cls.model_fields["preset"].default
        name = data.get("preset", default)
        preset = {}
        if name is not None:
            if not isinstance(name, str) or name not in PRESETS:
                raise ValueError(
                    f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)} "
                    "(`tessel presets` shows them)"
                )
            preset = PRESETS[name]
        for key, value in init.items():
            if key in data and data[key] != value and key in SHAPE_FIELDS:
                raise ValueError(
                    f"model.{key}={data[key]!r} but the weights of model.init_from have "
                    f"{value!r}; drop model.{key} (init_from sets the shape)"
                )
        merged = {**preset, **init, **data}
        if from_weights and "preset" not in data:
            merged["preset"] = None
        return merged

    @model_validator(mode="after")
    def _derive_and_check(self) -> ModelConfig:
        # Fill derived fields so the resolved config.toml states every shape value.
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.ffn_hidden is None:
            if self.mlp == "gelu":
                hidden = 4 * self.d_model
            else:
                hidden = 256 * math.ceil(int(2 * 4 * self.d_model / 3) / 256)
            object.__setattr__(self, "ffn_hidden", hidden)
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                "change model.n_heads or model.d_model"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}; "
                "model.n_kv_heads must divide model.n_heads"
            )
        if self.position == "rope" and (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"rotary embeddings need an even head dim, got {self.d_model // self.n_heads}; "
                "change model.n_heads or use model.position='learned'"
            )
        return self

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and output projection (a multiple of vocab_pad_to)."""
        return -(-self.vocab_size // self.vocab_pad_to) * self.vocab_pad_to


# What weights fix (other model fields, e.g. dropout, may differ from the source's).
SHAPE_FIELDS = {
    "n_layers", "d_model", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden", "position",
    "norm", "mlp", "tie_embeddings", "bias", "rope_theta", "rope_scaling_factor",
    "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_seq_len",
}
