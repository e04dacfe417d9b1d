"""The training loop and what it needs: optimizer, LR schedule, precision, loss."""

from tessel.train.trainer import Trainer, TrainResult

__all__ = ["TrainResult", "Trainer"]
