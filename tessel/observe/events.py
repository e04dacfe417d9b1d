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


def drop_partial_last_line(path: Path) -> None:
    """Before appending to a .jsonl file: remove a last line that a crash cut short (no
    newline at the end), so the next record starts a line of its own instead of being glued
    to the fragment and lost with it."""
    if not path.is_file():
        return
    with path.open("rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        pos = size
        while pos > 0:  # find the last newline, reading backwards in blocks
            start = max(0, pos - 65536)
            f.seek(start)
            block = f.read(pos - start)
            cut = block.rfind(b"\n")
            if cut >= 0:
                f.truncate(start + cut + 1)
                return
            pos = start
        f.truncate(0)


class EventLog:
    def __init__(self, path: Path, enabled: bool):
        """`path`: the run's events.jsonl (RunDir.events)."""
        self.path = path
        self.enabled = enabled
        if enabled:
            drop_partial_last_line(path)

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


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects of a .jsonl file and how many lines are not one (a line cut short by
    a crash while it was appended, or written by something else): those are skipped."""
    rows, bad = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(obj, dict):
            rows.append(obj)
        else:
            bad += 1
    return rows, bad


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """The run's events; a line cut short by a crash is skipped."""
    path = run_dir / "events.jsonl"
    return read_jsonl(path)[0] if path.is_file() else []


def json_safe(value: Any) -> Any:
    """JSON has no NaN/Inf: write them as strings rather than produce invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
