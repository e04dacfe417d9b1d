"""The run's state besides the weights and the optimizer, in one list: what a checkpoint saves
and a resume or a rollback restores (tessel.train.trainer) is what a replica group hands a
recovering peer (tessel.train.replicas), so a part added here travels both ways.

The parts: the step (and with it the learning-rate schedule, a function of the step), the
tokens seen, the batches drawn, the data position (the loader's place in the one global
order), the training time so far, the last validation loss, and, when the run has them, the
spike detector's history, the alert rules' memory and the fp16 loss scale. Each is numbers,
strings and containers only (a checkpoint's state.json, a peer's weights-only transfer).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tessel.train.trainer import Trainer


def elapsed_s(tr: Trainer) -> float:
    """The run's training time so far: its earlier starts' and this one's (once training
    started: `Trainer.clock_start`)."""
    now = time.perf_counter() - tr.clock_start if tr.clock_start is not None else 0.0
    return tr.elapsed_prev + now


def run_state(tr: Trainer) -> dict[str, Any]:
    """The trainer's parts of the run's state, as they are now."""
    state: dict[str, Any] = {
        "step": tr.step,
        "tokens_seen": tr.tokens_seen,
        "batches_drawn": tr.batches_drawn,
        "loader": tr.data.train.state_dict(),
        "elapsed_s": elapsed_s(tr),
        "val_loss": tr.last_val_loss,
    }
    if tr.recovery.enabled:
        state["recovery"] = tr.recovery.state_dict()
    if tr.alerts is not None:
        state["alerts"] = tr.alerts.rules.state_dict()
    if tr.precision.scaler is not None:
        state["scaler"] = tr.precision.scaler.state_dict()
    return state


def load_run_state(tr: Trainer, state: dict[str, Any]) -> None:
    """Make the trainer's parts those of `state` (from `run_state`). A missing step, tokens
    count or data position raises KeyError; data other than the run's, the loader's one-line
    DataError; the callers say where the state came from."""
    tr.data.train.load_state_dict(state["loader"])
    if tr.precision.scaler is not None and state.get("scaler"):
        tr.precision.scaler.load_state_dict(state["scaler"])
    tr.step = int(state["step"])
    tr.tokens_seen = int(state["tokens_seen"])
    tr.batches_drawn = int(state.get("batches_drawn", tr.step))
    tr.last_val_loss = state.get("val_loss")
    tr.elapsed_prev = 0.0
    tr.elapsed_prev = float(state.get("elapsed_s", 0.0)) - elapsed_s(tr)  # from now on
    tr.recovery.load_state_dict(state.get("recovery", {}))
    if tr.alerts is not None:
        tr.alerts.rules.load_state_dict(state.get("alerts", []))
