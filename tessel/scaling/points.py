"""One measured point of a scaling sweep, and how it is read from a run's metrics.jsonl.

Pure functions over records (no processes), so that the arithmetic is tested on hand-written
metrics: which records are timed (the training records after the warm-up steps), the
throughput over them, the mean step time and its split, and the efficiency against the
sweep's first measured point.
"""

from __future__ import annotations

import dataclasses
import math
import signal
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tessel.observe.metrics import record_kind
from tessel.observe.timing import PHASES

COMM_EXPOSED = "time_comm_exposed_s"
"""The metrics field of the time a rank was blocked on communication in a step (exposed
collectives, mean over the ranks; written on the steps the trainer samples, see
`metrics.comm_sample_interval`). Read when present: a run without it leaves the point's
`comm_exposed_s` None."""
COMM_TOTAL = "time_comm_s"
"""The metrics field of all communication time in a step, hidden or not (same sampling)."""
COMM_EVERY = 2
"""In a sweep's run, one step in COMM_EVERY of the profiled window after the timed steps is
profiled (`metrics.comm_sample_interval`): every step profiled in a row slowed the profile
step by step (DDP on gloo: 0.22 s to 0.29 s in 17 steps, its exposed time 9 to 45 ms)."""


def profiled_steps(steps: int) -> int:
    """The steps a sweep's run takes after its `steps` timed ones to measure communication:
    as many (rounded up to a whole number of COMM_EVERY), so about steps / COMM_EVERY
    profiled samples. Apart from the timed steps because a profiled step slows the plain
    steps around it on several processes (DDP on gloo: by up to 20%), not only itself."""
    return -(-steps // COMM_EVERY) * COMM_EVERY


@dataclass(frozen=True)
class MeasuredPoint:
    """What one short training run of a sweep measured (or why it measured nothing)."""

    nproc: int
    """Training processes the run was started with (`tessel train --nproc N`)."""
    layout: dict[str, str]
    """The parallel.* overrides the run was given (key without dashes: TOML value)."""
    global_batch_size: int
    """Sequences per optimizer step of the run: the config's under strong scaling, N times
    the config's under weak scaling."""
    run_dir: str
    """The run's directory (config.toml, metrics.jsonl; the log of the command is LOG_NAME
    inside the sweep directory beside it)."""
    steps_asked: int
    """Timed steps the sweep asked for (after the warm-up steps; the run then takes
    `profiled_steps(steps_asked)` more, for its communication)."""
    timed_steps: int = 0
    """Timed steps found in metrics.jsonl (fewer than steps_asked: see `short`)."""
    tokens_per_s: float | None = None
    """Tokens per second over all processes in the timed steps: their tokens over their
    summed step time (None when nothing was timed). Steps profiled for communication
    (slower) are left out of it, of step_time_s and of split when others were timed (a
    sweep's are after them)."""
    tokens_per_s_per_process: float | None = None
    """tokens_per_s / nproc."""
    step_time_s: float | None = None
    """Mean seconds of one timed step (the trainer's step_time_s; logging excluded)."""
    split: dict[str, float] = field(default_factory=dict)
    """Mean seconds per step in each phase the trainer times (data, compute, optimizer:
    `time_<phase>_s`), over the timed steps that logged it; they sum to at most step_time_s."""
    comm_exposed_s: float | None = None
    """Mean seconds per step the ranks were blocked on communication (COMM_EXPOSED, over the
    steps that logged it: the sampled steps after the timed ones, or among them), None when
    the run did not measure it. A part of the compute and optimizer phases, not a phase
    beside them."""
    comm_s: float | None = None
    """Mean seconds of all communication per step, hidden or not (COMM_TOTAL), or None."""
    efficiency: float | None = None
    """Scaling efficiency against the sweep's first measured point: its tokens/s per process
    over the first point's. Under strong scaling that is (tok/s_N / tok/s_1) / (N / N_1);
    under weak scaling (the same work per process) it is step_time_1 / step_time_N: both
    1.0 for perfect scaling."""
    exit_code: int | None = None
    """The command's exit code (None: not started); 128 + S when killed by signal S."""
    error: str | None = None
    """Why the point is not (fully) measured, one line: the run's error line and exit code,
    a timeout, or no timed steps. None when the run ended well."""
    wall_s: float | None = None
    """Wall-clock seconds of the whole command (start-up, data, every step, final save)."""

    @property
    def ok(self) -> bool:
        """The run ended well and measured at least one timed step."""
        return self.error is None and self.tokens_per_s is not None

    @property
    def short(self) -> bool:
        """Fewer timed steps were logged than asked (the figures cover the steps there are)."""
        return self.timed_steps < self.steps_asked

    def as_dict(self) -> dict[str, Any]:
        """The point as JSON-ready values (with `ok` and `short`)."""
        return {**dataclasses.asdict(self), "ok": self.ok, "short": self.short}


def _number(rec: dict[str, Any], key: str) -> float | None:
    """A finite, non-negative number field of a record, else None (a damaged or foreign
    metrics file is read, never trusted)."""
    value = rec.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) and value >= 0 else None


