"""Measured scaling: short real training runs of one config at several process counts.

Each point is `python -m tessel train CONFIG --nproc N` (the command a user runs: torchrun
for N > 1), in its own run directory under the sweep's directory, told to take WARMUP + STEPS
steps and then `profiled_steps(STEPS)` more in which every other one is profiled for its
communication, log every step, and neither evaluate, score, checkpoint nor sample before its
last step (the end-of-run evaluation and save come after the timed steps). Its metrics.jsonl
is then read past the warm-up steps (`points.summarize`): throughput and step split from the
timed steps, which run unprofiled (a profiled step slows the plain ones around it on several
processes), exposed communication from the profiled ones. Strong scaling keeps the config's
global batch; weak scaling multiplies it by N (the config's batch is one process's). A run
that fails is reported at its point, with its one-line error, and the sweep goes on.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tessel.errors import TesselError
from tessel.scaling.points import (
    COMM_EVERY,
    MeasuredPoint,
    error_line,
    profiled_steps,
    summarize,
    with_efficiency,
)

if TYPE_CHECKING:
    from tessel.config import Config

LayoutFor = Callable[[int], Mapping[str, object]]
"""N -> the parallel.* settings of the point with N processes ({"parallel.tp": 2, ...})."""
CommandFor = Callable[[int, list[str]], list[str]]
"""(N, the `tessel train` arguments) -> the command that runs them as N processes."""

QUIET_RUN = {
    "train.eval_interval": "0",  # validation only at the end, after the timed steps
    "train.eval_iters": "1",  # and that one cheap: it is not measured
    "checkpoint.interval": "0",  # the only save is the final one, after the timed steps
    "checkpoint.hf_export_interval": "0",
    "lm_eval.tasks": "[]",  # no benchmark scores (they would run at the end)
    "run.sample_tokens": "0",  # no sample after training
    "metrics.log_interval": "1",  # one record per step: the warm-up is cut by step number
    "metrics.tensorboard": "false",  # metrics.jsonl is what is read
    # after the timed steps, one step in COMM_EVERY profiled for its exposed communication
    # (run_overrides sets where they start)
    "metrics.comm_sample_interval": str(COMM_EVERY),
}
"""Overrides of every sweep run, after the user's (they win): nothing but training steps in
the timed window, and a record per step."""
STOP_GRACE_S = 45.0
"""After SIGTERM, how long a stopped run's processes get to exit before SIGKILL: longer than
torchrun's own wait for its workers (30 s, then it kills them), so that torchrun ends them; a
torchrun killed first leaves them running (each is in a session of its own)."""
LOG_TAIL_BYTES = 65536
"""How much of a failed run's log is searched for its error line."""


PROCESSES_PER_CORE = 4
"""Local CPU processes a sweep may start per core: beyond that a point measures the scheduler
sharing the cores out, not the run (and 1,000 processes exhaust the machine's memory)."""
PROCESS_BYTES = 512 * 2**20
"""What one local CPU process takes at least (Python, torch, a tiny model: ~0.4 GiB)."""


