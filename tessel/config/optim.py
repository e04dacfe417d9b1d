"""The [optim] section: which optimizer trains the run, its hyper-parameters and schedule,
and the precision of its state.

Only the shape of the settings is checked here; which parameters a pattern names, and
whether the layout runs the optimizer, is checked when the model is built
(`tessel.optim.groups`, `tessel.parallel.check`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tessel.config.base import Section

MUON_ADAMW_DEFAULT = ["tok_embeddings.*", "pos_embeddings.*", "output.*", "*.router.*"]
"""The matrices AdamW keeps under Muon: the embeddings, the output layer and MoE routers."""


class OptimConfig(Section):
    name: Literal["adamw", "muon"] = "adamw"
    """`adamw`, or `muon`: Muon (momentum orthogonalised by 5 Newton-Schulz steps, Nesterov
    momentum `muon_momentum`, the update scaled by 0.2*sqrt(max(rows, cols)) so its RMS
    matches AdamW's and `lr` and `weight_decay` carry over, Moonlight's rule) for the hidden
    matrices (attention and MLP projections, each expert's matrices of an MoE layer) and AdamW
    for everything else (embeddings, output layer, norms, biases, routers: see
    `muon_adamw`). Fixed for a run: a checkpoint resumes only with the optimizer it was
    saved with."""
    state_dtype: Literal["float32", "bfloat16", "int8"] = "float32"
    """Precision of the optimizer's state: `float32`; `bfloat16` (AdamW's moments and Muon's
    momentum stored with stochastic rounding, the update in float32: half the state memory);
    `int8` (AdamW only: torchao's AdamW8bit, blockwise-quantised moments, a quarter of it;
    `pip install 'tessel[lowbit]'`). Fixed for a run."""
    muon_adamw: list[str] = Field(default_factory=lambda: list(MUON_ADAMW_DEFAULT))
    """`muon`: parameter-name patterns (fnmatch, e.g. "output.*", "layers.0.*") of matrices
    AdamW trains instead of Muon. Vectors (norms, biases) are always AdamW's."""
    muon_force: list[str] = Field(default_factory=list)
    """`muon`: parameter-name patterns Muon trains even where `muon_adamw` names them (e.g.
    ["output.weight"]); each must name at least one parameter of the model, and only matrices
    (2-D, or an MoE layer's stack of expert matrices), or the run is refused before it
    starts."""
    muon_momentum: float = Field(0.95, ge=0, lt=1)
    """`muon`: momentum of the Muon matrices (Nesterov)."""
    muon_ns_steps: int = Field(5, gt=0, le=20)
    """`muon`: Newton-Schulz iterations (quintic, coefficients 3.4445, -4.7750, 2.0315)."""
    muon_ns_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """`muon`: precision of the Newton-Schulz iterations; `auto`: bfloat16 on CUDA (as the
    reference implementations), float32 on CPU (where bfloat16 products are slow, and
    float32 keeps every parallel layout equal to one process to float32 tolerance)."""
    lr: float = Field(2e-3, gt=0, le=1)
    """Peak learning rate (AdamW's trains at 1e-4 to 1e-2; above 1 is refused as a typo)."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Final learning rate as a fraction of `lr` (cosine, linear and wsd schedules)."""
    warmup_steps: int = Field(50, ge=0)
    """Linear warm-up over this many steps: step k (1-based) uses lr * k / warmup_steps, so
    the first step already trains at lr / warmup_steps and step warmup_steps at `lr`."""
    schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    """Decay after warm-up; `wsd` holds `lr` and decays linearly over the last
    `decay_fraction` of the steps."""
    decay_fraction: float = Field(0.2, gt=0, le=1)
    """Fraction of the steps spent decaying under the `wsd` schedule."""
    weight_decay: float = Field(0.1, ge=0)
    """AdamW weight decay; never applied to norms, biases or embeddings."""
    beta1: float = Field(0.9, ge=0, lt=1)
    """AdamW beta1."""
    beta2: float = Field(0.95, ge=0, lt=1)
    """AdamW beta2."""
    eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""

    @model_validator(mode="after")
    def _check(self) -> OptimConfig:
        for pattern in (*self.muon_adamw, *self.muon_force):
            if not pattern.strip():
                raise ValueError("optim.muon_adamw/muon_force hold an empty pattern; name "
                                 'parameters such as "output.*"')
        if self.state_dtype == "int8" and self.name != "adamw":
            raise ValueError(f"optim.state_dtype = 'int8' is torchao's 8-bit AdamW, not "
                             f"{self.name!r}; use optim.state_dtype = 'bfloat16' for Muon")
        if self.name != "muon" and self.muon_force:
            raise ValueError(f"optim.muon_force is set but optim.name={self.name!r}; set "
                             'optim.name = "muon" or leave muon_force empty')
        return self
