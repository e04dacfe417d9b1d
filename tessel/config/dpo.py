"""The [dpo] section: direct preference optimisation (train.objective = "dpo"), TRL's
DPOTrainer loss over preference pairs (tessel.train.dpo, tessel.data.preference)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tessel.config.base import Section


class DpoConfig(Section):
    paths: list[str] = Field(default_factory=list)
    """JSONL (.gz/.zst too), Parquet or Arrow files, directories of them, or Hugging Face
    save_to_disk directories of preference records, read when
    train.objective = "dpo": `{"prompt", "chosen", "rejected"}` as text or as lists of
    messages, or `{"chosen", "rejected"}` with the prompt their shared beginning (TRL's
    forms). data.split splits the pairs into train and validation; data.tokenizer and
    data.chat_template are the ones used."""
    beta: float = Field(0.1, gt=0)
    """TRL's beta: how far the policy may move from the reference (the scale of the
    log-probability ratios in the loss and in rewards/*)."""
    loss: Literal["sigmoid", "ipo", "hinge", "robust"] = "sigmoid"
    """The preference loss, TRL's loss_type: `sigmoid` (DPO), `ipo` (length-normalised
    IPO), `hinge`, `robust` (with label_smoothing)."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """The assumed share of flipped labels (robust DPO only; TRL's label_smoothing)."""
    loss_weight: float = Field(1.0, ge=0)
    """Weight of the preference loss (TRL's first loss_weights entry)."""
    sft_weight: float = Field(0.0, ge=0)
    """Weight of the chosen replies' negative log-likelihood added to the loss (TRL's
    loss_type = [loss, "sft"] with loss_weights = [loss_weight, sft_weight]); 0: none."""
    reference: Literal["precomputed"] = "precomputed"
    """The reference model's log-probabilities of every pair are computed in one pass before
    the first step and kept in the run directory (reference_logps.npy), so a resume reuses
    them. The reference is the initial policy (model.init_from, or the LoRA base), or the
    model of dpo.reference_model."""
    reference_model: str = ""
    """Weights of another model as the reference (TRL's ref_model): a Hugging Face directory
    or a tessel run directory of the policy's shape, loaded in the run's layout for the
    reference pass only, then freed. Empty: the initial policy."""

    @model_validator(mode="after")
    def _weights(self) -> DpoConfig:
        if self.loss_weight == 0 and self.sft_weight == 0:
            raise ValueError("dpo.loss_weight and dpo.sft_weight are both 0: nothing to learn; "
                             "set dpo.loss_weight > 0")
        if self.label_smoothing and self.loss != "robust":
            raise ValueError(f"dpo.label_smoothing applies to dpo.loss = \"robust\" only (not "
                             f"{self.loss!r}); set it to 0 or use the robust loss")
        return self
