"""What measuring exposed communication costs: a profiled training step against a plain one,
side by side in one run (tessel/observe/comm.py, metrics.comm_sample_interval).

Commands (one process; two gloo processes; a GPU):

    .venv/bin/python benchmarks/comm_sampling.py
    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node=2 \\
        benchmarks/comm_sampling.py --zero 3
    .venv/bin/python benchmarks/comm_sampling.py --device cuda --preset gpt2-124m --seq-len 1024 \\
        --micro-batch-size 8 --global-batch-size 8

Method
- a real `Trainer` (synthetic data, no checkpoints, eval or TensorBoard); each timed unit is
  `trainer.run_step()`, the method `Trainer.train()` calls once per optimizer step, with the
  device synchronised before every clock read.
- `--rounds` rounds of `--steps` plain steps and `--steps` profiled steps (the meter's
  interval set to 1 for those: every step sampled, analysed and kept as the trainer does),
  the order flipped each round; the median step time of each side. On several processes
  every rank does the same, so the collectives stay matched; rank 0 prints.
- ratio = profiled / plain step time; what it costs a run at interval N is
  (ratio - 1) / N of its step time (printed for N = 20, 100 and the default,
  metrics.comm_sample_interval).
- the cost of a step that is *not* sampled: `CommMeter.sampled(step)` entered and left
  100,000 times with sampling off, per call, against the plain step time.

Never a timed test in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import overhead  # noqa: E402

from tessel.bench import synchronize
from tessel.config import Config, MetricsConfig
from tessel.observe.comm import CommMeter
from tessel.train.trainer import Trainer

DEFAULT_INTERVAL = MetricsConfig.model_fields["comm_sample_interval"].default


def make_config(a: argparse.Namespace, run_dir: str) -> Config:
    """benchmarks/overhead.py's config (synthetic tokens, nothing written) at `--zero`."""
    return overhead.make_config(a, run_dir, 10**6).with_overrides({"parallel.zero": a.zero})


def step_times(trainer: Trainer, n: int, every: int) -> list[float]:
    """Seconds of each of `n` steps with the meter sampling one in `every` (0: none)."""
    trainer.comm.every = every
    out = []
    for _ in range(n):
        synchronize(trainer.device)
        t0 = time.perf_counter()
        trainer.run_step()
        synchronize(trainer.device)
        out.append(time.perf_counter() - t0)
        trainer.step += 1
    trainer.comm.window(1.0)  # as at a log step (a gather across the ranks)
    return out


def not_sampled_call_s(device: torch.device) -> float:
    meter = CommMeter(device, every=0, distributed=False)
    n = 100_000
    t0 = time.perf_counter()
    for step in range(1, n + 1):
        with meter.sampled(step):
            pass
    return (time.perf_counter() - t0) / n


def run(a: argparse.Namespace) -> dict[str, Any]:
    run_dir = tempfile.mkdtemp(prefix="tessel-comm-")  # one per rank: nothing is written
    try:
        trainer = Trainer(make_config(a, run_dir), console=False)
        step_times(trainer, a.warmup, every=1)  # the profiler's first start is dearer
        step_times(trainer, a.warmup, every=0)
        sides: dict[str, list[float]] = {"plain": [], "profiled": []}
        for r in range(a.rounds):
            for name in (("plain", "profiled") if r % 2 == 0 else ("profiled", "plain")):
                sides[name] += step_times(trainer, a.steps, every=0 if name == "plain" else 1)
        plain, profiled = (statistics.median(sides[k]) for k in ("plain", "profiled"))
        ratio = profiled / plain
        off = not_sampled_call_s(trainer.device)
        world = dist.get_world_size() if dist.is_initialized() else 1
        trainer.close()
        return {
            "device": str(trainer.device), "world_size": world, "zero": trainer.cfg.parallel.zero,
            "preset": a.preset, "torch": torch.__version__,
            "plain_step_s": round(plain, 5), "profiled_step_s": round(profiled, 5),
            "ratio_profiled_over_plain": round(ratio, 3),
            "run_cost_pct_every_20": round(100 * (ratio - 1) / 20, 2),
            "run_cost_pct_every_100": round(100 * (ratio - 1) / 100, 3),
            "default_interval": DEFAULT_INTERVAL,
            "run_cost_pct_default": round(100 * (ratio - 1) / DEFAULT_INTERVAL, 3),
            "not_sampled_call_us": round(off * 1e6, 3),
            "not_sampled_cost_pct": round(100 * off / plain, 5),
            "steps_per_side": len(sides["plain"]),
        }
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument("--zero", type=int, default=0, help="parallel.zero on several processes")
    p.add_argument("--steps", type=int, default=10, help="steps per side per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4)
    a = p.parse_args()
    a.compile = False
    result = run(a)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
