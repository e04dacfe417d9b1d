"""The one registry of a run's stateful parts: what a checkpoint saves, what a resume and a
spike rollback restore, and what a replica group hands a recovering peer
(tessel.train.replicas) are the same parts, so a part added here travels every way.

The parts, each with `state_dict()` / `load_state_dict()`: the model and the optimizer
(tensors: a checkpoint's DCP files, the `model` and `optim` of a peer's state), and, as
numbers, strings and containers only (a checkpoint's state.json, a peer's weights-only
transfer): the counters (the step, and with it the learning-rate schedule, a function of the
step; the tokens seen, the batches drawn, the last validation loss, the training time so
far), the data position (the loader's place in the one global order) and, when the run has
them, the spike detector's history, the alert rules' memory and the fp16 loss scale.
"""

from __future__ import annotations

import time
from typing import Any, Protocol


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class Counters:
    """How far the run is: optimizer steps, tokens seen, global batches drawn (the skipped
    ones count), the last validation loss and the training time of every start so far."""

    KEYS = ("step", "tokens_seen", "batches_drawn", "elapsed_s", "val_loss")

    def __init__(self) -> None:
        self.step = self.tokens_seen = self.batches_drawn = 0
        self.val_loss: float | None = None
        self.elapsed_prev = 0.0  # training time before this start's
        self.clock_start: float | None = None  # when this start's training began

    def start_clock(self) -> float:
        self.clock_start = time.perf_counter()
        return self.clock_start

    def elapsed_s(self) -> float:
        """The run's training time so far: its earlier starts' and this one's (once its
        training started)."""
        now = time.perf_counter() - self.clock_start if self.clock_start is not None else 0.0
        return self.elapsed_prev + now

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen,
                "batches_drawn": self.batches_drawn, "elapsed_s": self.elapsed_s(),
                "val_loss": self.val_loss}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A missing step or tokens count raises KeyError."""
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.batches_drawn = int(state.get("batches_drawn", self.step))
        self.val_loss = state.get("val_loss")
        self.elapsed_prev = 0.0
        self.elapsed_prev = float(state.get("elapsed_s", 0.0)) - self.elapsed_s()  # from now


class Each:
    """A list of stateful objects (a model's pipeline stages, their optimizers) as one part."""

    def __init__(self, items: list[Any]):
        self.items = items

    def state_dict(self) -> list[Any]:
        return [item.state_dict() for item in self.items]

    def load_state_dict(self, state: list[Any]) -> None:
        for item, part in zip(self.items, state, strict=True):
            item.load_state_dict(part)


_REQUIRED = object()
# state.json's keys in the order tessel has always written them
_ORDER = ("step", "tokens_seen", "batches_drawn", "loader", "elapsed_s", "val_loss", "recovery",
          "alerts", "scaler")


class RunState:
    """The run's stateful parts by name. `models` and `optimizers` are the tensors (saved by
    the checkpoint store, restored by CheckpointManager.restore); the others are the JSON
    state. Parts load in the order they were added: the loader first, so that data other
    than the run's is refused before anything changed."""

    def __init__(self, models: list[Any], optimizers: list[Any]):
        self.models, self.optimizers = models, optimizers
        self.parts: list[tuple[str | None, Stateful, Any]] = []

    def add(self, key: str | None, part: Stateful, default: Any = _REQUIRED) -> None:
        """Register `part` under `key` (None: its keys sit at the top level, the counters');
        `default`: what it loads from a state without `key` or with an empty one (none given:
        a KeyError), or None to leave it as it is."""
        self.parts.append((key, part, default))

    def state_dict(self) -> dict[str, Any]:
        """The JSON parts as they are now."""
        state: dict[str, Any] = {}
        for key, part, _ in self.parts:
            if key is None:
                state.update(part.state_dict())
            else:
                state[key] = part.state_dict()
        return {**{k: state.pop(k) for k in _ORDER if k in state}, **state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the JSON parts those of `state` (from `state_dict`). A missing step, tokens
        count or data position raises KeyError; data other than the run's, the loader's
        one-line DataError; the callers say where the state came from."""
        for key, part, default in self.parts:
            if key is None:
                part.load_state_dict(state)
            elif state.get(key) or default is _REQUIRED:
                part.load_state_dict(state[key])
            elif default is not None:
                part.load_state_dict(default)

    def peer_state(self) -> dict[str, Any]:
        """Everything, for a recovering replica group: the weights, the optimizer state and
        the JSON parts (what a checkpoint saves)."""
        return {"model": Each(self.models).state_dict(),
                "optim": Each(self.optimizers).state_dict(), "trainer": self.state_dict()}

    def load_peer_state(self, state: dict[str, Any]) -> None:
        Each(self.models).load_state_dict(state["model"])
        Each(self.optimizers).load_state_dict(state["optim"])
        self.load_state_dict(state["trainer"])


def counter(name: str) -> property:
    """`Counters.<name>` as an attribute of the object holding them in `counters`."""
    return property(lambda self: getattr(self.counters, name),
                    lambda self, value: setattr(self.counters, name, value))
