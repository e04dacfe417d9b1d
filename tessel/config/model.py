"""The [model] section: the model's shape (dense, or Mixture-of-Experts with the `moe_*`
fields), its preset and the checks that run when it is built (they never touch the disk).

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
from tessel.config.presets import PRESETS


class ModelConfig(Section):
    preset: str | None = "demo"
    """Named shape (`tessel presets` lists them). It fills the shape fields below; any field
    set explicitly wins over the preset."""
    n_layers: int = Field(4, gt=0)
    """Number of transformer blocks."""
    d_model: int = Field(192, gt=0)
    """Hidden size."""
    n_heads: int = Field(6, gt=0)
    """Attention (query) heads; `d_model` must be divisible by it unless `head_dim` is set."""
    n_kv_heads: int | None = Field(None, gt=0)
    """Key/value heads: equal to `n_heads` for multi-head attention, fewer for grouped-query
    attention (must divide `n_heads`). Defaults to `n_heads`."""
    head_dim: int | None = Field(None, gt=0)
    """Width of each attention head. Defaults to d_model / n_heads; another value makes the
    query projection d_model -> n_heads x head_dim and the output projection n_heads x
    head_dim -> d_model (Qwen3: 32 heads of 128 on d_model 2048). Must be even with RoPE."""
    qk_norm: bool = False
    """RMSNorm (epsilon norm_eps, a learned weight of head_dim) over each head of the queries
    and of the keys, before the rotary embedding (Qwen3's QK-norm). Keeps attention logits
    from growing; one weight shared by all heads."""
    qk_norm_scope: Literal["head", "projection"] = "head"
    """What model.qk_norm normalises: each head of head_dim (Qwen3), or the whole query and
    key projections, n_heads x head_dim and n_kv_heads x head_dim wide with a weight of that
    width (OLMo 2). Under tensor parallelism a projection-wide norm sums its squares over
    the tp ranks' heads."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections only (Qwen2), the output projection
    and MLP without; model.bias = true puts biases everywhere instead."""
    norm_placement: Literal["pre", "post", "sandwich"] = "pre"
    """Where each block normalises: "pre" (GPT-2, Llama) the input of attention and MLP;
    "post" (OLMo 2) their outputs, before each is added to the residual stream, with no
    input norms; "sandwich" (Gemma 3) both."""
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
    mlp: Literal["gelu", "swiglu", "geglu"] = "gelu"
    """GELU MLP (GPT), gated SwiGLU (Llama) or gated GeGLU (Gemma: GELU with the tanh
    approximation on the gate)."""
    tie_embeddings: bool = True
    """Share the input embedding with the output projection."""
    bias: bool = True
    """Biases in linear layers and LayerNorm (GPT-2 style) or none (Llama style)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on embeddings, attention and residual branches."""
    init_std: float = Field(0.02, gt=0)
    """Standard deviation of the normal weight initialisation; residual output projections
    are scaled by 1/sqrt(2*n_layers) as in GPT-2."""
    sliding_window: int | None = Field(None, gt=0)
    """Sliding-window (local) attention: a local layer's query sees the last `sliding_window`
    positions, its own included (key position > query position - sliding_window, as
    transformers' Mistral and Gemma 3 mask), within its document; which layers are local:
    `layer_types` (None there: every layer, as Mistral). Windows count global positions
    under context parallelism. None = every layer attends to the whole causal prefix."""
    layer_types: list[Literal["full_attention", "sliding_attention"]] | None = None
    """Each layer's attention, in Hugging Face's words: "sliding_attention" (local, needs
    `sliding_window`) or "full_attention" (global); one entry per layer (Gemma 3: five local
    to one global). None = every layer local when `sliding_window` is set, else global."""
    rope_local_theta: float | None = Field(None, gt=0)
    """RoPE base of the local (sliding-window) layers, unscaled (Gemma 3's
    rope_local_base_freq, 10000); global layers keep `rope_theta` and its scaling. None =
    local layers use the global table."""
    rope_scaling_type: Literal["llama3", "linear"] = "llama3"
    """How `rope_scaling_factor` scales the global layers' RoPE: "llama3" (Llama 3.1's
    band-wise scaling with the low/high frequency factors) or "linear" (every frequency
    divided by the factor: positions interpolated, Gemma 3)."""
    embed_scale: bool = False
    """Multiply the token embeddings by sqrt(d_model) (Gemma), the factor rounded to the
    embedding's dtype first as transformers does (bfloat16 weights: sqrt(2560) -> 50.5)."""
    norm_offset: bool = False
    """RMSNorm computes x * (1 + weight), in float32 (Gemma): weights are stored as Hugging
    Face stores them, 0 meaning a unit scale, and start at 0. Applies to every RMSNorm of
    the model, QK-norm included. Needs model.norm = "rmsnorm"."""
    query_scale: float | None = Field(None, gt=0)
    """The factor attention scores are multiplied by; None = 1 / sqrt(head_dim). Gemma 3:
    query_pre_attn_scalar ** -0.5 (27B: 168 ** -0.5 on heads of 128)."""
    final_logit_softcap: float | None = Field(None, gt=0)
    """Soft-cap the output logits: cap * tanh(logits / cap) (Gemma 2: 30). None = off."""
    moe_experts: int = Field(0, ge=0)
    """Routed experts per Mixture-of-Experts layer; 0 = a dense model (every layer has one
    MLP). MoE layers replace the MLP with a router, these experts and the shared experts."""
    moe_top_k: int = Field(2, gt=0)
    """Routed experts each token is sent to (at most moe_experts). With top_k > 1 the chosen
    experts' scores are normalised to sum to 1 (Mixtral, Qwen3-MoE, DeepSeek-V3); with
    top_k = 1 the raw score weights the output (Switch), so the router gets a gradient."""
    moe_shared_experts: int = Field(0, ge=0)
    """Experts every token goes through besides the routed ones (DeepSeek-V3 has one): one
    dense MLP of moe_shared_experts x moe_ffn_hidden hidden units. Needs moe_experts > 0."""
    moe_ffn_hidden: int | None = Field(None, gt=0)
    """Hidden size of each expert's MLP (moe_intermediate_size in Hugging Face configs);
    defaults to ffn_hidden. Experts follow model.mlp (SwiGLU or GELU) and have no biases."""
    moe_first_dense_layers: int = Field(0, ge=0)
    """The first N layers keep a dense MLP of ffn_hidden units (DeepSeek-V3: 3)."""
    moe_every: int = Field(1, gt=0)
    """After the first dense layers, every N-th layer is an MoE layer and the others dense:
    layer i is MoE when i >= moe_first_dense_layers and (i - moe_first_dense_layers) is a
    multiple of N (1: all of them)."""
    moe_router: Literal["softmax", "sigmoid"] = "softmax"
    """Router scoring, computed in float32: softmax over the experts (Mixtral, Qwen3-MoE) or
    an independent sigmoid per expert (DeepSeek-V3)."""
    moe_aux_loss_coef: float = Field(0.01, ge=0)
    """Weight of the Switch/GShard load-balancing loss, experts x sum_i(f_i x P_i) per MoE
    layer (f_i: fraction of routed token slots sent to expert i, P_i: its mean router
    probability; 1.0 when balanced). Its gradient is added inside each MoE layer, so it
    reaches every layout, pipeline stages included. 0 = off (the value is still logged)."""
    moe_bias_update_rate: float = Field(0.0, ge=0)
    """DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the routing
    scores for the choice of experts only (never to the output weights), moved by this rate
    x sign(mean load - expert load) after each optimizer step, from the step's token counts
    over all ranks (DeepSeek-V3: 0.001). Saved in checkpoints. 0 = off."""
    moe_z_loss_coef: float = Field(0.0, ge=0)
    """Weight of the router z-loss (ST-MoE): mean over tokens of logsumexp(router logits)^2,
    which keeps the router logits small. 0 = off."""
    moe_capacity_factor: float | None = None
    """Dropless routing when unset (the default). A value c > 0 gives each expert room for
    ceil(c x tokens x top_k / experts) token slots per micro-batch; slots beyond it are
    dropped (the token keeps only its residual and shared-expert path) and counted in the
    metrics (moe_dropped_frac)."""
    init_from: str | None = None
    """Start from these weights instead of a random initialisation (a new run only): a
    Hugging Face model directory (config.json + safetensors; GPT-2, Llama, Mixtral or
    Qwen3-MoE), a directory written by `tessel convert hf-to-tessel` or `tessel checkpoint
    consolidate`, or a tessel run or checkpoint directory. Its shape fills the model fields;
    explicit ones must agree."""

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
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ValueError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                    "change model.n_heads or model.d_model, or set model.head_dim"
                )
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}; "
                "model.n_kv_heads must divide model.n_heads"
            )
        if self.qk_norm_scope != "head" and not self.qk_norm:
            raise ValueError(
                f"qk_norm_scope={self.qk_norm_scope!r} has no QK-norm to place; set "
                "model.qk_norm=true, or drop model.qk_norm_scope"
            )
        self._check_moe()
        self._check_gemma()
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(
                f"rotary embeddings need an even head dim, got {self.head_dim}; "
                "change model.n_heads or model.head_dim, or use model.position='learned'"
            )
        return self

    def _check_moe(self) -> None:
        if self.moe_experts == 0:
            if self.moe_shared_experts:
                raise ValueError(
                    f"moe_shared_experts={self.moe_shared_experts} needs routed experts; set "
                    "model.moe_experts > 0 or drop model.moe_shared_experts"
                )
            return
        if self.moe_ffn_hidden is None:
            object.__setattr__(self, "moe_ffn_hidden", self.ffn_hidden)
        if self.moe_top_k > self.moe_experts:
            raise ValueError(
                f"moe_top_k={self.moe_top_k} exceeds moe_experts={self.moe_experts}; a token "
                "cannot go to more experts than there are: lower model.moe_top_k"
            )
        if self.moe_capacity_factor is not None and self.moe_capacity_factor <= 0:
            raise ValueError(
                f"moe_capacity_factor={self.moe_capacity_factor:g} must be > 0 (e.g. 1.25), or "
                "unset for dropless routing"
            )
        if self.n_moe_layers == 0:
            raise ValueError(
                f"moe_first_dense_layers={self.moe_first_dense_layers} leaves no MoE layer "
                f"among n_layers={self.n_layers}; lower it or set model.moe_experts=0"
            )

    def _check_gemma(self) -> None:
        """Sliding windows, per-layer-kind RoPE and Gemma's conventions."""
        if self.layer_types is not None:
            if len(self.layer_types) != self.n_layers:
                raise ValueError(
                    f"model.layer_types has {len(self.layer_types)} entries for n_layers="
                    f"{self.n_layers}; give one per layer")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("model.layer_types names sliding_attention layers but "
                                 "model.sliding_window is unset; set the window")
        if self.rope_local_theta is not None and self.position != "rope":
            raise ValueError("model.rope_local_theta needs model.position = 'rope'")
        if self.mlp == "geglu" and self.moe_experts:
            raise ValueError("model.mlp = 'geglu' is for dense models (experts are SwiGLU or "
                             "GELU); set model.moe_experts = 0 or another model.mlp")
        if self.norm_offset and self.norm != "rmsnorm":
            raise ValueError("model.norm_offset needs model.norm = 'rmsnorm'; set it or drop "
                             "model.norm_offset")

    def is_local_layer(self, index: int) -> bool:
        """Whether block `index` (0-based) attends through the sliding window."""
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[index] == "sliding_attention"

    def is_moe_layer(self, index: int) -> bool:
        """Whether block `index` (0-based) has an MoE layer instead of a dense MLP."""
        first = self.moe_first_dense_layers
        return (self.moe_experts > 0 and index >= first
                and (index - first) % self.moe_every == 0)

    def moe_layers_between(self, start: int, stop: int) -> int:
        """How many of blocks start..stop-1 are MoE layers (`is_moe_layer`), counted, not
        tested one by one (the planner asks this for every stage of every candidate)."""
        if self.moe_experts <= 0:
            return 0
        first, every = self.moe_first_dense_layers, self.moe_every
        k = max(start, first)
        k += -(k - first) % every  # the first MoE layer at or after `start`
        return 0 if k >= stop else (stop - 1 - k) // every + 1

    @property
    def n_moe_layers(self) -> int:
        return self.moe_layers_between(0, self.n_layers)

    @property
    def q_dim(self) -> int:
        """Width of the queries (and of the attention output): n_heads x head_dim."""
        assert self.head_dim is not None
        return self.n_heads * self.head_dim

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and output projection (a multiple of vocab_pad_to)."""
        return -(-self.vocab_size // self.vocab_pad_to) * self.vocab_pad_to


# What weights fix (other model fields, e.g. dropout, may differ from the source's).
SHAPE_FIELDS = {
    "n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "qk_norm", "vocab_size",
    "qk_norm_scope", "qkv_bias", "norm_placement",
    "ffn_hidden", "position", "norm", "mlp", "tie_embeddings", "bias", "rope_theta",
    "rope_scaling_factor", "rope_scaling_type", "sliding_window", "layer_types",
    "rope_local_theta", "embed_scale", "norm_offset", "query_scale", "final_logit_softcap",
    "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_seq_len",
    "moe_experts", "moe_shared_experts", "moe_ffn_hidden", "moe_first_dense_layers", "moe_every",
}
