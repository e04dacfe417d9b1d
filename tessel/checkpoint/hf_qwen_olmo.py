"""Qwen2 (`Qwen2ForCausalLM`, Qwen2.5), Qwen3 (`Qwen3ForCausalLM`, dense) and OLMo 2
(`Olmo2ForCausalLM`): Llama's tensors and RoPE, with one change each.

- Qwen2: biases on q_proj, k_proj and v_proj (model.qkv_bias; none on o_proj or the MLP).
  The q and k biases are permuted per head like their weights' rows (RoPE pairs vs halves).
- Qwen3: QK-norm per head (model.qk_norm), its weight permuted over one head's width.
- OLMo 2: QK-norm over each whole projection (model.qk_norm_scope = "projection"), its
  weights permuted per head like the projection's rows; norms on the outputs of attention
  and MLP (`post_attention_layernorm`, `post_feedforward_layernorm`) and none on their
  inputs (model.norm_placement = "post").

What tessel cannot compute is refused in one line naming the field: sliding-window layers
(Qwen's use_sliding_window), a vision tower, biases on o_proj (attention_bias = true in Qwen3
and OLMo 2), and what Llama refuses (rope scaling other than Llama 3's, MLP biases).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tessel.checkpoint.hf_arch import HFError, Llama, get_field

if TYPE_CHECKING:
    from tessel.config import ModelConfig


def _check_text_only(hf: dict[str, Any], where: str) -> None:
    """Refuse a vision tower and sliding-window layers, which tessel's decoder lacks."""
    if hf.get("vision_config") is not None:
        raise HFError(f"{where}: vision_config: a vision tower is not supported (tessel's "
                      "decoder is text-only); import the language model's own checkpoint")
    n_layers = get_field(hf, "num_hidden_layers", where)
    types = hf.get("layer_types")
    if isinstance(types, list):
        sliding = [i for i, kind in enumerate(types) if kind != "full_attention"]
    elif hf.get("use_sliding_window") and hf.get("sliding_window") is not None:
        first = hf.get("max_window_layers", 0)
        sliding = [i for i in range(n_layers) if i >= first]
    else:
        sliding = []
    if sliding:
        raise HFError(f"{where}: sliding-window attention in layers {sliding} "
                      f"(use_sliding_window={hf.get('use_sliding_window')!r}, sliding_window="
                      f"{hf.get('sliding_window')!r}) is not supported; set "
                      "use_sliding_window to false to import")


def _full_attention(m: ModelConfig) -> dict[str, Any]:
    """Qwen's config.json keys for a model without sliding-window layers."""
    return {"use_sliding_window": False, "sliding_window": None,
            "max_window_layers": m.n_layers, "layer_types": ["full_attention"] * m.n_layers}


def _check_dense(m: ModelConfig, hf_class: str, qkv_bias: bool, qk_norm: str | None,
                 placement: str) -> None:
    """Refuse exporting a model whose attention or norms `hf_class` does not have."""
    have = (m.moe_experts == 0, m.qkv_bias and not m.bias,
            m.qk_norm_scope if m.qk_norm else None, m.norm_placement)
    want = (True, qkv_bias, qk_norm, placement)
    if have != want:
        raise HFError(
            f"model: {hf_class} is dense with qkv_bias={qkv_bias}, QK-norm "
            f"{qk_norm or 'off'} and norm_placement={placement!r}; this model has "
            f"moe_experts={m.moe_experts}, qkv_bias={m.qkv_bias} (bias={m.bias}), qk_norm="
            f"{m.qk_norm} (qk_norm_scope={m.qk_norm_scope!r}), norm_placement="
            f"{m.norm_placement!r}")


class Qwen2(Llama):
    model_type = "qwen2"
    hf_class = "Qwen2ForCausalLM"
    checks_variants = True
    QKV_BIAS = (
        ("attention.wq.bias", "self_attn.q_proj.bias", "n_heads"),
        ("attention.wk.bias", "self_attn.k_proj.bias", "n_kv_heads"),
        ("attention.wv.bias", "self_attn.v_proj.bias", None),
    )

    def model_fields(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        _check_text_only(hf, where)
        return {**super().model_fields(hf, where), "qkv_bias": True}

    def hf_config(self, m: ModelConfig) -> dict[str, Any]:
        _check_dense(m, self.hf_class, True, None, "pre")
        return {**self.decoder_config(m), "intermediate_size": m.ffn_hidden,
                **_full_attention(m)}

    def layer_names(self, m: ModelConfig, i: int) -> list[tuple[str, str, Any]]:
        return super().layer_names(m, i) + [
            (f"layers.{i}.{t}", f"model.layers.{i}.{h}", c) for t, h, c in self.QKV_BIAS]


class Qwen3(Llama):
    model_type = "qwen3"
    hf_class = "Qwen3ForCausalLM"
    checks_variants = True

    def model_fields(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        _check_text_only(hf, where)
        return {**super().model_fields(hf, where), "qk_norm": True}

    def hf_config(self, m: ModelConfig) -> dict[str, Any]:
        _check_dense(m, self.hf_class, False, "head", "pre")
        return {**self.decoder_config(m), "intermediate_size": m.ffn_hidden,
                "attention_bias": False, **_full_attention(m)}


class Olmo2(Llama):
    model_type = "olmo2"
    hf_class = "Olmo2ForCausalLM"
    checks_variants = True
    ATTENTION = (
        ("attention.wq.weight", "self_attn.q_proj.weight", "n_heads"),
        ("attention.wk.weight", "self_attn.k_proj.weight", "n_kv_heads"),
        ("attention.wv.weight", "self_attn.v_proj.weight", None),
        ("attention.wo.weight", "self_attn.o_proj.weight", None),
        ("post_attention_norm.weight", "post_attention_layernorm.weight", None),
    )
    # The whole projection's width: its rows are the heads', permuted as q_proj's and k_proj's.
    QK_NORM = (
        ("attention.q_norm.weight", "self_attn.q_norm.weight", "n_heads"),
        ("attention.k_norm.weight", "self_attn.k_norm.weight", "n_kv_heads"),
    )
    DENSE_MLP = (*Llama.DENSE_MLP,
                 ("post_ffn_norm.weight", "post_feedforward_layernorm.weight", None))

    def model_fields(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        _check_text_only(hf, where)
        return {**super().model_fields(hf, where), "qk_norm": True,
                "qk_norm_scope": "projection", "norm_placement": "post"}

    def hf_config(self, m: ModelConfig) -> dict[str, Any]:
        _check_dense(m, self.hf_class, False, "projection", "post")
        return {**self.decoder_config(m), "intermediate_size": m.ffn_hidden,
                "attention_bias": False}
