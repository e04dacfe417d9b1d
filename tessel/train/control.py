"""Stop control: signals, alert actions (pause/stop) and the step-boundary agreement.

A signal (SIGTERM from a scheduler or torchrun, SIGUSR1 before a time limit, Ctrl-C) or an
alert's action reaches ranks at different moments; at every step boundary the ranks all-reduce
one small flag vector so they all stop, and checkpoint, at the same step. The same all-reduce
settles whether an asynchronous checkpoint has been written on every rank.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from tessel.errors import Stopped
from tessel.launch.node import STOPPED_EXIT_ENV
from tessel.numbers import whole_number
from tessel.observe.alerts import ACTIONS

# Exit codes of runs that end early on purpose (docs/exit-codes.md).
EXIT_INTERRUPTED, EXIT_PAUSED, EXIT_STOPPED = 130, 4, 5
# A run that finished (final checkpoint saved) but whose lm_eval scoring failed on the way.
EXIT_SCORING_FAILED = 7
# Signals that ask for a checkpoint and a clean exit: SIGTERM (schedulers, torchrun),
# SIGUSR1 (SLURM's warning before the time limit, `#SBATCH --signal=USR1@120`), SIGINT.
STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")


# Stop signals that arrived while the run was being built (before StopControl.install).
_EARLY: list[int] = []


def catch_early_signals() -> Any:
    """From process start-up until the loop installs its own handlers, remember SIGTERM and
    SIGUSR1 instead of dying of them: a scheduler's warning during a long start-up (data
    preprocessing, model building) then stops the run at its first step boundary, with a
    checkpoint, as it would later. (SIGINT keeps interrupting at once.) Returns a function
    that puts the previous handlers back."""
    previous: dict[int, Any] = {}
    for name in ("SIGTERM", "SIGUSR1"):
        if hasattr(signal, name):
            sig = getattr(signal, name)
            try:
                previous[sig] = signal.signal(sig, lambda signum, _frame: _EARLY.append(signum))
            except ValueError:  # not the main thread
                pass
    if previous and hasattr(signal, "pthread_sigmask"):
        # tessel.launch.node starts its workers with these signals blocked, so one that
        # arrives before this point waits, pending, and is delivered here, not lost
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(previous))

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _EARLY.clear()

    return restore


@contextmanager
def stop_at_once(during: str) -> Iterator[None]:
    """While `during` runs (preparing the data: before the first step, so there is no
    checkpoint to write), SIGTERM ends the command at once (`Stopped`: one line, exit code
    143) instead of waiting, as `catch_early_signals` makes it, for the first step
    boundary: a template or a tokenizer that takes hours would otherwise leave SIGKILL as the
    only way out. A SIGTERM that came earlier in the start-up stops it here. SIGUSR1 (a time
    limit's warning, with time left) still waits for the first boundary, and Ctrl-C
    interrupts at once as everywhere. Outside the main thread signals cannot be handled:
    nothing changes there."""
    if signal.SIGTERM in _EARLY:
        raise Stopped(signal.SIGTERM, during)

    def on_sigterm(signum: int, _frame: Any) -> None:
        # once: a second SIGTERM must not interrupt the clean-up of the first
        signal.signal(signal.SIGTERM, lambda *_: None)
        raise Stopped(signum, during)

    try:
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def exit_code_for(stopped_by: str | None) -> int:
    """The process exit code of a run that ended for `stopped_by` (None: it finished)."""
    if stopped_by in ("SIGTERM", "SIGUSR1"):
        # 0 (checkpoint saved), or what tessel's node launcher asks for in its workers'
        # environment, so that it can tell a run stopped early from one that finished
        code = whole_number(os.environ.get(STOPPED_EXIT_ENV, ""))
        return code if code is not None and 0 < code < 126 else 0
    return {"SIGINT": EXIT_INTERRUPTED, "pause": EXIT_PAUSED,
            "stop": EXIT_STOPPED}.get(stopped_by or "", 0)


class StopControl:
    """Whether, and why, the run stops at the next step boundary."""

    def __init__(self, distributed: bool, device_type: str, phase: Any = None):
        self.distributed = distributed
        self.device_type = device_type
        self.phase = phase or (lambda _what: None)  # the watchdog's phase marker
        self.signal: int | None = None
        self.alert_action = "continue"  # the strongest action asked for, not yet acted on
        self.save_written = True  # every rank has written the in-flight async save
        self._previous: dict[int, Any] = {}
        self._gloo: dist.ProcessGroup | None = None

    # ---- signals ------------------------------------------------------------------------

    def install(self) -> None:
        def on_signal(signum: int, _frame: Any) -> None:
            self.signal = signum
            # A second Ctrl-C interrupts at once; checkpoints stay safe (saves are atomic).
            signal.signal(signal.SIGINT, signal.default_int_handler)

        for sig in (getattr(signal, name) for name in STOP_SIGNALS if hasattr(signal, name)):
            try:
                self._previous[sig] = signal.signal(sig, on_signal)
            except ValueError:  # not the main thread (e.g. some notebook runners)
                pass
        if _EARLY and self.signal is None:
            self.signal = _EARLY[0]  # it came during start-up (catch_early_signals)
        _EARLY.clear()

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    # ---- alerts -------------------------------------------------------------------------

    def request(self, action: str) -> None:
        """Remember the strongest action an alert asked for; every rank acts on it at the
        next step boundary."""
        if ACTIONS.index(action) > ACTIONS.index(self.alert_action):
            self.alert_action = action

    # ---- the agreement ------------------------------------------------------------------

    def cpu_group(self) -> dist.ProcessGroup | None:
        """The group for small host-side collectives: the default one unless it is NCCL."""
        if self.device_type != "cuda":
            return None  # the default (gloo) group
        if self._gloo is None:
            self._gloo = dist.new_group(backend="gloo")
        return self._gloo

    def should_stop(self, written_here: bool) -> bool:
        """Whether to stop now. Under torchrun all ranks agree, so they all stop (and
        checkpoint) at the same step even if the signal reached them at different times;
        the same all-reduce settles `save_written` (publishing ends in a barrier, so the
        ranks must decide together, not each by its own thread's progress). A three-element
        all-reduce on the CPU group: no device synchronisation."""
        action = ACTIONS.index(self.alert_action)  # alerts are judged on rank 0
        if not self.distributed:
            self.save_written = written_here
            return self.signal is not None or action > 0
        flags = torch.tensor([self.signal or 0, 0 if written_here else 1, action],
                             dtype=torch.int64)
        self.phase("collective: all-reduce of the stop flags (step boundary)")
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.cpu_group())
        signum, unwritten, action = int(flags[0]), int(flags[1]), int(flags[2])
        self.save_written = not unwritten
        if signum and self.signal is None:
            self.signal = signum
        self.alert_action = ACTIONS[action]
        return bool(signum) or action > 0

    def reason(self) -> str | None:
        """A signal's name, "pause" or "stop" (an alert's action), or None."""
        if self.signal:
            return signal.Signals(self.signal).name
        if self.alert_action in ("pause", "stop"):
            return self.alert_action
        return None
