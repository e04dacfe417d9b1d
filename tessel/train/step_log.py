"""Step logging: turns what a step measured into one metrics record and hands it to the
sinks (metrics.jsonl, TensorBoard, W&B, Prometheus through `MetricsWriter`), the console and
the alert rules. Rank 0 writes; every rank may call it (the others only print nothing)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from tessel.config import Config
from tessel.models import flops_per_token
from tessel.observe.console import ConsoleDisplay
from tessel.observe.memory import memory_stats
from tessel.observe.metrics import MetricsWriter
from tessel.train.run_dir import RunDir


def open_metrics(cfg: Config, run: RunDir, say: Callable[[str], None]) -> MetricsWriter:
    """The sinks the config asks for, behind one MetricsWriter."""
    m = cfg.metrics
    sinks: list[Any] = []
    if m.wandb:
        from tessel.observe.wandb_sink import WandbSink

        sinks.append(WandbSink(run.path, m.wandb_project, run.path.name, m.wandb_mode,
                               cfg.to_dict()))  # the sink redacts secrets itself
    if m.prometheus_port is not None:
        from tessel.observe.prometheus import PrometheusExporter

        prom = PrometheusExporter(m.prometheus_port, str(run.path))
        sinks.append(prom)
        say(f"tessel: Prometheus metrics on http://0.0.0.0:{prom.port}/metrics")
    return MetricsWriter(run.metrics, run.path if m.tensorboard else None, sinks)


class StepLogger:
    def __init__(self, cfg: Config, display: ConsoleDisplay, metrics: MetricsWriter | None,
                 device: Any, world_size: int, peak_flops: float | None,
                 observe: Callable[[dict[str, Any]], None] | None = None):
        """`metrics`: None on ranks that do not write; `observe(record)`: the alert rules."""
        self.cfg = cfg
        self.display = display
        self.metrics = metrics
        self.device = device
        self.world_size = world_size
        self.peak_flops = peak_flops
        self.observe = observe

    def train(self, *, step: int, loss: float, lr: float, grad_norm: float, window_s: float,
              window_steps: int, tokens_seen: int, elapsed_s: float, eta_s: float,
              time_split: dict[str, float], loss_scale: float | None,
              extra: dict[str, float | list[float]] | None = None) -> None:
        """One metrics line for the `window_steps` steps of the last `window_s` seconds;
        `extra`: more figures of the last step (the MoE layers'; a list is a per-expert
        vector, which the scalar sinks (TensorBoard, W&B, Prometheus) leave out)."""
        t = self.cfg.train
        tokens_per_step = t.tokens_per_step
        tps = window_steps * tokens_per_step / window_s
        rec: dict[str, Any] = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tps,
            "tokens_per_s_per_device": tps / self.world_size,
            "tokens_seen": tokens_seen,
            "elapsed_s": elapsed_s,
            "step_time_s": window_s / window_steps,
            "eta_s": eta_s,
            "token_budget_pct": 100 * tokens_seen / (t.steps * tokens_per_step),
            # null on devices without a known dense BF16 peak (CPUs included): never a guess
            "mfu": (flops_per_token(self.cfg.model, t.seq_len) * tps / self.peak_flops
                    if self.peak_flops is not None else None),
        }
        rec.update({f"time_{k}_s": v / window_steps for k, v in time_split.items()})
        if loss_scale is not None:
            rec["loss_scale"] = loss_scale
        rec.update(extra or {})
        rec.update(memory_stats(self.device))
        self._emit(rec, eta_s, rec["token_budget_pct"])

    def eval(self, *, step: int, val_loss: float, tokens_seen: int, elapsed_s: float,
             extra: dict[str, float] | None = None) -> None:
        """One validation record; `extra`: more held-out figures (DPO's eval_rewards/*)."""
        rec = {
            "step": step,
            "val_loss": val_loss,
            "val_ppl": math.exp(min(val_loss, 50.0)),
            "tokens_seen": tokens_seen,
            "elapsed_s": elapsed_s,
            **(extra or {}),
        }
        self._emit(rec, 0.0, 0.0)

    def scores(self, *, step: int, scores: dict[str, float], tokens_seen: int,
               elapsed_s: float) -> None:
        """One record of benchmark scores (`eval/<task>/<metric>`, see train/harness.py),
        its own kind of record beside the training and validation ones; the alert rules,
        which judge losses, do not see it."""
        rec: dict[str, Any] = {"step": step, **scores, "tokens_seen": tokens_seen,
                               "elapsed_s": elapsed_s}
        if self.metrics is not None:
            self.metrics.write(rec)
        shown = " ".join(f"{k.removeprefix('eval/')} {v:.4f}" for k, v in scores.items())
        self.display.print(f"step {step}/{self.cfg.train.steps} | {shown or 'no scores'}")

    def _emit(self, rec: dict[str, Any], eta_s: float, budget_pct: float) -> None:
        if self.metrics is not None:
            self.metrics.write(rec)
        self.display.log(rec, self.cfg.train.steps, eta_s, budget_pct)
        if self.observe is not None:
            self.observe(rec)

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
