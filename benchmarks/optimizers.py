"""AdamW against Muon on the demo model, and what each optimizer and state dtype costs.

    .venv/bin/python benchmarks/optimizers.py [--steps 400] [--adamw-lrs 1e-3,2e-3,4e-3]
        [--muon-lrs 1e-3,2e-3,4e-3] [--eval-interval 50] [--rounds 20]

1. Training: the README's demo (its config, one process) once per learning rate of each
   optimizer's sweep; validation loss against tokens seen for each run, each optimizer's best
   final validation loss, and the first evaluation at which the best Muon run reaches the best
   AdamW run's final validation loss (steps and tokens).
2. The optimizer step alone, on the demo model with random gradients, for each optimizer and
   state dtype (int8 only where torchao is installed): the median time of `rounds` steps,
   the state's bytes as allocated, and the planner's prediction of them (their ratio).

Prints tables; writes nothing but the runs' directories under a temporary directory.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tessel.config import Config
from tessel.models import build_model
from tessel.observe.metrics import read_metrics
from tessel.optim.groups import build_optimizer
from tessel.planner.layout import Layout
from tessel.planner.memory import estimate_memory
from tessel.planner.optimizer import OptimizerSpec
from tessel.train import Trainer


def train(root: Path, name: str, lr: float, steps: int, eval_interval: int) -> dict[int, float]:
    """Validation loss by tokens seen, for the demo trained by `name` at `lr`."""
    run = root / f"{name}-{lr:g}"
    cfg = Config.load(None, {"optim.name": name, "optim.lr": lr, "train.steps": steps,
                             "train.eval_interval": eval_interval, "run.dir": str(run),
                             "run.sample_tokens": 0, "checkpoint.interval": 0,
                             "metrics.tensorboard": False})
    Trainer(cfg, console=False).train()
    per_step = cfg.train.global_batch_size * cfg.train.seq_len
    return {r["step"] * per_step: r["val_loss"] for r in read_metrics(run / "metrics.jsonl")
            if "val_loss" in r}


def per_step(curve: dict[int, float], a: argparse.Namespace) -> int:
    """Tokens per optimizer step (the first evaluation is at step eval_interval)."""
    return min(curve) // a.eval_interval


def sweep(root: Path, a: argparse.Namespace) -> None:
    """Runs that end early (the spike/NaN recovery can stop one) are shown, not ranked."""
    curves: dict[tuple[str, float], dict[int, float]] = {}
    stopped: dict[tuple[str, float], dict[int, float]] = {}
    for name, lrs in (("adamw", a.adamw_lrs), ("muon", a.muon_lrs)):
        for lr in lrs:
            start = time.perf_counter()
            curve = train(root, name, lr, a.steps, a.eval_interval)
            if not curve:
                print(f"{name:5} lr {lr:<7g} ended before its first evaluation: not counted")
                continue
            last = max(curve) // per_step(curve, a)
            ended = "" if last == a.steps else f" (the run ended at step {last}: not counted)"
            print(f"{name:5} lr {lr:<7g} val loss {curve[max(curve)]:.4f} at step {last}{ended} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
            if last == a.steps:
                curves[(name, lr)] = curve
            else:
                stopped[(name, lr)] = curve
    shown = {**curves, **stopped}
    tokens = sorted(next(iter(curves.values())))
    print("\nvalidation loss by tokens seen")
    print("tokens    " + "".join(f"{n}@{lr:<9g}"[:15].ljust(15) for n, lr in shown))
    for t in tokens:
        print(f"{t:<10}" + "".join(f"{c.get(t, float('nan')):<15.4f}" for c in shown.values()))
    best = {n: min(((lr, c) for (m, lr), c in curves.items() if m == n),
                   key=lambda x: x[1][max(x[1])]) for n in ("adamw", "muon")}
    target = best["adamw"][1][max(best["adamw"][1])]
    reached = [t for t in tokens if best["muon"][1][t] <= target]
    step_tokens = tokens[0] // a.eval_interval
    print(f"\nbest AdamW: lr {best['adamw'][0]:g}, final val loss {target:.4f}; best Muon: lr "
          f"{best['muon'][0]:g}, final {best['muon'][1][tokens[-1]]:.4f}")
    if reached:
        print(f"Muon reaches AdamW's final val loss at step {reached[0] // step_tokens} of "
              f"{a.steps} ({reached[0]:,} tokens; evaluated every {a.eval_interval} steps)")
    else:
        print(f"Muon does not reach AdamW's final val loss within {a.steps} steps")


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's per-parameter state as allocated (torchao's quantised
    tensors: their codes, scales and code book)."""
    total = 0
    for s in opt.state.values():
        for k, t in s.items():
            if k == "step":
                continue
            inner = [getattr(t, n) for n in getattr(t, "__tensor_flatten__", lambda: ([],))()[0]]
            for x in inner or [t]:
                total += x.numel() * x.element_size()
    return total


def step_costs(a: argparse.Namespace) -> None:
    cases = [("adamw", "float32"), ("adamw", "bfloat16"), ("adamw", "int8"),
             ("muon", "float32"), ("muon", "bfloat16")]
    print(f"\noptimizer step on the demo model (one process, {torch.get_num_threads()} threads)")
    print("optimizer  state     step ms   state MiB   planner MiB   planner/allocated")
    for name, dtype in cases:
        cfg = Config.load(None, {"optim.name": name, "optim.state_dtype": dtype})
        model = build_model(cfg.model, seed=0)
        try:
            opt = build_optimizer(model, cfg.optim, torch.device("cpu"))
        except Exception as exc:  # int8 without torchao
            print(f"{name:10} {dtype:9} skipped: {exc}")
            continue
        gen = torch.Generator().manual_seed(0)
        times = []
        for i in range(a.rounds + 2):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen) * 1e-2
            start = time.perf_counter()
            opt.step()
            if i >= 2:  # the first steps allocate state (and torchao compiles its kernel)
                times.append(time.perf_counter() - start)
        got = state_bytes(opt)
        layout = Layout(1, 1, 1, 1, 1, 0, cfg.train.micro_batch_size)
        planned = estimate_memory(cfg.model, layout, cfg.train.seq_len, cfg.train.global_batch_size,
                                  "fp32", optimizer=OptimizerSpec.from_config(cfg.optim)).optimizer
        print(f"{name:10} {dtype:9} {statistics.median(times) * 1e3:7.1f}   {got / 2**20:9.3f}"
              f"   {planned / 2**20:11.3f}   {planned / got:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    floats = lambda s: [float(x) for x in s.split(",")]
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--adamw-lrs", type=floats, default=[1e-3, 2e-3, 4e-3])
    ap.add_argument("--muon-lrs", type=floats, default=[1e-3, 2e-3, 4e-3])
    ap.add_argument("--eval-interval", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--skip-training", action="store_true")
    a = ap.parse_args()
    if not a.skip_training:
        with tempfile.TemporaryDirectory() as tmp:
            sweep(Path(tmp), a)
    step_costs(a)


if __name__ == "__main__":
    main()
