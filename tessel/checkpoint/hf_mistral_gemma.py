"""Mistral (`MistralForCausalLM`) and Gemma 3's text model (`Gemma3ForCausalLM`) to and from
transformers: the sliding-window architectures.

- Mistral is Llama's layout and names with `sliding_window` (every layer local when set).
- Gemma 3 (model_type "gemma3_text") has Llama's projections (q/k rows permuted per head
  between HF's rotate-half RoPE and tessel's pairs, QK-norm weights per head likewise), four
  norms per layer (input, post-attention, pre- and post-feed-forward: tessel's
  `norm_placement = "sandwich"`), RMSNorms of x * (1 + weight) (`norm_offset`, stored as HF
  stores them), GeGLU, embeddings scaled by sqrt(hidden_size), the query scale
  query_pre_attn_scalar ** -0.5, local layers (`layer_types`) with their own RoPE base
  (rope_local_base_freq) and global ones with rope_theta and its linear scaling.

What tessel cannot represent exactly is refused in one line naming the field: attention
logit soft-capping (tessel's kernels take no score modification), bidirectional attention,
attention biases or dropout, other activations or RoPE scalings, a vision tower
(`Gemma3ForConditionalGeneration`, model_type "gemma3").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tessel.checkpoint.hf_arch import HFError, Llama, get_field, require_value

if TYPE_CHECKING:
    from tessel.config import ModelConfig

GLOBAL, LOCAL = "full_attention", "sliding_attention"


class Mistral(Llama):
    model_type = "mistral"
    hf_class = "MistralForCausalLM"
    windows = True

    def model_fields(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        if hf.get("layer_types") is not None:
            raise HFError(f"{where}: layer_types is not read by MistralForCausalLM (every "
                          "layer uses sliding_window); drop it from config.json to import")
        return {**super().model_fields(hf, where), "sliding_window": hf.get("sliding_window")}

    def hf_config(self, m: ModelConfig) -> dict[str, Any]:
        if m.moe_experts or m.qk_norm:
            raise HFError("model: only dense models without QK-norm export as "
                          "MistralForCausalLM")
        return {**self.decoder_config(m), "intermediate_size": m.ffn_hidden,
                "sliding_window": m.sliding_window}


def _gemma_rope(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """The RoPE fields of a Gemma 3 config: transformers 5's rope_parameters per layer kind,
    or transformers 4's rope_theta, rope_local_base_freq and rope_scaling."""
    params = hf.get("rope_parameters") or {}
    if GLOBAL in params or LOCAL in params:
        full, local = dict(params.get(GLOBAL) or {}), dict(params.get(LOCAL) or {})
    else:
        full = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 1e6)}
        local = {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", 1e4)}
    fields: dict[str, Any] = {
        "rope_theta": float(full.get("rope_theta", 1e6)),
        "rope_local_theta": float(local.get("rope_theta", 1e4)),
        "rope_scaling_factor": 1.0,
    }
    local_kind = local.get("rope_type", local.get("type", "default"))
    if local_kind != "default":
        raise HFError(f"{where}: rope scaling {local_kind!r} on the sliding-window layers is "
                      "not supported (tessel scales the global layers only)")
    kind = full.get("rope_type", full.get("type", "default"))
    if kind == "linear":
        fields.update({"rope_scaling_type": "linear", "rope_scaling_factor": float(
            get_field(full, "factor", f"{where} rope scaling"))})
    elif kind != "default":
        raise HFError(f"{where}: rope scaling {kind!r} is not supported for "
                      "Gemma3ForCausalLM (tessel supports none and 'linear')")
    return fields


def _gemma_checks(hf: dict[str, Any], where: str) -> None:
    """Refuse what a Gemma 3 text config may set that tessel does not compute."""
    require_value(hf, "hidden_activation", ("gelu_pytorch_tanh",), where, "gelu_pytorch_tanh")
    for key in ("attention_bias", "use_bidirectional_attention"):
        if hf.get(key):
            raise HFError(f"{where}: {key}=true is not supported (tessel's Gemma 3 is a causal "
                          "decoder without attention biases)")
    if hf.get("attn_logit_softcapping") is not None:
        raise HFError(f"{where}: attn_logit_softcapping={hf['attn_logit_softcapping']} is not "
                      "supported (tessel's attention kernels, SDPA and FlexAttention's block "
                      "masks, take no score soft-capping); final_logit_softcapping is")
    if float(hf.get("attention_dropout") or 0.0):
        raise HFError(f"{where}: attention_dropout={hf['attention_dropout']} cannot be carried "
                      "(tessel's model.dropout also drops the residual stream); set it to 0.0")


class Gemma3(Llama):
    model_type = "gemma3_text"
    hf_class = "Gemma3ForCausalLM"
    windows = True

    def model_fields(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        _gemma_checks(hf, where)
        layers = get_field(hf, "num_hidden_layers", where)
        kinds = hf.get("layer_types")
        if kinds is None:  # transformers 4: every sliding_window_pattern-th layer global
            pattern = int(hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6)))
            kinds = [LOCAL if (i + 1) % pattern else GLOBAL for i in range(layers)]
        if not isinstance(kinds, list) or any(k not in (GLOBAL, LOCAL) for k in kinds):
            raise HFError(f"{where}: layer_types={kinds!r}: tessel knows {GLOBAL!r} and "
                          f"{LOCAL!r} layers")
        window = hf.get("sliding_window")
        heads = get_field(hf, "num_attention_heads", where)
        softcap = hf.get("final_logit_softcapping")
        return {
            "n_layers": layers, "d_model": get_field(hf, "hidden_size", where),
            "n_heads": heads, "n_kv_heads": get_field(hf, "num_key_value_heads", where, heads),
            "head_dim": get_field(hf, "head_dim", where, 256),
            "ffn_hidden": get_field(hf, "intermediate_size", where),
            "vocab_size": get_field(hf, "vocab_size", where),
            "max_seq_len": get_field(hf, "max_position_embeddings", where, 131072),
            "position": "rope", "norm": "rmsnorm", "norm_offset": True,
            "norm_eps": float(get_field(hf, "rms_norm_eps", where, 1e-6)), "mlp": "geglu",
            "bias": False, "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
            "qk_norm": True, "norm_placement": "sandwich", "embed_scale": True,
            "query_scale": float(get_field(hf, "query_pre_attn_scalar", where, 256)) ** -0.5,
            "final_logit_softcap": float(softcap) if softcap is not None else None,
            # A window nothing uses is not carried: tessel's check wants local layers for it.
            "sliding_window": window if LOCAL in kinds else None,
            "layer_types": list(kinds) if LOCAL in kinds else None,
            **_gemma_rope(hf, where),
        }

    def hf_config(self, m: ModelConfig) -> dict[str, Any]:
        if not (m.position == "rope" and m.norm_offset and m.mlp == "geglu" and m.qk_norm
                and m.qk_norm_scope == "head" and m.norm_placement == "sandwich"
                and m.embed_scale and not m.bias and not m.qkv_bias and not m.moe_experts):
            raise HFError("model: only the Gemma 3 shape (RoPE, RMSNorm with (1 + weight), "
                          "GeGLU, per-head QK-norm, sandwich norms, scaled embeddings, no "
                          "biases, dense) exports as Gemma3ForCausalLM")
        if m.rope_scaling_factor != 1.0 and m.rope_scaling_type != "linear":
            raise HFError(f"model: rope_scaling_type={m.rope_scaling_type!r} has no place in "
                          "Gemma3ForCausalLM (linear scaling only)")
        scalar = m.query_scale ** -2 if m.query_scale is not None else m.head_dim
        kinds = [LOCAL if m.is_local_layer(i) else GLOBAL for i in range(m.n_layers)]
        return {
            "architectures": [self.hf_class], "model_type": self.model_type,
            "num_hidden_layers": m.n_layers, "hidden_size": m.d_model,
            "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads,
            "head_dim": m.head_dim, "intermediate_size": m.ffn_hidden,
            "vocab_size": m.vocab_size, "max_position_embeddings": m.max_seq_len,
            "rms_norm_eps": m.norm_eps, "hidden_activation": "gelu_pytorch_tanh",
            # query_pre_attn_scalar is an integer in every published config: written as one
            # when it is one (to 1e-9), so scaling = it ** -0.5 is tessel's query_scale.
            "query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-9
            else scalar,
            "sliding_window": m.sliding_window, "layer_types": kinds,
            "rope_theta": m.rope_theta,
            "rope_local_base_freq": (m.rope_local_theta if m.rope_local_theta is not None
                                     else m.rope_theta),
            "rope_scaling": ({"rope_type": "linear", "factor": m.rope_scaling_factor}
                             if m.rope_scaling_factor != 1.0 else None),
            "final_logit_softcapping": m.final_logit_softcap, "attn_logit_softcapping": None,
            "attention_bias": False, "attention_dropout": 0.0,
            "use_bidirectional_attention": False, "tie_word_embeddings": m.tie_embeddings,
            "initializer_range": m.init_std, "use_cache": True,
        }

    # (tessel name in block, HF name in layer, the rows' head count for q/k, else None)
    LAYER = (
        ("attention_norm.weight", "input_layernorm.weight", None),
        ("attention.wq.weight", "self_attn.q_proj.weight", "n_heads"),
        ("attention.wk.weight", "self_attn.k_proj.weight", "n_kv_heads"),
        ("attention.wv.weight", "self_attn.v_proj.weight", None),
        ("attention.wo.weight", "self_attn.o_proj.weight", None),
        ("attention.q_norm.weight", "self_attn.q_norm.weight", 1),
        ("attention.k_norm.weight", "self_attn.k_norm.weight", 1),
        ("post_attention_norm.weight", "post_attention_layernorm.weight", None),
        ("ffn_norm.weight", "pre_feedforward_layernorm.weight", None),
        ("post_ffn_norm.weight", "post_feedforward_layernorm.weight", None),
        ("feed_forward.w1.weight", "mlp.gate_proj.weight", None),
        ("feed_forward.w3.weight", "mlp.up_proj.weight", None),
        ("feed_forward.w2.weight", "mlp.down_proj.weight", None),
    )

    def layer_names(self, m: ModelConfig, i: int) -> list[tuple[str, str, Any]]:
        return [(f"layers.{i}.{t}", f"model.layers.{i}.{h}", c) for t, h, c in self.LAYER]
