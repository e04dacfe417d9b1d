"""Reading a run directory for the report: metrics, events, config.toml, run.json."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tessel.errors import TesselError
from tessel.observe.events import read_jsonl
from tessel.observe.metrics import latest_per_step, record_kind

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib



@dataclass
class Run:
    """Everything the report shows, read from a run directory (missing parts are None)."""

    path: Path
    train: list[dict[str, Any]]
    val: list[dict[str, Any]]
    events: list[dict[str, Any]]
    config_text: str | None
    config: dict[str, Any] | None
    run_info: dict[str, Any] | None
    run_info_text: str | None
    skipped_text: str | None
    warnings: list[str] = field(default_factory=list)
    scores: list[dict[str, Any]] = field(default_factory=list)
    """Benchmark-score records (lm_eval: `eval/<task>/<metric>` fields)."""


def read_run(run_dir: Path) -> Run:
    """Read a run directory; TesselError when it is not one."""
    if not run_dir.exists():
        raise TesselError(f"{str(run_dir)!r} does not exist; pass a run directory, e.g. runs/demo")
    if not run_dir.is_dir():
        raise TesselError(f"{str(run_dir)!r} is not a directory; pass a run directory, e.g. runs/demo")
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise TesselError(f"{str(run_dir)!r} holds no metrics.jsonl; is it a tessel run directory?")
    warnings: list[str] = []
    rows, bad = read_jsonl(metrics_path)
    if bad:
        warnings.append(f"metrics.jsonl: {bad} unreadable line(s) skipped (a write cut short by a crash?)")
    records, no_step = latest_per_step(rows)
    if no_step:
        warnings.append(f"metrics.jsonl: {no_step} record(s) without an integer step skipped")
    train = [r for r in records if record_kind(r) == 0]
    val = [r for r in records if record_kind(r) == 1]
    scores = [r for r in records if record_kind(r) == 2]

    events: list[dict[str, Any]] = []
    events_path = run_dir / "events.jsonl"
    if events_path.is_file():
        events, bad = read_jsonl(events_path)
        if bad:
            warnings.append(f"events.jsonl: {bad} unreadable line(s) skipped")

    config_text = _read_text(run_dir / "config.toml", warnings)
    config = None
    if config_text is not None:
        try:
            config = tomllib.loads(config_text)
        except tomllib.TOMLDecodeError as exc:
            warnings.append(f"config.toml is not valid TOML ({exc}); shown as it is")

    run_info_text = _read_text(run_dir / "run.json", warnings)
    run_info = None
    if run_info_text is not None:
        try:
            loaded = json.loads(run_info_text)
            run_info = loaded if isinstance(loaded, dict) else None
        except json.JSONDecodeError:
            pass
        if run_info is None:
            warnings.append("run.json does not hold a JSON object; shown as it is")

    skipped_text = None
    skipped_path = run_dir / "skipped_batches.json"
    if skipped_path.is_file():
        skipped_text = _read_text(skipped_path, warnings)
    return Run(run_dir, train, val, events, config_text, config, run_info, run_info_text,
               skipped_text, warnings, scores)


def _read_text(path: Path, warnings: list[str]) -> str | None:
    if not path.is_file():
        warnings.append(f"{path.name} is missing")
        return None
    return path.read_text(encoding="utf-8", errors="replace")


# ---- values ----------------------------------------------------------------------------------


def num(value: Any) -> float | None:
    """A metric value as a float: numbers as they are, "nan"/"inf"/"-inf" strings as the
    non-finite floats they stand for, anything else (null, missing) as None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            parsed = float(value)
        except ValueError:
            return None
        return parsed if not math.isfinite(parsed) else None
    return None


def finite(values: Iterable[float | None]) -> list[float]:
    """The finite values, in order."""
    return [v for v in values if v is not None and math.isfinite(v)]


def series(records: Sequence[dict[str, Any]], key: str) -> list[tuple[int, float | None]]:
    """(step, value) of every record that has `key` (its value as `num` reads it)."""
    return [(r["step"], num(r.get(key))) for r in records if key in r]


def event_message(event: dict[str, Any]) -> str:
    """An event's message as text ("" when it has none)."""
    message = event.get("message")
    return "" if message is None else str(message)

