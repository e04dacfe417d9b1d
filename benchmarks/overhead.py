"""Training throughput of the tessel Trainer against a plain PyTorch loop, side by side.

Command (the defaults; about 90 s on two idle CPU cores, ~0.6 s per demo step):

    .venv/bin/python benchmarks/overhead.py --preset demo --seq-len 256 --micro-batch-size 16 \\
        --global-batch-size 32 --steps 20 --warmup 3 --rounds 3

Method
- tessel side: a real `Trainer(cfg, console=False)` (synthetic data, fresh temporary run dir, no
  checkpoints, eval, samples or TensorBoard). We time `trainer.run_step()`, the method
  `Trainer.train()` calls once per optimizer step, and advance `trainer.step` as `train()` does.
- plain side: the same model from `build_model(cfg.model, device, seed)` (identical init), the
  same optimizer (`torch.optim.AdamW` over the same decay/no-decay groups and hyperparameters,
  fused=True on CUDA, foreach=True elsewhere), the same lr schedule, micro-batch, accumulation
  and gradient clipping, `torch.autocast` in the same precision (GradScaler for fp16), mean
  `F.cross_entropy`, pinned non-blocking host-to-device copies on CUDA, regional compile of each
  block with --compile (as the Trainer does). This is a nanoGPT-style loop.
- data: `accum * steps` micro-batches are drawn once, before timing, from the trainer's own train
  Loader (so from the same token array, with the same shapes and dtypes), and replayed in the same
  order to both sides: the trainer's `data.train` is swapped for a replay object. Data loading is
  therefore excluded from both timings; its cost (real `Loader.next_batch()` per optimizer step)
  is measured and printed separately.
- each side runs `--warmup` untimed steps, then `--rounds` interleaved rounds of `--steps` timed
  steps (tessel then plain, the order flipped each round), with `torch.cuda.synchronize()` before
  every clock read on CUDA. Reported tok/s is the median over rounds; ratio = tessel / plain
  (target >= 0.95). The per-round paired ratios are printed too: on a shared machine a burst of
  load hits adjacent measurements together, so their spread shows how far to trust the ratio
  (raise --rounds when it is wide). The first-step loss of each side (same init, same batch)
  checks that both do the same computation.
- `--full-train` also runs a complete `Trainer.train()` of warmup + steps steps on a fresh
  trainer (real loader) and reports its wall-clock tok/s (end-of-run eval and checkpoint
  included) and the tok/s the trainer itself logs (steps only): informational, not in the ratio.

Both models and optimizers live on the device at once (twice the memory of one run). Never run
as a timed test in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tessel.bench import synchronize
from tessel.config import Config
from tessel.data import Batch  # noqa: E402
from tessel.models import build_model, param_count
from tessel.observe.metrics import read_metrics
from tessel.optim.groups import param_groups
from tessel.optim.lr_schedule import lr_at
from tessel.train.trainer import Trainer


class Replay:
    """Stands in for a Loader: returns pre-drawn micro-batches in order, cycling."""

    def __init__(self, batches: list[Batch]):
        self.batches, self.i = batches, 0

    def next_batch(self) -> Batch:
        b = self.batches[self.i % len(self.batches)]
        self.i += 1
        return b


def make_config(a: argparse.Namespace, run_dir: str, steps: int) -> Config:
    return Config.load(None, {
        "model.preset": a.preset,
        "data.source": "synthetic",
        "train.seq_len": a.seq_len,
        "train.micro_batch_size": a.micro_batch_size,
        "train.global_batch_size": a.global_batch_size,
        "train.steps": steps,
        "train.eval_interval": 0,
        "train.device": a.device,
        "train.precision": a.precision,
        "train.compile": a.compile,
        "checkpoint.interval": 0,
        "metrics.log_interval": 10**9,
        "metrics.tensorboard": False,
        "run.dir": run_dir,
        "run.sample_tokens": 0,
    })


class PlainLoop:
    """A well-written single-device training step with no framework around it."""

    def __init__(self, cfg: Config, device: torch.device, precision: str, data: Replay):
        self.cfg, self.device, self.data, self.step = cfg, device, data, 0
        self.model = build_model(cfg.model, device, seed=cfg.train.seed)
        if cfg.train.compile:
            for block in self.model.layers.values():
                block.compile()
        o = cfg.optim
        impl: dict[str, Any] = {"fused": True} if device.type == "cuda" else {"foreach": True}
        self.opt = torch.optim.AdamW(param_groups(self.model, o.weight_decay), lr=o.lr,
                                     betas=(o.beta1, o.beta2), eps=o.eps, **impl)
        self.accum = cfg.train.global_batch_size // cfg.train.micro_batch_size
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        self.autocast: Callable[[], Any] = (
            (lambda: torch.autocast(device.type, dtype=dtype)) if dtype else contextlib.nullcontext
        )
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

    def train_step(self) -> torch.Tensor:
        lr = lr_at(self.step, self.cfg.train.steps, self.cfg.optim)
        for g in self.opt.param_groups:
            g["lr"] = lr
        loss_sum = torch.zeros((), device=self.device)
        for _ in range(self.accum):
            x, y, _ = self.data.next_batch()
            if self.device.type == "cuda":
                x = x.pin_memory().to(self.device, non_blocking=True)
                y = y.pin_memory().to(self.device, non_blocking=True)
            with self.autocast():
                logits = self.model(x)
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) / self.accum
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            loss_sum += loss.detach()
        if self.scaler:
            self.scaler.unscale_(self.opt)
        if self.cfg.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip)
        if self.scaler:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        return loss_sum


def tokens_per_s(step: Callable[[], Any], n: int, tokens_per_step: int, device: torch.device) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    synchronize(device)
    return n * tokens_per_step / (time.perf_counter() - t0)


def full_train(a: argparse.Namespace, tokens_per_step: int) -> dict[str, float]:
    """tok/s of one complete `Trainer.train()`: wall clock, and as the trainer logs it."""
    run_dir = tempfile.mkdtemp(prefix="tessel-overhead-")
    try:
        trainer = Trainer(make_config(a, run_dir, a.warmup + a.steps), console=False)
        synchronize(trainer.device)
        t0 = time.perf_counter()
        trainer.train()
        synchronize(trainer.device)
        wall = (a.warmup + a.steps) * tokens_per_step / (time.perf_counter() - t0)
        logged = [r["tokens_per_s"] for r in read_metrics(Path(run_dir) / "metrics.jsonl")
                  if "tokens_per_s" in r]
        return {"train_call_tok_s": wall, "train_logged_tok_s": logged[-1]}
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def run(a: argparse.Namespace) -> dict[str, Any]:
    run_dir = tempfile.mkdtemp(prefix="tessel-overhead-")
    try:
        # A long nominal schedule so the lr stays in a normal range; it does not change the work.
        cfg = make_config(a, run_dir, 10**6)
        trainer = Trainer(cfg, console=False)
        device, t = trainer.device, cfg.train
        tokens_per_step = t.global_batch_size * t.seq_len
        n_batches = trainer.train_step.accum * a.steps

        loader = trainer.data.train
        t0 = time.perf_counter()
        batches = [loader.next_batch() for _ in range(n_batches)]
        loader_ms = (time.perf_counter() - t0) / a.steps * 1e3

        trainer.data.train = Replay(batches)  # type: ignore[assignment]
        plain = PlainLoop(cfg, device, trainer.precision.name, Replay(batches))

        def tessel_step() -> torch.Tensor:
            loss, _ = trainer.run_step()
            trainer.step += 1
            return loss

        first = {"tessel": tessel_step().item(), "plain": plain.train_step().item()}
        for _ in range(max(a.warmup - 1, 0)):
            tessel_step(), plain.train_step()
        sides = {"tessel": tessel_step, "plain": plain.train_step}
        results: dict[str, list[float]] = {"tessel": [], "plain": []}
        for r in range(a.rounds):
            for name in (("tessel", "plain") if r % 2 == 0 else ("plain", "tessel")):
                results[name].append(tokens_per_s(sides[name], a.steps, tokens_per_step, device))
        tessel_tps, plain_tps = (statistics.median(results[k]) for k in ("tessel", "plain"))
        out: dict[str, Any] = {
            "preset": a.preset, "params": param_count(cfg.model), "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "precision": trainer.precision.name, "compile": a.compile, "seq_len": t.seq_len,
            "micro_batch_size": t.micro_batch_size, "global_batch_size": t.global_batch_size,
            "accum": trainer.train_step.accum, "steps": a.steps, "warmup": a.warmup, "rounds": a.rounds,
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "tessel_tok_s": tessel_tps, "plain_tok_s": plain_tps, "ratio": tessel_tps / plain_tps,
            "tessel_tok_s_rounds": results["tessel"], "plain_tok_s_rounds": results["plain"],
            "ratio_rounds": [x / y for x, y in zip(results["tessel"], results["plain"])],
            "first_step_loss": first, "loader_ms_per_step": loader_ms,
        }
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    if a.full_train:
        out.update(full_train(a, tokens_per_step))
    return out


def report(r: dict[str, Any]) -> None:
    head = ["preset", "params", "device", "precision", "tessel tok/s", "plain tok/s", "ratio"]
    row = [r["preset"], f"{r['params']:,}", r["device_name"], r["precision"],
           f"{r['tessel_tok_s']:,.0f}", f"{r['plain_tok_s']:,.0f}", f"{r['ratio']:.3f}"]
    widths = [max(len(h), len(c)) for h, c in zip(head, row)]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    rounds = lambda k: ", ".join(f"{v:,.0f}" for v in r[k])  # noqa: E731
    print(f"rounds tok/s: tessel [{rounds('tessel_tok_s_rounds')}], plain [{rounds('plain_tok_s_rounds')}]"
          f"; paired ratios [{', '.join(f'{v:.3f}' for v in r['ratio_rounds'])}]")
    fl = r["first_step_loss"]
    print(f"first-step loss: tessel {fl['tessel']:.5f}, plain {fl['plain']:.5f}; "
          f"data loading (excluded above): {r['loader_ms_per_step']:.2f} ms/step")
    if "train_call_tok_s" in r:
        print(f"Trainer.train(): {r['train_call_tok_s']:,.0f} tok/s wall clock (eval, save included), "
              f"{r['train_logged_tok_s']:,.0f} tok/s as logged")
    verdict = "meets" if r["ratio"] >= 0.95 else "BELOW"
    print(f"ratio {r['ratio']:.3f} {verdict} the 0.95 target")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="demo")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=20, help="timed steps per round and side")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per side first")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument("--compile", action="store_true", help="compile each block (both sides)")
    p.add_argument("--full-train", action="store_true", help="also time one Trainer.train() call")
    p.add_argument("--json", metavar="OUT.json", help="write the results as JSON")
    a = p.parse_args(argv)
    if a.steps < 1 or a.rounds < 1 or a.warmup < 1:
        p.error("--steps, --rounds and --warmup must be >= 1")
    r = run(a)
    report(r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
