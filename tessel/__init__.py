"""tessel: train GPT- and Llama-shaped language models, from one CPU to many GPUs.

Notebook use::

    from tessel import Config, Trainer
    cfg = Config.load("configs/tiny.toml", {"train.steps": 50, "run.dir": "runs/nb"})
    result = Trainer(cfg).train()

`tessel.load_config(path, overrides)` is `Config.load` with the model's shape read from the
weights of `model.init_from` (what `tessel train` loads for a new run).
"""

from tessel.checkpoint.init_from import load_config
from tessel.config import Config, ConfigError
from tessel.errors import TesselError
from tessel.train import Trainer, TrainResult

__version__ = "0.1.0"
__all__ = ["Config", "ConfigError", "TesselError", "TrainResult", "Trainer", "__version__",
           "load_config"]
