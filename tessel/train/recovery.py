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

    def __init__(self, run_dir: Path, configured: list[int], writer: bool):
        self.path = run_dir / "skipped_batches.json"
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

    def add(self, batch: int, step: int, reason: str, to_step: int) -> None:
        self.batches.add(batch)
        self.records.append({"batch": batch, "step": step, "reason": reason, "rolled_back_to": to_step})
        if self.writer:
            write_text_atomic(self.path, json.dumps({"skipped": self.records}, indent=1))
