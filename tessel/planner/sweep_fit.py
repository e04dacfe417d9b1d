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
from tessel.planner.hardware import (
    GpuProfile,
    calibrate,
    calibrate_optimizer,
    profile_from_table,
)
from tessel.planner.layout import Layout
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
class Sweep:
    runs: list[SweepRun]
    """The points that measured a throughput, in the sweep's order."""
    profile: GpuProfile | None
    """The profile the sweep measured on CPU processes (None: taken on GPUs)."""
    device_type: str
    """"cpu" or "cuda": the precision the planner assumes for the runs."""


def is_sweep(data: dict[str, Any]) -> bool:
    """Whether a JSON object is the record of `tessel scale --measure --json`."""
    return isinstance(data.get("measurement"), dict) and isinstance(data.get("points"), list)


def read_sweep(data: dict[str, Any], where: str) -> Sweep:
    """The measured points of a sweep record; one line naming what is wrong otherwise."""
    m = data["measurement"]
    device_type = m.get("device_type", "cpu" if m.get("machine") else "cuda")
    if device_type not in ("cpu", "cuda"):
        raise TesselError(f"{where}: measurement.device_type must be 'cpu' or 'cuda'")
    profile = None
    if m.get("profile") is not None:
        name = data.get("gpu", {}).get("name") if isinstance(data.get("gpu"), dict) else None
        profile = profile_from_table(str(name or "measured"), m["profile"])
    runs = []
    for i, point in enumerate(data["points"]):
        measured = point.get("measured") if isinstance(point, dict) else None
        if not isinstance(measured, dict) or measured.get("tokens_per_s") is None:
            continue  # a point that failed or was not measured
        tps, world = measured.get("tokens_per_s"), point.get("gpus")
        if isinstance(tps, bool) or not isinstance(tps, (int, float)) or not math.isfinite(tps) \
                or tps <= 0:
            raise TesselError(f"{where}: points[{i}].measured.tokens_per_s must be a positive "
                              "number")
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise TesselError(f"{where}: points[{i}].gpus must be a whole number >= 1")
        if not isinstance(point.get("config"), dict):
            raise TesselError(f"{where}: points[{i}] has no 'config' (the run's resolved "
                              "config); measure the sweep again with this tessel version")
        try:
            cfg = Config.from_dict(with_saved_defaults(point["config"]))
        except TesselError as exc:
            raise TesselError(f"{where}: points[{i}].config: {exc}") from None
        split = measured.get("split")
        opt = split.get("optimizer") if isinstance(split, dict) else None
        usable = (isinstance(opt, (int, float)) and not isinstance(opt, bool)
                  and math.isfinite(opt) and opt > 0)
        runs.append(SweepRun(cfg, world, float(tps), float(opt) if usable else None))
    if not runs:
        raise TesselError(f"{where}: no point of the sweep measured a throughput; nothing "
                          "to calibrate on")
    return Sweep(runs, profile, device_type)


def _stretched(hw: GpuProfile, factor: float) -> GpuProfile:
    return dataclasses.replace(hw, comm_efficiency=hw.comm_efficiency / factor,
                               collective_latency_s=hw.collective_latency_s * factor,
                               sync_drift=hw.sync_drift * factor,
                               sync_skew=hw.sync_skew * factor,
                               collective_curve=tuple((b, t * factor)
                                                      for b, t in hw.collective_curve))


def fit(hw: GpuProfile, sweep: Sweep,
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
    hw = calibrate(hw, lambda h: predict(first.config, first_layout, h, sweep.device_type),
                   first.tokens_per_s, **({"floor": 1e-4, "ceiling": 100.0} if cpu else {}))
    said = (f"matmul efficiency {hw.matmul_efficiency:.4g} (from {first.world} process(es): "
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

    lo, hi = COMM_FACTORS
    if log_error(lo) <= 0:
        factor = lo  # even with communication this fast the predictions are too low
    elif log_error(hi) >= 0:
        factor = hi
    else:
        for _ in range(SEARCH_STEPS):
            mid = (lo * hi) ** 0.5
            if log_error(mid) > 0:
                lo = mid
            else:
                hi = mid
        factor = (lo * hi) ** 0.5
    tuned = _stretched(hw, float(f"{factor:.4g}"))
    return tuned, (said + f"; communication x{factor:.3g} (comm efficiency "
                   f"{tuned.comm_efficiency:.4g}, {tuned.collective_latency_s * 1e6:.4g} us per "
                   f"collective; from {len(others)} multi-process point(s))")
