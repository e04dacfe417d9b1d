"""What `Trainer.train()` returns: how far the run got, its last losses, why it stopped and
the process exit code that says so."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tessel.train.control import EXIT_SCORING_FAILED, exit_code_for


@dataclass
class TrainResult:
    step: int
    """Optimizer steps completed."""
    loss: float | None
    """Training loss of the last step."""
    val_loss: float | None
    """Validation loss of the last evaluation."""
    unigram_baseline: float
    """Validation loss of a context-free unigram model, for comparison."""
    stopped_by: str | None
    """Why training stopped early: a signal name (SIGTERM, SIGUSR1, SIGINT), "pause" or
    "stop" (an alert's action), else None."""
    run_dir: Path
    scoring_failure: str | None = None
    """Why lm_eval benchmark scoring failed during the run (there were no scores from then
    on), else None. A run that finished anyway exits with code 7."""

    @property
    def exit_code(self) -> int:
        if self.stopped_by is None and self.scoring_failure is not None:
            return EXIT_SCORING_FAILED
        return exit_code_for(self.stopped_by)
