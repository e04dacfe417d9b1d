"""The run's timeline: RUN_DIR/events.jsonl, one JSON object per line.

Starts, resumes and automatic restarts, alerts, rollbacks, pauses, preemptions and watchdog
firings are appended here (rank 0 only) so that `tessel report` can draw them beside the
metrics. Each line: {"time": unix seconds, "step": int, "kind": str, "message": str, ...}.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any


class EventLog:
    def __init__(self, run_dir: Path, enabled: bool):
        self.path = run_dir / "events.jsonl"
        self.enabled = enabled

    def write(self, kind: str, step: int, message: str, **extra: Any) -> None:
        if not self.enabled:
            return
        rec = {"time": time.time(), "step": step, "kind": kind, "message": message}
        rec.update({k: json_safe(v) for k, v in extra.items()})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # One write of one line, then fsync: an event survives the crash it may announce.
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a crash
            continue
    return out


def json_safe(value: Any) -> Any:
    """JSON has no NaN/Inf: write them as strings rather than produce invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
