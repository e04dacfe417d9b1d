"""The training loop and what it needs: optimizer, LR schedule, precision, loss."""

from tessel.train.result import TrainResult
from tessel.train.trainer import Trainer

__all__ = ["TrainResult", "Trainer"]
