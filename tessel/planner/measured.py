"""A measured run, for calibrating a hardware profile: its config, world size and tokens/s.

Two sources:
- a run directory of `tessel train`: config.toml, run.json (world size, written at start)
  and metrics.jsonl; throughput is the median of the logged tokens/s, leaving out the first
  WARMUP_RECORDS records (compilation and allocator warm-up);
- a JSON file with at least {"tokens_per_s": float, "world_size": int, "config": {...}}
  (the resolved config as `tessel config` prints it; what `tessel bench --json` writes).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from tessel.config import Config, read_saved, with_saved_defaults
from tessel.errors import TesselError
from tessel.fileio import read_json
from tessel.planner.hardware import as_number, shown

WARMUP_RECORDS = 2
MAX_TOKENS_PER_S = 1e12
"""The largest throughput a measurement may claim (a whole cluster runs ~1e8 tokens/s)."""
MAX_WORLD = 1 << 20
"""The most processes a measured run may claim."""


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
    rates = [(i, r["tokens_per_s"]) for i, r in enumerate(read_metrics(run / "metrics.jsonl"))
             if "tokens_per_s" in r]
    if len(rates) <= WARMUP_RECORDS:
        raise TesselError(
            f"--calibrate {str(run)!r}: {len(rates)} throughput records; calibration needs more "
            f"than {WARMUP_RECORDS} (train longer or log more often: metrics.log_interval)"
        )
    world = checked_world(info.get("world_size"), f"--calibrate {str(run / 'run.json')!r}",
                          "'world_size'")
    where = f"--calibrate {str(run / 'metrics.jsonl')!r}"
    used = [checked_rate(tps, where, f"record {i}'s 'tokens_per_s'")
            for i, tps in rates[WARMUP_RECORDS:]]  # (the warm-up's may be anything)
    return MeasuredRun(cfg, world, statistics.median(used), str(run))


def _from_json(path: Path) -> MeasuredRun:
    data = read_json_object(path)
    if not isinstance(data.get("config"), dict):
        raise TesselError(f"--calibrate {str(path)!r}: no 'config' object (the resolved config)")
    where = f"--calibrate {str(path)!r}"
    tps = checked_rate(data.get("tokens_per_s"), where, "'tokens_per_s'")
    world = checked_world(data.get("world_size"), where, "'world_size'")
    cfg = Config.from_dict(with_saved_defaults(data["config"]))  # saved: old keys as old
    return MeasuredRun(cfg, world, tps, str(path))


def read_json_object(path: Path) -> dict:
    data = read_json(path, "--calibrate file")
    if not isinstance(data, dict):
        raise TesselError(f"--calibrate file {str(path)!r} does not hold a JSON object")
    return data


def checked_rate(value: object, where: str, field: str) -> float:
    """A measured tokens/s as a float, or one line naming the file (`where`) and `field`:
    nan, inf, true, <= 0 and beyond MAX_TOKENS_PER_S are no measurement."""
    x = as_number(value)
    if x is None or not 0 < x <= MAX_TOKENS_PER_S:  # nan: neither
        raise TesselError(f"{where}: {field} must be a positive number of tokens/s at most "
                          f"{MAX_TOKENS_PER_S:g}, not {shown(value)}")
    return x


def checked_world(value: object, where: str, field: str) -> int:
    """A measured run's process count, or one line naming the file and `field`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_WORLD:
        raise TesselError(f"{where}: {field} must be a whole number of processes from 1 to "
                          f"{MAX_WORLD:,}, not {shown(value)}")
    return value
