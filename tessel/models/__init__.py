"""Model definitions only: no parallel code lives here."""

from tessel.models.presets import PRESETS
from tessel.models.transformer import (
    Transformer,
    active_param_count,
    build_model,
    flops_per_token,
    param_count,
)

__all__ = ["PRESETS", "Transformer", "active_param_count", "build_model", "flops_per_token",
           "param_count"]
