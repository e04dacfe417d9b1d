"""Calibrating a hardware profile on a measured scaling sweep (`tessel plan --calibrate
SWEEP.json`, the JSON of `tessel scale --measure --json`, e.g. taken on a real cluster).

One measured run fixes one unknown: the matmul efficiency, fitted on the sweep's first
measured point (its smallest world, where communication weighs least). The other points
fix the communication: one factor that stretches every collective's time (the link
bandwidths' efficiency divided by it, each call's latency, the measured curve of a call's
time and the ranks' drift multiplied by it) is fitted so that the planner's predictions of
those points are, in the geometric mean, what they measured. Each point is predicted for its
own run's config and layout, which the sweep's JSON records (`config`, the resolved config
as `tessel config` prints it). A sweep measured on CPU processes carries the profile it
measured (`measurement.profile`); one taken on GPUs is fitted on the profile the command
names (--gpu).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tessel.config import Config, with_saved_defaults
from tessel.errors import TesselError
from tessel.planner.cpu import stretched
from tessel.planner.hardware import (
    CALIBRATION_LIMITS,
    GpuProfile,
    calibrate,
    calibrate_optimizer,
    efficiency_ceiling,
    limit_note,
    profile_from_table,
)
from tessel.planner.layout import Layout
from tessel.planner.measured import checked_rate, checked_world
from tessel.planner.search import Plan

COMM_FACTORS = (0.05, 20.0)
"""The range searched for the communication factor (slower or faster than the profile says)."""
SEARCH_STEPS = 60
"""Geometric bisection steps of that search."""


@dataclass(frozen=True)
class SweepRun:
    """One measured point of a sweep: its run's config, processes and throughput."""

    config: Config
    world: int
    tokens_per_s: float
    optimizer_s: float | None = None
    """The measured optimizer phase per step (None: not recorded)."""


@dataclass(frozen=True)
class MeasuredSweep:
    """What a measured sweep's record holds for calibration: the runs that measured a
    throughput (not `tessel.planner.scaling.Sweep`, the planner's predicted study)."""

    runs: list[SweepRun]
    """The points that measured a throughput, in the sweep's order."""
    profile: GpuProfile | None
    """The profile the sweep measured on CPU processes (None: taken on GPUs)."""
    device_type: str
    """"cpu" or "cuda": the precision the planner assumes for the runs."""


def is_sweep(data: dict[str, Any]) -> bool:
    """Whether a JSON object is the record of `tessel scale --measure --json`."""
    return isinstance(data.get("measurement"), dict) and isinstance(data.get("points"), list)


def read_sweep(data: dict[str, Any], where: str) -> MeasuredSweep:
    """The measured points of a sweep record; one line naming what is wrong otherwise."""
    m = data["measurement"]
    device_type = m.get("device_type", "cpu" if m.get("machine") else "cuda")
    if device_type not in ("cpu", "cuda"):
        raise TesselError(f"{where}: measurement.device_type must be 'cpu' or 'cuda'")
    profile = None
    if m.get("profile") is not None:
        name = data.get("gpu", {}).get("name") if isinstance(data.get("gpu"), dict) else None
        try:
            profile = profile_from_table(str(name or "measured"), m["profile"])
        except TesselError as exc:
            raise TesselError(f"{where}: measurement.profile: {exc}") from None
    runs = []
    for i, point in enumerate(data["points"]):
        measured = point.get("measured") if isinstance(point, dict) else None
        if not isinstance(measured, dict) or measured.get("tokens_per_s") is None:
            continue  # a point that failed or was not measured
        tps = checked_rate(measured["tokens_per_s"], where, f"points[{i}].measured.tokens_per_s")
        world = checked_world(point.get("gpus"), where, f"points[{i}].gpus")
        if not isinstance(point.get("config"), dict):
            raise TesselError(f"{where}: points[{i}] has no 'config' (the run's resolved "
                              "config); measure the sweep again with this tessel version")
        try:
            cfg = Config.from_dict(with_saved_defaults(point["config"]))
        except TesselError as exc:
            raise TesselError(f"{where}: points[{i}].config: {exc}") from None
        try:
            Layout.from_config(cfg, world)
        except TesselError as exc:
            raise TesselError(f"{where}: points[{i}]: the run's config on its {world} processes: "
                              f"{exc}") from None
        split = measured.get("split")
        opt = split.get("optimizer") if isinstance(split, dict) else None
        usable = (isinstance(opt, (int, float)) and not isinstance(opt, bool)
                  and math.isfinite(opt) and opt > 0)
        runs.append(SweepRun(cfg, world, tps, float(opt) if usable else None))
    if not runs:
        raise TesselError(f"{where}: no point of the sweep measured a throughput; nothing "
                          "to calibrate on")
    return MeasuredSweep(runs, profile, device_type)


