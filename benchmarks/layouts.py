"""Throughput of each parallel layout against the single-process run of the same model, in one
invocation (so the figures share a machine and a moment).

Command (a GPU machine with N GPUs; on CPU it runs the same layouts with gloo, which shows
that the script works, not how fast the layouts are):

    .venv/bin/python benchmarks/layouts.py --preset gpt2-124m --n-layers 0 --seq-len 1024 \\
        --micro-batch-size 8 --global-batch-size 64 --steps 30 --nproc 2 --compile

Method
- every layout is a real `tessel train --nproc N` run (torchrun, the real trainer) of
  `--steps` steps on synthetic tokens, without checkpoints or evaluation;
- throughput is the median of the tokens/s the trainer logs per step, skipping the first
  `--warmup` steps (compilation, allocator warm-up, first collectives);
- the single-process reference runs the same global batch (with more accumulation);
  `scaling` = layout tokens/s / (N x reference tokens/s): 1.0 means no parallel overhead.
Never run as a timed test in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tessel.observe.metrics import read_metrics

LAYOUTS_2 = {
    "ddp": {"parallel.zero": 0},
    "zero1": {"parallel.zero": 1},
    "zero2": {"parallel.zero": 2},
    "zero3": {"parallel.zero": 3},
    "tp2": {"parallel.tp": 2},
    "pp2 1f1b": {"parallel.pp": 2},
    "pp2 interleaved": {"parallel.pp": 2, "parallel.pp_schedule": "interleaved-1f1b",
                        "parallel.pp_virtual_stages": 2},
}
LAYOUTS_4 = {
    "zero3 dp4": {"parallel.zero": 3},
    "tp2 x pp2": {"parallel.tp": 2, "parallel.pp": 2},
    "dp2 x tp2": {"parallel.tp": 2, "parallel.zero": 1},
    "hsdp 2x2": {"parallel.dp_replicate": 2, "parallel.zero": 3},
}


def run(name: str, nproc: int, overrides: dict, args: argparse.Namespace, root: Path) -> float:
    run_dir = root / name.replace(" ", "_")
    base = {
        "model.preset": args.preset, "model.tie_embeddings": False, "data.source": "synthetic",
        "train.steps": args.steps, "train.seq_len": args.seq_len,
        "train.micro_batch_size": args.micro_batch_size,
        "train.global_batch_size": args.global_batch_size, "train.eval_interval": 0,
        "train.precision": args.precision, "train.compile": args.compile,
        "checkpoint.interval": 0, "metrics.log_interval": 1, "metrics.tensorboard": False,
        "run.dir": str(run_dir), "run.sample_tokens": 0,
    }
    if args.n_layers:
        base["model.n_layers"] = args.n_layers
    flags = [f"--{k}={json.dumps(v)}" for k, v in {**base, **overrides}.items()]
    cmd = [sys.executable, "-m", "tessel", "train", "--quiet", *flags]
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    env = {**os.environ, "CI": "true", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    rates = [r["tokens_per_s"] for r in read_metrics(run_dir / "metrics.jsonl")
             if "tokens_per_s" in r and r["step"] > args.warmup]
    return statistics.median(rates)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny-llama")
    p.add_argument("--n-layers", type=int, default=4, help="0: the preset's")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--precision", default="auto")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--nproc", type=int, choices=(2, 4), default=2)
    args = p.parse_args()
    layouts = LAYOUTS_2 if args.nproc == 2 else LAYOUTS_4
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ref = run("single", 1, {}, args, root)
        print(f"{'layout':18s} {'procs':>5s} {'tokens/s':>12s} {'scaling':>8s}")
        print(f"{'one process':18s} {1:5d} {ref:12,.0f} {1.0:8.2f}")
        for name, overrides in layouts.items():
            tps = run(name, args.nproc, overrides, args, root)
            print(f"{name:18s} {args.nproc:5d} {tps:12,.0f} {tps / (args.nproc * ref):8.2f}")


if __name__ == "__main__":
    main()
