"""Predicted strong and weak scaling (`tessel scale`): the planner's best layout at each GPU
count of a sweep, with tokens/s per GPU, MFU, scaling efficiency against the first point,
the step time split into compute and each kind of exposed communication, and memory.

Strong scaling holds the model and the global batch fixed; weak scaling holds the batch per
GPU fixed (the global batch grows with the GPU count), optionally with a bigger model at
each point. Efficiency is model FLOP/s per GPU at a point over that at the first point that
has a layout (MFU ratio): for one model this is the ratio of tokens/s per GPU, which under
strong scaling is (throughput ratio) / (GPU ratio); with a model per point (weak scaling as
Megatron-LM tabulates it) tokens of different models are not comparable but FLOPs are.

Each point is searched by `search.search`, the search `tessel plan` runs; a point where no
layout fits carries the reason instead and the sweep goes on. The JSON record of a point
(`point_record`) keeps the prediction under `predicted`, and under `measured` what a real
run of the same layout measured (`tessel scale --measure`, tessel.scaling), else null.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tessel.config import Config
from tessel.errors import TesselError
from tessel.planner.hardware import GpuProfile
from tessel.planner.memory import GIB
from tessel.planner.report import ASSUMPTIONS, columns, no_fit_headline, profile_text
from tessel.planner.search import Plan, candidates, precision_for, search
from tessel.planner.speed import StepTime

SCHEMA = 1
STRONG, WEAK = "strong", "weak"
EFFICIENCY = ("model FLOP/s per GPU over that of the first point with a layout (the MFU "
              "ratio); for one model, tokens/s per GPU over the first point's, which under "
              "strong scaling is (tokens/s ratio) / (GPU ratio)")

# The step split: JSON key, table heading, the StepTime field. Their sum is the step time.
SPLIT = (
    ("compute_s", "compute", "compute_s"),
    ("dp_exposed_s", "dp exposed", "dp_comm_s"),
    ("tp_s", "tp", "tp_comm_s"),
    ("pp_bubble_s", "pp bubble", "bubble_s"),
    ("pp_send_s", "pp send", "pp_comm_s"),
    ("cp_s", "cp", "cp_comm_s"),
    ("ep_all_to_all_s", "ep all-to-all", "ep_comm_s"),
    ("optimizer_s", "optimizer", "optimizer_s"),
    ("offload_s", "offload", "offload_s"),
)
# The parts that are communication a rank waits for (not the bubble: idle, not waiting on
# a link).
COMMUNICATION = ("dp_exposed_s", "tp_s", "pp_send_s", "cp_s", "ep_all_to_all_s")


@dataclass(frozen=True)
class Point:
    """One GPU count of a sweep: its config (model, global batch) and the planner's best
    layout, or why there is none."""

    gpus: int
    config: Config
    plan: Plan | None
    reason: str | None = None
    closest: Plan | None = None
    """Without a plan: the layout closest to fitting (least memory short), if any."""


@dataclass(frozen=True)
class Sweep:
    """A scaling study: the planner's best layout at each GPU count (`tessel scale`), with
    what real runs measured where it measured them (a measured record read back for
    calibration is `tessel.planner.sweep_fit.MeasuredSweep`)."""

    mode: str
    hw: GpuProfile
    points: list[Point]
    config_path: str | None = None
    device_type: str = "cuda"
    """The device the points run on ("cpu": `tessel scale --measure` on CPU processes): the
    precision `auto` resolves to follows it."""
    measured: dict[int, dict[str, Any]] = field(default_factory=dict)
    """`tessel scale --measure`: what each process count's real run measured
    (`tessel.scaling.points.MeasuredPoint.as_dict()`), by count; empty when predicted only."""

    @property
    def baseline(self) -> Point | None:
        """The point efficiencies are measured against: the first with a layout."""
        return next((p for p in self.points if p.plan is not None), None)

    def efficiency(self, point: Point) -> float | None:
        base = self.baseline
        if point.plan is None or base is None or base.plan is None:
            return None
        return point.plan.mfu / base.plan.mfu


def global_batches(batch: int, gpus: list[int], mode: str) -> list[int]:
    """The global batch at each GPU count: `batch` throughout (strong), or `batch` at the
    first count and as many sequences per GPU at the others (weak)."""
    if mode == STRONG:
        return [batch] * len(gpus)
    out = []
    for n in gpus:
        if (batch * n) % gpus[0]:
            raise TesselError(
                f"--weak: {batch} sequences on {gpus[0]} GPUs is {batch / gpus[0]:g} per GPU, "
                f"which is not a whole global batch on {n} GPUs ({batch * n / gpus[0]:g}); "
                "choose GPU counts that are multiples of the first, or another "
                "--train.global_batch_size")
        out.append(batch * n // gpus[0])
    return out


def check_splits(points: list[tuple[int, Config]], hw: GpuProfile) -> None:
    """Refuse (one line) a GPU count no layout can split the global batch over: every
    layout's data-parallel degree must divide the batch, and the model bounds the rest
    (tp within a node and dividing the key/value heads, pp up to the layers, cp only for
    long sequences). Cheap (no layout is evaluated), so a sweep fails before it starts."""
    for gpus, cfg in points:
        if not candidates(cfg, gpus, hw):
            batch = cfg.train.global_batch_size
            raise TesselError(
                f"no layout of {gpus:,} GPUs splits a global batch of {batch:,} sequences of "
                "this model: the data-parallel degree must divide the batch (leaving each "
                "pipeline at least as many sequences as stages) and the other GPUs be tensor "
                f"(<= {hw.gpus_per_node}, dividing the {cfg.model.n_kv_heads} key/value heads), "
                f"pipeline (<= {cfg.model.n_layers} layers) or context parallel; choose other "
                "--gpus or a larger --train.global_batch_size")


def run_sweep(points: list[tuple[int, Config]], hw: GpuProfile, mode: str,
              config_path: str | None = None, progress: Any = None) -> Sweep:
    """Search each (GPU count, config) point; `progress(gpus)` is called before each."""
    check_splits(points, hw)
    out = []
    for gpus, cfg in points:
        if progress is not None:
            progress(gpus)
        result = search(cfg, gpus, hw, keep=1)
        if result.plans:
            out.append(Point(gpus, cfg, result.plans[0]))
        else:
            out.append(Point(gpus, cfg, None, no_fit_headline(result),
                             result.too_big[0] if result.too_big else None))
    return Sweep(mode, hw, out, config_path, hw.device_type)


def split(step: StepTime) -> dict[str, float]:
    """The step time in parts (seconds) that add up to it."""
    return {key: getattr(step, field) for key, _, field in SPLIT}


def predicted(sweep: Sweep, point: Point) -> dict[str, Any] | None:
    """The planner's figures of a point with a layout (None without one)."""
    p = point.plan
    if p is None:
        return None
    parts = split(p.step)
    comm = sum(parts[k] for k in COMMUNICATION)
    return {
        "tokens_per_s": p.tokens_per_s,
        "tokens_per_s_per_gpu": p.tokens_per_s / point.gpus,
        "mfu": p.mfu,
        "efficiency": sweep.efficiency(point),
        "step_time_s": p.step.total,
        "split_s": parts,
        "communication_s": comm,
        "communication_share": comm / p.step.total,
        "raw_communication_s": p.step.raw_comm_s,
        "memory_gib": p.memory.gib(),
    }


