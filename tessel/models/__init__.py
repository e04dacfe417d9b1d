"""Model definitions only: no parallel code lives here."""

from tessel.models.presets import PRESETS
from tessel.models.transformer import Transformer, build_model, flops_per_token, param_count

__all__ = ["PRESETS", "Transformer", "build_model", "flops_per_token", "param_count"]
