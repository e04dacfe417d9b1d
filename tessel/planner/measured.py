"""A measured run, for calibrating a hardware profile: its config, world size and tokens/s.

Two sources:
- a run directory of `tessel train`: config.toml, run.json (world size, written at start)
  and metrics.jsonl; throughput is the median of the logged tokens/s, leaving out the first
  WARMUP_RECORDS records (compilation and allocator warm-up);
- a JSON file with at least {"tokens_per_s": float, "world_size": int, "config": {...}}
  (the resolved config as `tessel config` prints it; what `tessel bench --json` writes).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from tessel.config import Config, read_saved, with_saved_defaults
from tessel.errors import TesselError

WARMUP_RECORDS = 2


@dataclass(frozen=True)
class MeasuredRun:
    config: Config
    world_size: int
    tokens_per_s: float
    source: str


def read_measured(path: Path) -> MeasuredRun:
    if path.is_dir():
        return _from_run_dir(path)
    if path.is_file():
        return _from_json(path)
    raise TesselError(f"--calibrate {str(path)!r}: no such run directory or JSON file")


def _from_run_dir(run: Path) -> MeasuredRun:
    from tessel.observe.metrics import read_metrics

    for name in ("config.toml", "run.json", "metrics.jsonl"):
        if not (run / name).is_file():
            raise TesselError(f"--calibrate {str(run)!r}: not a tessel run directory (no {name})")
    cfg = Config.from_dict(read_saved(run / "config.toml"))
    info = read_json_object(run / "run.json")
    rates = [r["tokens_per_s"] for r in read_metrics(run / "metrics.jsonl") if "tokens_per_s" in r]
    if len(rates) <= WARMUP_RECORDS:
        raise TesselError(
            f"--calibrate {str(run)!r}: {len(rates)} throughput records; calibration needs more "
            f"than {WARMUP_RECORDS} (train longer or log more often: metrics.log_interval)"
        )
    world = _positive_int(info.get("world_size"), run / "run.json", "world_size")
    return MeasuredRun(cfg, world, statistics.median(rates[WARMUP_RECORDS:]), str(run))


def _from_json(path: Path) -> MeasuredRun:
    data = read_json_object(path)
    if not isinstance(data.get("config"), dict):
        raise TesselError(f"--calibrate {str(path)!r}: no 'config' object (the resolved config)")
    tps = data.get("tokens_per_s")
    if not isinstance(tps, (int, float)) or tps <= 0:
        raise TesselError(f"--calibrate {str(path)!r}: 'tokens_per_s' must be a positive number")
    world = _positive_int(data.get("world_size"), path, "world_size")
    cfg = Config.from_dict(with_saved_defaults(data["config"]))  # saved: old keys as old
    return MeasuredRun(cfg, world, float(tps), str(path))


def read_json_object(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TesselError(f"cannot read {str(path)!r}: {exc}") from None
    if not isinstance(data, dict):
        raise TesselError(f"{str(path)!r} does not hold a JSON object")
    return data


def _positive_int(value: object, where: Path, key: str) -> int:
    if not isinstance(value, int) or value < 1:
        raise TesselError(f"{str(where)!r}: {key!r} must be a whole number >= 1")
    return value
