"""Metric sinks: metrics.jsonl (always), TensorBoard (optional) and any others given
(W&B, the Prometheus endpoint: objects with write(record) and close()). Rank 0 only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tessel.observe.events import drop_partial_last_line, read_jsonl
from tessel.observe.events import json_safe as _json_safe


class MetricsWriter:
    """Writes each record to metrics.jsonl, TensorBoard and the other sinks. A sink is any
    object with `write(record: dict)` and `close()` (the one protocol W&B, Prometheus and
    tests implement)."""

    def __init__(self, path: Path, tensorboard_dir: Path | None, sinks: list[Any] | None = None):
        """`path`: the run's metrics.jsonl (RunDir.metrics); `tensorboard_dir`: where event
        files go, None for no TensorBoard."""
        self._sinks = list(sinks or [])
        # Append: a resumed run continues the same file; a reader takes the last line per step.
        drop_partial_last_line(path)
        self._jsonl = path.open("a", buffering=1)
        self._tb = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(tensorboard_dir))

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: _json_safe(v) for k, v in record.items()}
        self._jsonl.write(json.dumps(clean) + "\n")
        if self._tb is not None:
            step = int(record["step"])
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(_tb_tag(key), value, step)
        for sink in self._sinks:
            sink.write(record)

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        for sink in self._sinks:
            sink.close()




def _tb_tag(key: str) -> str:
    if key in ("loss", "val_loss", "val_ppl"):
        return f"loss/{key}"
    if key.startswith(SCORE_PREFIX):
        return key  # eval/<task>/<metric>: one TensorBoard section per task
    return f"train/{key}"


SCORE_PREFIX = "eval/"
"""Benchmark scores (lm_eval) are logged as `eval/<task>/<metric>`."""


def record_kind(rec: dict[str, Any]) -> int:
    """0: a training log step, 1: a validation loss, 2: benchmark scores (the kinds a step
    may have one record of each)."""
    if "val_loss" in rec:
        return 1
    return 2 if any(k.startswith(SCORE_PREFIX) for k in rec) else 0


def latest_per_step(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The last record per (step, kind) when a resume re-logged, in step order, and how many
    records had no integer step (skipped)."""
    latest: dict[tuple[int, int], dict[str, Any]] = {}
    bad = 0
    for rec in records:
        step = rec.get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            latest[(step, record_kind(rec))] = rec
        else:
            bad += 1
    return [latest[k] for k in sorted(latest)], bad


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl, the last one per (step, kind) when a resume re-logged;
    unreadable lines are skipped."""
    return latest_per_step(read_jsonl(path)[0])[0]
