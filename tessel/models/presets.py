"""Named model shapes: the table lives in `tessel.config.presets` (the config layer checks
preset names without importing torch); it is re-exported here for the code that imports it
from the models. What a preset cannot express yet (deepseek-v3's attention) is said there."""

from tessel.config.presets import PRESETS

__all__ = ["PRESETS"]
