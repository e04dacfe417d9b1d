"""The Hugging Face architectures tessel converts, by `model_type`, and the one a tessel
model exports as. The mappings themselves: `hf_arch` (GPT-2, Llama), `hf_moe` (Mixtral,
Qwen3-MoE)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tessel.checkpoint.hf_arch import GPT2, Architecture, HFError, Llama
from tessel.checkpoint.hf_moe import Mixtral, Qwen3Moe

if TYPE_CHECKING:
    from tessel.config import ModelConfig

ARCHITECTURES: dict[str, Architecture] = {
    a.model_type: a for a in (GPT2(), Llama(), Mixtral(), Qwen3Moe())}


def for_hf_config(hf: dict[str, Any], where: str) -> Architecture:
    kind = hf.get("model_type")
    if kind not in ARCHITECTURES:
        archs = hf.get("architectures") or []
        raise HFError(
            f"{where}: unsupported architecture {kind or archs!r}; tessel converts "
            f"{', '.join(a.hf_class for a in ARCHITECTURES.values())}"
        )
    return ARCHITECTURES[kind]


def for_model(m: ModelConfig) -> Architecture:
    """GPT-2 for the learned-position GELU shape, Llama for the RoPE SwiGLU one; an MoE model
    as Qwen3-MoE with QK-norm (Qwen3 has it, Mixtral not), else as Mixtral. Each refuses in
    `hf_config` the shapes it cannot hold."""
    if m.moe_experts:
        return ARCHITECTURES["qwen3_moe" if m.qk_norm else "mixtral"]
    if m.qk_norm:
        raise HFError("model: dense models with model.qk_norm have no Hugging Face export "
                      "(Qwen3ForCausalLM is not mapped yet)")
    return ARCHITECTURES["llama" if m.position == "rope" else "gpt2"]
