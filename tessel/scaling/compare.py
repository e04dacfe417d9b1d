"""`tessel scale --measure`: measured points beside the planner's predictions for the same
layouts.

The planner predicts for a device profile. On CPU processes there is none built in, so
`machine_profile` measures this machine as the sweep's runs use it: one process's matmul
rate and memory bandwidth with one thread (each run's process has one), gloo's all-reduce
between the sweep's largest number of local processes (latency and bus bandwidth,
`gloo.measure_gloo`) and, for a tensor-parallel sweep, the host time a DTensor block adds
(`tp_cost`). On a GPU the profile is the GPU's (`--gpu`, or the one matching the device's
name). Then the first measured point calibrates two rates: the optimizer's (the memory rate
at which the predicted optimizer step takes the measured optimizer phase) and the matmul
efficiency (the planner's prediction of the point's tokens/s equals its measurement;
`hardware.calibrate`; on a CPU a fitted factor that may exceed 1: the planner's penalty for
small matmuls is a GPU kernel's, and a CPU runs small matmuls nearer its large-matmul rate);
every other point is a prediction of the planner, and its error against the measurement is
the planner's error in scaling, not in the machine's speed.

What the planner leaves out shows up as error here: Python's time per module (in the
calibrated matmul rate, so it shrinks with the matmuls when the work is split), the
processes' competition for memory bandwidth and caches, and ranks that reach a collective
at different times (each waits for the slowest, which a noisy machine makes longer).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tessel.config import Config, ModelConfig
from tessel.planner.hardware import (
    CALIBRATION_LIMITS,
    GpuProfile,
    calibrate,
    calibrate_optimizer,
    limit_note,
)
from tessel.planner.layout import Layout
from tessel.planner.prelaunch import device_profile
from tessel.planner.scaling import Point, Sweep
from tessel.planner.search import evaluate
from tessel.planner.speed import StepTime
from tessel.scaling.points import MeasuredPoint

CPU_PROFILE = "cpu-measured"
"""Name of the profile `machine_profile` measures on a CPU."""


def _memory_bandwidth(seconds: float = 0.3) -> float:
    """Bytes/s one thread copies (read + write) through a buffer far larger than the caches."""
    src = torch.ones(16 * 2**20)  # 64 MiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        dst.copy_(src)
        reps += 1
    return 2 * src.nbytes * reps / (time.perf_counter() - t0)


def machine_profile(nproc: int, threads: int | None = 1, model: ModelConfig | None = None,
                    sequence_parallel: bool = True, drift_model: ModelConfig | None = None,
                    tokens: tuple[int, int] = (8, 128)) -> tuple[GpuProfile, dict[str, Any]]:
    """This CPU as the planner's device, for `nproc` local processes of `threads` threads
    each (None: torch's default); also what was measured, for the output. With `model`, the
    time a tensor-parallel block of it adds over `nproc` processes beyond its share of the
    compute, per micro-batch of `tokens` (sequences, positions), is measured too
    (`tessel.scaling.tp_cost`; 0 without); with `drift_model`, the ranks' drift
    is measured on that architecture's operators (`tessel.scaling.gloo.drift`)."""
    from tessel.bench import measure_matmul_peak
    from tessel.scaling.gloo import curve, measure_gloo

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        matmul = measure_matmul_peak(torch.device("cpu"), seconds=0.5)
        memory_bps = _memory_bandwidth()
    finally:
        torch.set_num_threads(before)
    gloo = None
    if nproc > 1:
        gloo = measure_gloo(nproc, tp_model=None if model is None else model.model_dump(),
                            tp_tokens=tokens,
                            sequence_parallel=sequence_parallel,
                            drift_model=None if drift_model is None else drift_model.model_dump())
    # Collectives between local processes: the fitted bus bandwidth is what they reach, so
    # the link is that and comm_efficiency 1.
    link_gbps = gloo["bandwidth_Bps"] / 1e9 if gloo else 1.0
    latency = gloo["latency_s"] if gloo else 0.0
    # This machine's memory as the trainer's pre-launch check sees it (shared by the local
    # processes), with the measured rates in place of its nominal ones. The planner runs
    # fp32 at half the BF16 rate (TF32 tensor cores); a CPU has no such split, so its "BF16
    # rate" is twice the fp32 one measured.
    profile = dataclasses.replace(
        device_profile(torch.device("cpu"), nproc), name=CPU_PROFILE,
        bf16_flops=2 * matmul["flops"], intra_node_gbps=link_gbps, inter_node_gbps=link_gbps,
        hbm_gbps=memory_bps / 1e9, comm_efficiency=1.0, collective_latency_s=latency,
        tp_block_overhead_s=float((gloo or {}).get("tp_block_overhead_s", 0.0)),
        tp_block_optimizer_s=float((gloo or {}).get("tp_block_optimizer_s", 0.0)),
        sync_drift=float((gloo or {}).get("sync_drift", 0.0)),
        sync_skew=float((gloo or {}).get("sync_skew", 0.0)),
        collective_curve=curve([(s["bytes"], s["seconds"]) for s in gloo["samples"]], nproc)
        if gloo else (), device_type="cpu")
    measured = {"matmul_flops": matmul["flops"], "matmul": f"{matmul['dtype']} {matmul['n']}^3",
                "memory_bandwidth_Bps": memory_bps, "threads": threads,
                "gloo": None if gloo is None else {
                    k: gloo[k] for k in ("nproc", "latency_s", "bandwidth_Bps", "samples",
                                         "sync_drift", "drift_piece",
                                         "sync_skew", "drift_samples", "tp_block_overhead_s",
                                         "tp_block_optimizer_s")
                    if k in gloo}}
    return profile, measured


def _run_config(point: MeasuredPoint) -> Config | None:
    path = Path(point.run_dir) / "config.toml"
    try:
        return Config.load(path) if path.is_file() else None
    except Exception:  # noqa: BLE001 (a run that failed may have left anything: not predicted)
        return None


def _plan(cfg: Config, nproc: int, hw: GpuProfile, device_type: str):  # noqa: ANN202
    return evaluate(cfg, Layout.from_config(cfg, nproc), hw, device_type)


def predict(points: Sequence[MeasuredPoint], hw: GpuProfile, device_type: str, mode: str,
            config_path: str | None, base: Config) -> tuple[Sweep, float | None]:
    """The planner's prediction of each measured point's own run (its config and layout, as
    the run recorded them), with `hw`'s matmul efficiency calibrated on the first measured
    point: (the sweep, with the measurements beside the predictions; the calibrated
    efficiency, None when no point was measured)."""
    configs = {p.nproc: _run_config(p) for p in points}
    first = next((p for p in points if p.ok and configs[p.nproc] is not None), None)
    fitted = None
    if first is not None:
        cfg = configs[first.nproc]
        assert cfg is not None and first.tokens_per_s is not None
        measured_opt = first.split.get("optimizer")
        if measured_opt and device_type == "cpu":  # a GPU's update: its memory bandwidth
            hw = calibrate_optimizer(
                hw, lambda h: _plan(cfg, first.nproc, h, device_type).step.optimizer_s,
                measured_opt)
        hw = calibrate(hw, lambda h: _plan(cfg, first.nproc, h, device_type).tokens_per_s,
                       first.tokens_per_s, *CALIBRATION_LIMITS["cpu"])
        fitted = hw.matmul_efficiency
    out = []
    for p in points:
        cfg = configs[p.nproc]
        if not p.ok or cfg is None:
            out.append(Point(p.nproc, cfg or base, None, p.error or "not measured"))
            continue
        out.append(Point(p.nproc, cfg, _plan(cfg, p.nproc, hw, device_type)))
    measured = {p.nproc: p.as_dict() for p in points}
    return Sweep(mode, hw, out, config_path, device_type, measured), fitted


def fitted_text(fitted: float | None) -> str:
    """`: matmul efficiency 0.91` for the measured table's title, saying when the fit
    stopped at a limit of its range; '' when no point was measured."""
    if fitted is None:
        return ""
    return f": matmul efficiency {fitted:.4g}{limit_note(fitted, *CALIBRATION_LIMITS['cpu'])}"


def waiting_s(step: StepTime) -> float:
    """The predicted seconds of a step that a rank spends blocked on communication, the
    counterpart of the measured exposed time: exposed collectives and pipeline sends, and
    the pipeline bubble (a stage waits for its neighbour's activations or gradients inside
    a receive, which the meter counts as communication)."""
    return (step.tp_comm_s + step.dp_comm_s + step.pp_comm_s + step.cp_comm_s
            + step.ep_comm_s + step.bubble_s)


def comparison(sweep: Sweep) -> str:
    """The measured table `tessel scale --measure` prints after the predicted one: per point
    measured throughput, efficiency, step split and exposed communication, then the
    planner's tokens/s and blocked-on-communication time for the same run, and its errors
    (predicted over measured, minus 1)."""
    rows = [f"{'procs':>5}  {'tokens/s':>9} {'per proc':>9} {'efficiency':>10} {'step s':>8} "
            f"{'data':>7} {'compute':>8} {'optimizer':>9} {'comm exp.':>9}  {'predicted':>9} "
            f"{'error':>7} {'comm':>7} {'error':>7}"]
    for point in sweep.points:
        m = sweep.measured.get(point.gpus)
        if m is None:
            continue
        if m["tokens_per_s"] is None:
            rows.append(f"{point.gpus:>5}  - {m['error']}")
            continue
        split = m["split"]

        def sec(v: float | None) -> str:
            return "-" if v is None else f"{v:.4f}"

        plan = point.plan
        predicted = plan.tokens_per_s if plan is not None else None
        error = "" if predicted is None else f"{predicted / m['tokens_per_s'] - 1:+.1%}"
        wait = waiting_s(plan.step) if plan is not None else None
        measured_wait = m["comm_exposed_s"]
        wait_error = ("" if wait is None or not measured_wait
                      else f"{wait / measured_wait - 1:+.0%}")
        rows.append(
            f"{point.gpus:>5}  {m['tokens_per_s']:9,.0f} {m['tokens_per_s_per_process']:9,.0f} "
            f"{m['efficiency'] if m['efficiency'] is not None else float('nan'):10.2f} "
            f"{m['step_time_s']:8.4f} {sec(split.get('data')):>7} {sec(split.get('compute')):>8} "
            f"{sec(split.get('optimizer')):>9} {sec(measured_wait):>9}  "
            f"{predicted if predicted is not None else float('nan'):9,.0f} {error:>7} "
            f"{sec(wait):>7} {wait_error:>7}")
    return "\n".join(rows) + "\n"
