"""Whether a run may start or resume in its directory, and from which checkpoint.

Nothing here writes: a refused start leaves the run directory as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tessel.checkpoint import CheckpointError, read_state
from tessel.checkpoint.run_config import config_change, saved_config
from tessel.config import Config
from tessel.data import load_tokenizer
from tessel.errors import DataError, TesselError
from tessel.train.control import EXIT_PAUSED
from tessel.train.run_dir import RunDir


class RunHalted(TesselError):
    """--auto-resume on a run that paused or stopped on purpose; exits with its code."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def resume_point(run: RunDir, cfg: Config, resume: bool, auto_resume: bool,
                 say: Callable[[str], None]) -> tuple[Path, dict[str, Any]] | None:
    """Refuse to overwrite a run, or to resume one incompatibly; the checkpoint to resume
    from and its state, or None to start from step 0."""
    if not resume:
        if run.holds_run():
            raise TesselError(
                f"{str(run.path)!r} already holds a run; continue it with "
                f"`tessel train --resume {run.path}` or choose another --run.dir"
            )
        return None
    if not run.holds_run():
        raise CheckpointError(f"nothing to resume: {str(run.path)!r} holds no run")
    halted = run.halted()
    if halted is not None and auto_resume:
        raise RunHalted(
            f"{run.path} {halted.get('message', 'was halted')}; not resuming it "
            f"automatically: continue it with `tessel train --resume {run.path}`",
            int(halted.get("exit_code", EXIT_PAUSED)),
        )
    ckpt = run.latest_checkpoint()
    if ckpt is None:  # stopped before its first checkpoint: start it again from step 0
        say(f"tessel: {run.path} has no checkpoint yet; starting from step 0")
        return None
    state = read_state(ckpt)
    change = config_change(saved_config(ckpt, state), cfg)
    if change is not None:
        key, difference = change
        # another optimizer has no state to resume: it starts from the weights
        fresh = (" (from its weights: model.init_from = a checkpoint of it)"
                 if key.startswith("optim.") else "")
        raise CheckpointError(
            f"cannot resume {str(run.path)!r}: {difference}; resume "
            f"without changing it or start a new run{fresh}"
        )
    return ckpt, state


def check_tokenizer(run: RunDir, tokenizer: Any) -> None:
    """The data's tokenizer must be the one the run was trained with."""
    saved = load_tokenizer(run.tokenizer)
    if saved.fingerprint() != tokenizer.fingerprint():
        raise DataError(
            f"the data's tokenizer differs from the one {str(run.path)!r} was trained "
            "with; resume with the data the run was started with"
        )
