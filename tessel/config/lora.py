"""The [lora] section, and the projection names LoRA may target: tessel's (`wq`, ...) and
Hugging Face's (`q_proj`, ...). Names only, no torch: `tessel.models.lora` attaches the
adapters and re-exports these."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from pydantic import Field, model_validator

from tessel.config.base import Section
from tessel.errors import TesselError

# tessel's projection names in a block, and where each lives.
TESSEL_TARGETS = {
    "wq": "attention.wq", "wk": "attention.wk", "wv": "attention.wv", "wo": "attention.wo",
    "w1": "feed_forward.w1", "w2": "feed_forward.w2", "w3": "feed_forward.w3",
}
# The names Hugging Face Llama models (and so peft's target_modules) use for the same ones.
HF_TARGETS = {
    "q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
    "gate_proj": "w1", "down_proj": "w2", "up_proj": "w3",
}
TESSEL_TO_HF = {v: k for k, v in HF_TARGETS.items()}


class LoraError(TesselError):
    """LoRA asked of a projection that does not exist, or adapters that do not fit."""


def resolve_targets(names: Iterable[str]) -> list[str]:
    """User target names (tessel's `wq`/`attention.wq` or HF's `q_proj`) -> tessel's short
    names, deduplicated, in tessel's order; LoraError on an unknown name."""
    out = set()
    for name in names:
        short = name.split(".")[-1] if name.startswith(("attention.", "feed_forward.")) else name
        short = HF_TARGETS.get(short, short)
        if short not in TESSEL_TARGETS or (name != short and name not in HF_TARGETS
                                           and TESSEL_TARGETS[short] != name):
            known = ", ".join(list(TESSEL_TARGETS) + list(HF_TARGETS))
            raise LoraError(f"lora.targets: no projection named {name!r}; use some of {known}")
        out.add(short)
    return [t for t in TESSEL_TARGETS if t in out]


class LoraConfig(Section):
    """Low-rank adapters (LoRA): train small matrices beside chosen projections of a frozen
    base model (model.init_from). See docs/finetuning.md."""

    enabled: bool = False
    """Train LoRA adapters instead of the whole model: every base parameter is frozen (no
    gradients, no optimizer state) and checkpoints hold only the adapters."""
    rank: int = Field(8, gt=0)
    """Rank r of each adapter pair (A: r x in, B: out x r)."""
    alpha: float = Field(16.0, gt=0)
    """Scale of the adapters' term: it is multiplied by alpha / rank (peft's lora_alpha)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input (peft's lora_dropout)."""
    targets: list[str] = ["wq", "wv"]
    """Projections of every block that get adapters: tessel's names (wq, wk, wv, wo, w1, w2,
    w3) or Hugging Face's (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)."""
    base_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype the frozen base weights of the blocks' projections are held in (bfloat16 halves
    their memory; their input is cast to it and their output back); adapters stay float32."""
    export: Literal["merged", "peft"] = "merged"
    """What checkpoint.hf_export_interval writes: a Hugging Face model with the adapters
    merged into its weights (W + alpha/rank B A), or a peft adapter directory
    (adapter_config.json + adapter_model.safetensors) for the Hugging Face base."""

    @model_validator(mode="after")
    def _check(self) -> LoraConfig:
        if self.enabled:
            if not self.targets:
                raise ValueError("lora.targets is empty; name at least one projection, e.g. "
                                 '["q_proj", "v_proj"]')
            try:
                resolve_targets(self.targets)
            except LoraError as exc:
                raise ValueError(str(exc)) from None
        return self
