"""The Hugging Face architectures tessel converts, by `model_type`, and the one a tessel
model exports as. The mappings themselves: `hf_arch` (GPT-2, Llama), `hf_moe` (Mixtral,
Qwen3-MoE), `hf_qwen_olmo` (Qwen2, Qwen3, OLMo 2), `hf_mistral_gemma` (Mistral, Gemma 3)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tessel.checkpoint.hf_arch import GPT2, Architecture, HFError, Llama
from tessel.checkpoint.hf_mistral_gemma import Gemma3, Mistral
from tessel.checkpoint.hf_moe import Mixtral, Qwen3Moe
from tessel.checkpoint.hf_qwen_olmo import Olmo2, Qwen2, Qwen3
from tessel.config import ConfigError

if TYPE_CHECKING:
    from tessel.config import Config, ModelConfig

ARCHITECTURES: dict[str, Architecture] = {
    a.model_type: a for a in (GPT2(), Llama(), Mixtral(), Qwen3Moe(), Qwen2(), Qwen3(),
                              Olmo2(), Mistral(), Gemma3())}

REFUSED = {
    "gemma3": "Gemma3ForConditionalGeneration has a vision tower, which tessel does not "
              "train; convert its text model (Gemma3ForCausalLM, model_type 'gemma3_text')",
}
"""model_types refused with a reason of their own (the others: 'unsupported')."""


def for_hf_config(hf: dict[str, Any], where: str) -> Architecture:
    kind = hf.get("model_type")
    if kind in REFUSED:
        raise HFError(f"{where}: {REFUSED[kind]}")
    if kind not in ARCHITECTURES:
        archs = hf.get("architectures") or []
        raise HFError(
            f"{where}: unsupported architecture {kind or archs!r}; tessel converts "
            f"{', '.join(a.hf_class for a in ARCHITECTURES.values())}"
        )
    return ARCHITECTURES[kind]


def for_model(m: ModelConfig) -> Architecture:
    """GPT-2 for the learned-position GELU shape, Llama for the RoPE SwiGLU one; a dense
    model with per-head QK-norm as Qwen3, with projection-wide QK-norm or norms after the
    sub-layers as OLMo 2, with q/k/v biases alone as Qwen2; Gemma's conventions (GeGLU,
    (1 + weight) norms, scaled embeddings) as Gemma 3, a sliding window else as Mistral;
    an MoE model as Qwen3-MoE with QK-norm (Qwen3 has it, Mixtral not), else as Mixtral.
    Each refuses in `hf_config` the shapes it cannot hold."""
    if m.moe_experts:
        return ARCHITECTURES["qwen3_moe" if m.qk_norm else "mixtral"]
    if m.mlp == "geglu" or m.norm_offset or m.embed_scale:  # Gemma's conventions
        return ARCHITECTURES["gemma3_text"]
    if m.sliding_window is not None and not m.qk_norm and m.norm_placement == "pre":
        return ARCHITECTURES["mistral"]
    if m.qk_norm:  # per head: Qwen3; over each projection: OLMo 2
        return ARCHITECTURES["qwen3" if m.qk_norm_scope == "head" else "olmo2"]
    if m.norm_placement == "post":
        return ARCHITECTURES["olmo2"]
    if m.qkv_bias and not m.bias:
        return ARCHITECTURES["qwen2"]
    return ARCHITECTURES["llama" if m.position == "rope" else "gpt2"]


def check_export(cfg: Config) -> None:
    """Refuse (ConfigError, one line) `checkpoint.hf_export_interval` for a model no Hugging Face
    architecture holds, or whose balancing bias it would drop unasked: at load time
    (`tessel.load_config`) and at the trainer's start, before anything is written, rather
    than in every export of the run. (The config layer knows no architectures.)"""
    m = cfg.model
    if not cfg.checkpoint.hf_export_interval:
        return
    try:
        arch = for_model(m)
        arch.hf_config(m)
    except HFError as exc:
        raise ConfigError(f"invalid config: checkpoint.hf_export_interval: {exc}; set it to 0"
                          ) from None
    if m.moe_experts and m.moe_bias_update_rate and not cfg.checkpoint.hf_export_drop_expert_bias:
        raise ConfigError(
            f"invalid config: checkpoint.hf_export_interval: model.moe_bias_update_rate="
            f"{m.moe_bias_update_rate} trains a balancing bias that {arch.hf_class} has no place "
            "for, so its copies would route tokens to other experts; set "
            "checkpoint.hf_export_drop_expert_bias = true to export without it, or "
            "checkpoint.hf_export_interval = 0")
