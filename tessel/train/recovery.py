"""Loss-spike and NaN recovery: detect, roll back, skip the offending data.

`SpikeDetector` judges each step's loss and gradient norm against the mean and standard
deviation of the last `window` good steps (PaLM and OPT restarted from a checkpoint before a
spike and skipped the batches around it by hand; this does it automatically). The trainer
rolls back to its latest checkpoint — every checkpoint is judged good before it is written —
and `SkipList` records the global batch that spiked so that the replay, and any later
resume, never trains on it again.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import deque
from pathlib import Path
from typing import Any

from tessel.config import RecoveryConfig
from tessel.errors import TesselError
from tessel.fileio import write_text_atomic


class RecoveryGaveUp(TesselError):
    """Spikes kept coming after max_rollbacks rollbacks (exit code 6)."""

    exit_code = 6


class TrainingDiverged(TesselError):
    """The loss or gradient norm became NaN/Inf and recovery is off: the run ends (exit
    code 6, like RecoveryGaveUp) without saving the non-finite weights."""

    exit_code = 6


def check_finite(step: int, loss: float, grad_norm: float, last_good: int | None,
                 run_dir: Path) -> None:
    """Raise TrainingDiverged unless the step's loss and gradient norm are finite."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    kept = (f"the last checkpoint (step {last_good}) holds finite weights"
            if last_good is not None and last_good >= 0 else "no checkpoint was saved")
    raise TrainingDiverged(
        f"step {step}: loss {loss:.4g}, grad norm {grad_norm:.4g} is not finite; training "
        f"diverged and nothing was saved from it ({kept}); lower optim.lr or set "
        f"recovery.spike_sigma (automatic rollback), then `tessel train --resume {run_dir}`"
    )


class SpikeDetector:
    def __init__(self, cfg: RecoveryConfig):
        self.cfg = cfg
        self.loss: deque[float] = deque(maxlen=cfg.window)
        self.grad_norm: deque[float] = deque(maxlen=cfg.window)

    def judge(self, loss: float, grad_norm: float) -> str | None:
        """Why this step is bad, or None (then its values join the window)."""
        if not math.isfinite(loss) or not math.isfinite(grad_norm):
            return f"loss {loss:.4g}, grad norm {grad_norm:.4g}: not finite"
        for name, value, hist in (("loss", loss, self.loss), ("grad norm", grad_norm, self.grad_norm)):
            if len(hist) < self.cfg.min_history:
                continue
            mean, std = statistics.fmean(hist), statistics.pstdev(hist)
            # A floor on the spread: after a long plateau the std can be ~0, and a tiny
            # wobble must not count as a many-sigma spike.
            std = max(std, 1e-3 * abs(mean), 1e-8)
            limit = mean + self.cfg.spike_sigma * std
            if value > limit:
                return (f"{name} {value:.4g} is {(value - mean) / std:.1f} sigma above the mean "
                        f"{mean:.4g} of the last {len(hist)} steps (limit {self.cfg.spike_sigma:g} sigma)")
        self.loss.append(loss)
        self.grad_norm.append(grad_norm)
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"loss": list(self.loss), "grad_norm": list(self.grad_norm)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss.clear()
        self.grad_norm.clear()
        self.loss.extend(state.get("loss", []))
        self.grad_norm.extend(state.get("grad_norm", []))


class SkipList:
    """Global batches never to train on: the config's plus those rollbacks added
    (RUN_DIR/skipped_batches.json, which also counts the rollbacks)."""

    def __init__(self, path: Path, configured: list[int], writer: bool):
        """`path`: the run's skipped_batches.json (RunDir.skipped_batches)."""
        self.path = path
        self.writer = writer
        self.records: list[dict[str, Any]] = []
        if self.path.is_file():
            try:
                self.records = json.loads(self.path.read_text())["skipped"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise TesselError(
                    f"{str(self.path)!r} is damaged; fix or delete it (it lists the batches "
                    "rollbacks skipped)"
                ) from None
        self.batches = set(configured) | {int(r["batch"]) for r in self.records}

    @property
    def rollbacks(self) -> int:
        return len(self.records)

    def pass_over(self, loader: Any, accum: int, drawn: int) -> int:
        """Draw the skipped global batches (`accum` micro-batches each) from batch `drawn`
        on out of `loader`; the number of the next one, the one to train on."""
        while drawn in self.batches:
            for _ in range(accum):
                loader.next_batch()
            drawn += 1
        return drawn

    def add(self, batch: int, step: int, reason: str, to_step: int) -> None:
        self.batches.add(batch)
        self.records.append({"batch": batch, "step": step, "reason": reason, "rolled_back_to": to_step})
        if self.writer:
            write_text_atomic(self.path, json.dumps({"skipped": self.records}, indent=1))


class Recovery:
    """Spike and NaN recovery for the trainer: judges each step and decides rollbacks.
    Every rank holds one and judges the same (all-reduced) numbers the same way."""

    def __init__(self, cfg: RecoveryConfig, skips: SkipList):
        self.cfg = cfg
        self.skips = skips
        self.spikes = SpikeDetector(cfg) if cfg.spike_sigma > 0 else None

    @property
    def enabled(self) -> bool:
        return self.spikes is not None

    def judge(self, loss: float, grad_norm: float) -> str | None:
        """Why the step just taken is bad, or None."""
        assert self.spikes is not None
        return self.spikes.judge(loss, grad_norm)

    def check_rollback(self, reason: str, bad_step: int, bad_batch: int,
                       checkpoint: Path | None, run_dir: Path) -> Path:
        """The checkpoint to roll back to, or RecoveryGaveUp (exit 6) when there is none or
        the rollbacks are used up."""
        if self.skips.rollbacks >= self.cfg.max_rollbacks:
            raise RecoveryGaveUp(
                f"step {bad_step}: {reason}; recovery.max_rollbacks={self.cfg.max_rollbacks} "
                f"rollbacks already done, giving up (last good checkpoint: {checkpoint}); "
                f"inspect the data around global batch {bad_batch} or lower optim.lr, then "
                f"`tessel train --resume {run_dir}`"
            )
        if checkpoint is None:
            raise RecoveryGaveUp(
                f"step {bad_step}: {reason}; no checkpoint to roll back to yet; lower "
                "checkpoint.interval so a good state is saved before spikes can occur"
            )
        return checkpoint

    def state_dict(self) -> dict[str, Any] | None:
        return self.spikes.state_dict() if self.spikes is not None else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.spikes is not None:
            self.spikes.load_state_dict(state)
