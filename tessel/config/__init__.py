"""The one typed configuration of a tessel run.

- `schema` (with `model` and `monitoring`): the sections, a docstring under every field, the
  checks run when a config is built. They never touch the disk.
- `load`: TOML files and dotted overrides, merged and validated; one-line errors.
- `reference`: the Markdown table of every key (`tessel config --reference`).
- `presets`, `lora`: data the sections check against (the named model shapes, LoRA's
  projection names). The package is the bottom layer: it imports nothing of tessel but
  `tessel.errors`, and no torch (tests/unit/test_structure.py).

The model fields that the weights of `model.init_from` fix are read by
`tessel.checkpoint.init_from.load_config` (also `tessel.load_config`), which passes them in;
`Config.load` reads only the TOML file. What needs another layer is checked there too: a
model that `checkpoint.hf_export_interval` cannot export is refused by
`tessel.checkpoint.hf_models.check_export`, which `load_config` and the trainer's pre-flight
checks run. A config tessel saved (a run directory's config.toml, a checkpoint's state) is
read with `read_saved` / `with_saved_defaults`: a key an older tessel did not write means that
tessel's behaviour, not today's default.
"""

from tessel.config.base import ConfigError, table_model
from tessel.config.fault_tolerance import FaultToleranceConfig
from tessel.config.load import parse_override_value, read_saved, read_toml, with_saved_defaults
from tessel.config.monitoring import (
    AlertCondition,
    AlertConfig,
    MetricsConfig,
    NotifyConfig,
    RecoveryConfig,
    WatchdogConfig,
)
from tessel.config.reference import reference_markdown
from tessel.config.schema import (
    SHAPE_FIELDS,
    CheckpointConfig,
    Config,
    DataConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)

__all__ = [
    "SHAPE_FIELDS", "AlertCondition", "AlertConfig", "CheckpointConfig", "Config", "ConfigError",
    "DataConfig", "FaultToleranceConfig", "LoraConfig", "MetricsConfig", "ModelConfig",
    "NotifyConfig", "OptimConfig", "ParallelConfig",
    "RecoveryConfig", "RunConfig", "TrainConfig", "WatchdogConfig", "parse_override_value",
    "read_saved", "read_toml", "reference_markdown", "table_model", "with_saved_defaults",
]