def _stretched(hw: GpuProfile, factor: float) -> GpuProfile:
    """All communication `factor` times slower: the link's efficiency, each call's latency
    and the CPU terms that are communication (`tessel.planner.cpu.stretched`)."""
    return dataclasses.replace(stretched(hw, factor),
                               comm_efficiency=min(hw.comm_efficiency / factor,
                                                   efficiency_ceiling(hw)),
                               collective_latency_s=hw.collective_latency_s * factor)


def fit(hw: GpuProfile, sweep: MeasuredSweep,
        plan: Callable[[Config, Layout, GpuProfile, str], Plan]) -> tuple[GpuProfile, str]:
    """The profile calibrated on the sweep, and one line saying what was fitted.
    `plan(config, layout, profile, device_type)` is the planner's evaluation of a layout."""
    def predict(cfg: Config, layout: Layout, h: GpuProfile, device_type: str) -> float:
        return plan(cfg, layout, h, device_type).tokens_per_s

    runs = sorted(sweep.runs, key=lambda r: r.world)
    first = runs[0]
    first_layout = Layout.from_config(first.config, first.world)
    cpu = sweep.device_type == "cpu"
    optimizer_said = ""
    if cpu and first.optimizer_s:
        # On CPU processes the optimizer's rate is fitted on its measured phase first (see
        # calibrate_optimizer); a GPU's update is bound by the memory bandwidth it has.
        hw = calibrate_optimizer(
            hw, lambda h: plan(first.config, first_layout, h, sweep.device_type)
            .step.optimizer_s, first.optimizer_s)
        optimizer_said = f", optimizer memory rate {hw.hbm_gbps:.4g} GB/s"
    floor, ceiling = CALIBRATION_LIMITS[sweep.device_type]
    hw = calibrate(hw, lambda h: predict(first.config, first_layout, h, sweep.device_type),
                   first.tokens_per_s, floor, ceiling)
    said = (f"matmul efficiency {hw.matmul_efficiency:.4g}"
            f"{limit_note(hw.matmul_efficiency, floor, ceiling)} (from {first.world} process(es): "
            f"{first.tokens_per_s:,.0f} tokens/s{optimizer_said})")
    others = [(r, Layout.from_config(r.config, r.world)) for r in runs[1:] if r.world > 1]
    if not others:
        return hw, said + "; no multi-process point: communication not fitted"

    def log_error(factor: float) -> float:
        """Mean log(predicted / measured) over the multi-process points: rises with the
        factor's inverse (more communication time, lower predictions)."""
        h = _stretched(hw, factor)
        return sum(math.log(predict(r.config, lay, h, sweep.device_type) / r.tokens_per_s)
                   for r, lay in others) / len(others)

    fastest = max(COMM_FACTORS[0],  # (a GPU's comm efficiency stays <= 1: its links' rate)
                  hw.comm_efficiency / efficiency_ceiling(hw))
    factor = _root(log_error, fastest, COMM_FACTORS[1])
    tuned = _stretched(hw, float(f"{factor:.4g}"))
    note = limit_note(factor, COMM_FACTORS[1], fastest, "x")
    return tuned, (said + f"; communication x{factor:.3g}{note} (comm efficiency "
                   f"{tuned.comm_efficiency:.4g}, {tuned.collective_latency_s * 1e6:.4g} us per "
                   f"collective; from {len(others)} multi-process point(s))")


def _root(log_error: Callable[[float], float], lo: float, hi: float) -> float:
    """The factor in [lo, hi] where the falling `log_error` crosses 0, clamped to the ends;
    geometric bisection."""
    if log_error(lo) <= 0:
        return lo  # even with communication this fast the predictions are too low
    if log_error(hi) >= 0:
        return hi
    for _ in range(SEARCH_STEPS):
        mid = (lo * hi) ** 0.5
        if log_error(mid) > 0:
            lo = mid
        else:
            hi = mid
    return (lo * hi) ** 0.5
