"""tessel: train GPT- and Llama-shaped language models, from one CPU to many GPUs.

Notebook use::

    from tessel import Config, Trainer
    cfg = Config.load("configs/tiny.toml", {"train.steps": 50, "run.dir": "runs/nb"})
    result = Trainer(cfg).train()

`tessel.load_config(path, overrides)` is `Config.load` with the model's shape read from the
weights of `model.init_from` (what `tessel train` loads for a new run).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
__all__ = ["Config", "ConfigError", "TesselError", "TrainResult", "Trainer", "__version__",
           "load_config"]

# Imported on first use: `python -m tessel.launch.node` (and every `tessel` command) would
# otherwise import torch and the whole trainer before doing anything (~2.5 s).
_LAZY = {"load_config": "tessel.checkpoint.init_from", "Config": "tessel.config",
         "ConfigError": "tessel.config", "TesselError": "tessel.errors",
         "Trainer": "tessel.train", "TrainResult": "tessel.train"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tessel' has no attribute {name!r}")