def point_record(sweep: Sweep, point: Point) -> dict[str, Any]:
    """The JSON object of one point (docs/scaling.md describes every field)."""
    from tessel.models import param_count

    t, p = point.config.train, point.plan
    closest = None
    if point.closest is not None:
        closest = {"layout": point.closest.layout.short(),
                   "memory_gib": round(point.closest.memory.total / GIB, 3),
                   "shortfall_gib": round(point.closest.shortfall_gib, 3)}
    return {
        "gpus": point.gpus,
        "model": point.config.model.preset,
        "parameters": param_count(point.config.model),
        "global_batch_size": t.global_batch_size,
        "batch_per_gpu": t.global_batch_size / point.gpus,
        "tokens_per_step": t.global_batch_size * t.seq_len,
        "fits": p is not None,
        "reason": point.reason,
        "closest": closest,
        "layout": None if p is None else p.layout.short(),
        "parallel": None if p is None else p.layout.overrides(),
        "predicted": predicted(sweep, point),
        "measured": sweep.measured.get(point.gpus),
    }


def as_json(sweep: Sweep) -> dict[str, Any]:
    first = sweep.points[0].config
    base = sweep.baseline
    hw = sweep.hw
    return {
        "schema": SCHEMA,
        "mode": sweep.mode,
        "config": sweep.config_path,
        "gpu": {"name": hw.name, "bf16_tflops": hw.bf16_flops / 1e12,
                "memory_gib": hw.memory_gib, "gpus_per_node": hw.gpus_per_node},
        "seq_len": first.train.seq_len,
        "precision": precision_for(first, sweep.device_type),
        "baseline_gpus": None if base is None else base.gpus,
        "efficiency": EFFICIENCY,
        "points": [point_record(sweep, p) for p in sweep.points],
        "assumptions": ASSUMPTIONS,
    }


# ---- the table ------------------------------------------------------------------------------