def _mean(values: Iterable[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return sum(got) / len(got) if got else None


def timed_records(records: list[dict[str, Any]], warmup: int, steps: int) -> list[dict[str, Any]]:
    """The training records of steps warmup+1 .. warmup+steps that carry a usable throughput
    and step time (validation and score records, and damaged ones, are left out)."""
    out = []
    for rec in records:
        step = rec.get("step")
        if (record_kind(rec) != 0 or not isinstance(step, int) or isinstance(step, bool)
                or not warmup < step <= warmup + steps):
            continue
        if _number(rec, "tokens_per_s") and _number(rec, "step_time_s"):
            out.append(rec)
    return out


def summarize(records: list[dict[str, Any]], warmup: int, steps: int,
              nproc: int, profiled: int = 0) -> dict[str, Any]:
    """The measured fields of a MeasuredPoint from a run's metrics records (as
    `tessel.observe.metrics.read_metrics` returns them): throughput and split from steps
    warmup+1 .. warmup+steps, communication from the profiled steps among them and among
    the `profiled` steps after them."""
    timed = timed_records(records, warmup, steps)
    if not timed:
        return {"timed_steps": 0}
    # A step profiled for its communication (it carries COMM_EXPOSED) runs slower than the
    # others: throughput, step time and split come from the unprofiled steps when there are
    # any, the communication from the profiled ones.
    plain = [r for r in timed if _number(r, COMM_EXPOSED) is None] or timed
    sampled = timed + timed_records(records, warmup + steps, profiled)
    times = [_number(r, "step_time_s") or 0.0 for r in plain]
    tokens = sum((_number(r, "tokens_per_s") or 0.0) * t for r, t in zip(plain, times))
    tps = tokens / sum(times)
    split = {p: m for p in PHASES
             if (m := _mean(_number(r, f"time_{p}_s") for r in plain)) is not None}
    return {
        "timed_steps": len(timed),
        "tokens_per_s": tps,
        "tokens_per_s_per_process": tps / nproc,
        "step_time_s": sum(times) / len(times),
        "split": split,
        "comm_exposed_s": _mean(_number(r, COMM_EXPOSED) for r in sampled),
        "comm_s": _mean(_number(r, COMM_TOTAL) for r in sampled),
    }


def with_efficiency(points: list[MeasuredPoint]) -> list[MeasuredPoint]:
    """The points with `efficiency` against the first point that ended well (1.0 there);
    points without a throughput keep None."""
    ref = next((p for p in points if p.ok), None)
    if ref is None or not ref.tokens_per_s_per_process:
        return list(points)
    return [dataclasses.replace(p, efficiency=p.tokens_per_s_per_process
                                / ref.tokens_per_s_per_process)
            if p.tokens_per_s_per_process is not None else p for p in points]


def error_line(output: str, exit_code: int) -> str:
    """One line saying why a `tessel train` command failed, from its output: tessel's own
    error line when there is one (torchrun's traceback around it is noise), else torchrun's
    summary of the failed worker, else the last line; with the exit code."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line.removeprefix("tessel: error: ") for line in lines
              if line.startswith("tessel: error: ")]
    # else the last of tessel's other lines ("tessel: stopped by SIGTERM ..."), of torchrun's
    # "exitcode : -9 (pid: ...)", or of anything
    picks = (errors[:1] or [line for line in lines if line.startswith("tessel: ")][-1:]
             or [line for line in lines if line.startswith("exitcode")][-1:] or lines[-1:])
    how = f"exit code {exit_code}"
    if exit_code > 128:
        try:
            how = f"killed by {signal.Signals(exit_code - 128).name}, {how}"
        except ValueError:  # not a signal's number: an exit code of its own
            pass
    text = picks[0] if picks else "no output"
    return f"{text[:400]} ({how})"
