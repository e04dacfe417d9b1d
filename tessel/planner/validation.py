"""The planner's time model against published runs (`published.py`): prediction, error, and
the fit of the one constant calibration sets (the matmul efficiency)."""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

from tessel.config import Config
from tessel.planner.hardware import GpuProfile, get_profile
from tessel.planner.layout import Layout
from tessel.planner.published import RUNS, PublishedRun
from tessel.planner.search import Plan, evaluate, trainer_refusal
from tessel.planner.stack import STACKS


@dataclass
class Check:
    run: PublishedRun
    plan: Plan

    @property
    def error(self) -> float:
        """Predicted / published tokens/s - 1."""
        return self.plan.tokens_per_s / self.run.tokens_per_s - 1


def run_config(run: PublishedRun) -> tuple[Config, Layout]:
    layout = dict(run.parallel)
    micro_batch = layout.pop("micro_batch")
    overrides = {f"model.{k}": v for k, v in run.model.items()}
    overrides.update({f"parallel.{k}": v for k, v in layout.items()})
    overrides.update({"train.seq_len": run.seq_len, "train.global_batch_size": run.global_batch,
                      "train.micro_batch_size": micro_batch, "train.precision": "bf16",
                      "train.fp8": run.fp8})
    cfg = Config.load(None, overrides)
    return cfg, Layout.from_config(cfg, run.gpus)


def check(run: PublishedRun, hw: GpuProfile | None = None) -> Check:
    cfg, layout = run_config(run)
    hw = hw or get_profile(run.gpu)
    if run.hardware:  # the cluster's own figures, where it differs from the profile
        hw = dataclasses.replace(hw, **run.hardware)
    reason = trainer_refusal(cfg, layout)
    if reason is not None:
        raise ValueError(f"{run.name}: tessel cannot run this layout: {reason}")
    return Check(run, evaluate(cfg, layout, hw,
                               dp_overlap=run.dp_overlap, stack=STACKS[run.stack]))


def check_all(matmul_efficiency: float | None = None) -> list[Check]:
    out = []
    for run in RUNS:
        hw = get_profile(run.gpu)
        if matmul_efficiency is not None:
            hw = dataclasses.replace(hw, matmul_efficiency=matmul_efficiency)
        out.append(check(run, hw))
    return out


def fit_matmul_efficiency(lo: float = 0.3, hi: float = 1.0, steps: int = 141,
                          sources: set[str] | None = None) -> float:
    """The efficiency that minimises the median absolute error over the runs marked `fit`
    (grid search: the model's one fitted constant; the rest are physical or stated
    assumptions), or over those of `sources` only (to check rows held out of the fit)."""
    best, best_err = lo, float("inf")
    for i in range(steps):
        eff = lo + (hi - lo) * i / (steps - 1)
        err = statistics.median(abs(c.error) for c in check_all(eff)
                                if c.run.fit and (sources is None or c.run.source in sources))
        if err < best_err:
            best, best_err = eff, err
    return round(best, 3)