def header(sweep: Sweep) -> str:
    from tessel.models import param_count

    first = sweep.points[0].config
    hw = sweep.hw
    models = list(dict.fromkeys(p.config.model.preset or "custom" for p in sweep.points))
    if len(models) == 1:
        what = f"{models[0]} ({param_count(first.model) / 1e9:.2f}B parameters)"
    else:
        what = "models " + ", ".join(models)
    batch = (f"global batch {first.train.global_batch_size:,} at every point"
             if sweep.mode == STRONG else
             f"{first.train.global_batch_size / sweep.points[0].gpus:g} sequences per "
             f"{rank_word(sweep.device_type)}")
    return (f"tessel scale: {sweep.mode} scaling of {what} on {hw.name} "
            f"({profile_text(hw, sweep.device_type)}), seq {first.train.seq_len}, {batch}, "
            f"{precision_for(first, sweep.device_type)}")


def rank_word(device_type: str) -> str:
    """What a point counts: GPUs, or processes on CPU processes."""
    return "GPU" if device_type == "cuda" else "process"


def _closest_text(point: Point, device_type: str) -> str:
    c = point.closest
    if c is None:
        return ""
    return f" (closest: {c.layout.short()}, {short_by(c.shortfall_gib, rank_word(device_type))})"


def short_by(gib: float, rank: str = "GPU") -> str:
    """`1.4 GiB per GPU short`; two significant figures below 1 GiB, so that a near miss
    does not read `0.0`."""
    return f"{gib:.1f} GiB per {rank} short" if gib >= 1 else f"{gib:.2g} GiB per {rank} short"


def seconds(value: float) -> str:
    """Four significant figures (0.2639, 12.72, 156.0), without an exponent down to 0.1 ms."""
    return f"{value:#.4g}" if value == 0 or value >= 1e-4 else f"{value:.1e}"


def text(sweep: Sweep) -> str:
    """The table `tessel scale` prints: one row per point, then the step split; on CPU
    processes per process and against the profile's peak (not per GPU, not MFU)."""
    cuda = sweep.device_type == "cuda"
    count = "GPUs" if cuda else "procs"
    lines = [header(sweep), "", *_rows(sweep, count)]
    planned = [(p.gpus, p.plan.step) for p in sweep.points if p.plan is not None]
    if planned:
        # The parts some point has (compute always), each column as wide as its heading.
        cols = [(k, h, max(len(h), 8)) for k, h, _ in SPLIT
                if k == "compute_s" or any(split(step)[k] for _, step in planned)]
        lines += ["", "step time split, seconds (communication: the part compute does not "
                      "hide; comm: its share of the step):",
                  f"{count:>6}  {'step':>8} " + " ".join(f"{h:>{w}s}" for _, h, w in cols)
                  + f" {'comm':>6}"]
        for gpus, step in planned:
            parts = split(step)
            comm = sum(parts[k] for k in COMMUNICATION) / step.total
            lines.append(f"{gpus:>6,}  {seconds(step.total):>8} "
                         + " ".join(f"{seconds(parts[k]):>{w}s}" for k, _, w in cols)
                         + f" {comm:6.1%}")
    base, rank = sweep.baseline, rank_word(sweep.device_type)
    ratio = "MFU" if cuda else f"model FLOP/s per {rank}"
    lines += ["", f"efficiency: {ratio} over the first point's (for one model, tokens/s per "
                  f"{rank} over the first point's; 1 is linear scaling)"
              + (f"; baseline: the {base.gpus:,}-{rank} point" if base is not None
                 else "; no point has a layout")]
    return "\n".join(lines) + "\n"


def _rows(sweep: Sweep, count: str) -> list[str]:
    """The table's heading and a row per point."""
    efficiency = {p.gpus: sweep.efficiency(p) for p in sweep.points}
    model = max(len(p.config.model.preset or "custom") for p in sweep.points)
    layout = max([len(p.plan.layout.short()) for p in sweep.points if p.plan] + [6])
    memory, used = columns(sweep.device_type)
    per = "tokens/s/GPU" if sweep.device_type == "cuda" else "tokens/s/proc"
    mem_w, per_w, used_w = max(len(memory), 7), max(len(per), 12), max(len(used), 6)
    lines = [f"{count:>6}  {'model':{model}s} {'batch':>7}  {'layout':{layout}s} "
             f"{memory:>{mem_w}} {'step s':>8} {per:>{per_w}} {used:>{used_w}} "
             f"{'efficiency':>10}"]
    for p in sweep.points:
        head = (f"{p.gpus:>6,}  {p.config.model.preset or 'custom':{model}s} "
                f"{p.config.train.global_batch_size:>7,}  ")
        if p.plan is None:
            lines.append(head + f"- {p.reason}{_closest_text(p, sweep.device_type)}")
            continue
        q = p.plan
        lines.append(head + f"{q.layout.short():{layout}s} {q.memory.total / GIB:{mem_w}.1f} "
                            f"{seconds(q.step.total):>8} {q.tokens_per_s / p.gpus:{per_w},.0f} "
                            f"{q.mfu:{used_w}.1%} {efficiency[p.gpus]:10.2f}")
    return lines