def check_counts(cfg: Config, nprocs: Sequence[int], over: str, strong: bool,
                 local: bool) -> None:
    """Refuse, in one line and before anything starts (the machine's probe starts max(nprocs)
    processes too), counts no point can run: more data-parallel ranks than the global batch
    has sequences (strong scaling over dp or ep), expert parallelism on a model without
    experts, and, for processes all on this machine (`local`), more than its cores
    (PROCESSES_PER_CORE each) or its available memory (PROCESS_BYTES each) hold."""
    most = max(nprocs)
    if over == "ep" and most > 1 and not cfg.model.moe_experts:
        raise TesselError("--over ep spreads the processes over the experts, and this model has "
                          "none (model.moe_experts = 0, a dense model); choose --over dp, tp, pp "
                          "or cp, or an MoE model")
    if local:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        limit = PROCESSES_PER_CORE * (cores or 1)
        available = _available_memory()
        if available is not None:
            limit = min(limit, max(1, available // PROCESS_BYTES))
        if most > limit:
            memory = "" if available is None else f" and {available / 2**30:.1f} GiB available"
            raise TesselError(f"--nproc {most}: too many processes for this machine ({cores} cores"
                              f"{memory}: at most {limit}); give counts up to {limit}, or measure "
                              "inside a SLURM allocation of several nodes")
    batch = cfg.train.global_batch_size
    if strong and over in ("dp", "ep") and most > batch:
        raise TesselError(f"--nproc {most}: strong scaling over {over} splits the global batch "
                          f"of {batch} sequences over {most} data-parallel ranks; give counts "
                          f"up to {batch}, raise train.global_batch_size, or pass --weak")


def _available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def default_layout(nproc: int) -> dict[str, object]:
    """Pure data parallelism over the `nproc` processes (ZeRO stage as the config says)."""
    return {"parallel.auto": False, "parallel.dp_replicate": 1, "parallel.dp_shard": -1,
            "parallel.tp": 1, "parallel.pp": 1, "parallel.cp": 1, "parallel.ep": 1}


OVER = ("dp", "tp", "pp", "cp", "ep")
"""The parallel dimensions a sweep may spread its processes over (`layout_over`)."""


def layout_over(dim: str) -> LayoutFor:
    """All of the sweep's processes in one parallel dimension: data parallel (`dp`, the
    default layout), or tensor, pipeline, context or expert parallel of degree N."""
    if dim not in OVER:
        raise TesselError(f"cannot spread processes over {dim!r}; choose one of "
                          f"{', '.join(OVER)}")
    if dim == "dp":
        return default_layout

    def layout(nproc: int) -> dict[str, object]:
        # ep borrows the data-parallel ranks (dp_shard fills the world); the others take
        # every process.
        dp_shard = -1 if dim == "ep" else 1
        return {**default_layout(nproc), "parallel.dp_shard": dp_shard, f"parallel.{dim}": nproc}

    return layout


def point_name(nproc: int) -> str:
    """The run directory of the point with `nproc` processes, inside the sweep directory;
    its command's output goes to `<name>.log` beside it."""
    return f"nproc-{nproc}"


def override_value(value: object) -> str:
    """A value as `--key=VALUE` takes it: a string as given (TOML text or a bare word), other
    values as TOML (JSON's numbers, booleans and lists are TOML's)."""
    return value if isinstance(value, str) else json.dumps(value)


def run_overrides(global_batch: int, nproc: int, warmup: int, steps: int,
                  layout: Mapping[str, object], strong: bool, run_dir: Path) -> list[str]:
    """The overrides the sweep adds for one point (after the user's, so they win)."""
    sets = {
        **QUIET_RUN,
        "train.steps": str(warmup + steps + profiled_steps(steps)),
        "metrics.comm_sample_after": str(warmup + steps),
        "train.global_batch_size": str(global_batch if strong else global_batch * nproc),
        **{k.removeprefix("--"): override_value(v) for k, v in layout.items()},
        "run.dir": json.dumps(str(run_dir)),
    }
    return [f"--{k}={v}" for k, v in sets.items()]


def train_command(nproc: int, train_args: list[str]) -> list[str]:
    """`tessel train ARGS --nproc N` with this Python, as a user would run it."""
    return [sys.executable, "-m", "tessel", "train", *train_args, "--nproc", str(nproc)]


def check_sweep(nprocs: Sequence[int], warmup: int, steps: int, out_dir: Path) -> None:
    """Refuse, in one line, a sweep that cannot run or would overwrite earlier results."""
    if not nprocs:
        raise TesselError("no process counts to measure; give at least one, e.g. --nproc 1,2")
    bad = [n for n in nprocs if isinstance(n, bool) or not isinstance(n, int) or n < 1]
    if bad:
        raise TesselError(f"process counts must be whole numbers >= 1 (got {bad[0]!r})")
    if len(set(nprocs)) != len(nprocs):
        raise TesselError(f"process counts {list(nprocs)} repeat one; give each once")
    if warmup < 0 or steps < 1:
        raise TesselError(f"a sweep needs warm-up steps >= 0 and timed steps >= 1 (got "
                          f"{warmup} and {steps})")
    for n in nprocs:
        for path in (out_dir / point_name(n), out_dir / f"{point_name(n)}.log"):
            if path.exists():
                raise TesselError(f"{str(path)!r} exists (an earlier sweep's); choose another "
                                  "output directory or remove it")
    # where the output directory will be made: writable now, not only after the probing
    base = next(p for p in (out_dir, *out_dir.absolute().parents) if p.exists())
    try:
        if not base.is_dir():
            raise NotADirectoryError(20, "not a directory")
        tempfile.TemporaryDirectory(dir=base, prefix=".tessel-check-").cleanup()
    except OSError as exc:
        raise TesselError(f"cannot create the output directory {str(out_dir)!r}: {str(base)!r}: "
                          f"{exc.strerror or exc}; choose another (--out DIR)") from None


def measure_sweep(config_path: Path, overrides: Sequence[str], nprocs: Sequence[int],
                  out_dir: Path, warmup: int = 3, steps: int = 10,
                  layout_for: LayoutFor | None = None, strong: bool = True, *,
                  threads: int | None = 1, timeout_s: float | None = None,
                  command_for: CommandFor | None = None,
                  on_point: Callable[[MeasuredPoint], None] | None = None) -> list[MeasuredPoint]:
    """Run the config at each process count and return one MeasuredPoint per count, in the
    order given, with efficiency against the first point that ended well.

    `overrides`: the user's `--section.key=value` overrides (below the sweep's own);
    `layout_for(N)`: the parallel.* settings at N processes (default `default_layout`);
    `strong`: keep the global batch (True) or multiply it by N (False); `threads`:
    OMP_NUM_THREADS of every process (1: each CPU process is one "device", as torchrun sets
    for N > 1; None: the environment's); `timeout_s`: per run, then its processes are
    stopped and the point says so; `command_for(N, args)`: how N processes are started
    (default `train_command`); `on_point(point)`: called as each point is measured (its
    efficiency is not known yet). Raises TesselError only for bad input, before any run."""
    from tessel.checkpoint.init_from import load_config

    out_dir = Path(out_dir)
    check_sweep(nprocs, warmup, steps, out_dir)
    cfg = load_config(config_path, list(overrides))  # a bad config: one line, nothing run
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TesselError(f"cannot create {str(out_dir)!r}: {exc.strerror or exc}") from None
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    points = []
    for n in nprocs:
        run_dir = out_dir / point_name(n)
        layout = {k.removeprefix("--"): override_value(v)
                  for k, v in (layout_for or default_layout)(n).items()}
        args = [str(config_path), "--quiet", *overrides,
                *run_overrides(cfg.train.global_batch_size, n, warmup, steps, layout, strong,
                               run_dir)]
        point = MeasuredPoint(n, layout, cfg.train.global_batch_size * (1 if strong else n),
                              str(run_dir), steps)
        point = measure_point(point, (command_for or train_command)(n, args), env,
                              out_dir / f"{point_name(n)}.log", warmup, timeout_s)
        if on_point is not None:
            on_point(point)
        points.append(point)
    return with_efficiency(points)


def measure_point(point: MeasuredPoint, command: list[str], env: Mapping[str, str],
                  log: Path, warmup: int, timeout_s: float | None) -> MeasuredPoint:
    """Run one point's command (output to `log`) and read what its run measured."""
    import dataclasses

    from tessel.observe.metrics import read_metrics

    start = time.monotonic()
    code = run_logged(command, env, log, timeout_s)
    wall = time.monotonic() - start
    metrics = Path(point.run_dir) / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.is_file() else []
    found = summarize(records, warmup, point.steps_asked, point.nproc,
                      profiled_steps(point.steps_asked))
    if code is None:
        error = f"timed out after {timeout_s:g} s; its processes were stopped"
    elif code != 0:
        error = error_line(tail(log), code)
    elif not found["timed_steps"]:
        error = (f"no timed steps in {metrics} ({len(records)} records; steps "
                 f"{warmup + 1}-{warmup + point.steps_asked} were asked for)")
    else:
        error = None
    return dataclasses.replace(point, **found, exit_code=code, error=error, wall_s=wall)


def tail(path: Path) -> str:
    """The end of a log file as text ('' when it cannot be read)."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def run_logged(command: list[str], env: Mapping[str, str], log: Path,
               timeout_s: float | None) -> int | None:
    """Run `command` with its output in `log`; its exit code (128 + S when killed by signal
    S), or None when it ran past `timeout_s`. It runs in a session of its own, so that a
    stop (timeout, or our own Ctrl-C / exception) reaches torchrun and every worker."""
    with log.open("wb") as out:
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=dict(env),
                                 stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while True:
            # A timed wait, not one blocking waitpid: our Ctrl-C must be handled promptly.
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = child.wait(timeout=0.5)
                return code if code >= 0 else 128 - code
            if deadline is not None and time.monotonic() > deadline:
                stop(child)
                return None
    except BaseException:
        stop(child)
        raise


def stop(child: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the child's session (torchrun forwards it; the workers save and exit), then
    SIGKILL to what is left after STOP_GRACE_S."""
    for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=wait)
            return
