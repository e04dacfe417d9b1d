"""The learning-rate schedule (`optim.schedule`): warm-up, then constant, cosine, linear or
warm-up-stable-decay (wsd) down to `optim.min_lr_ratio` of the peak."""

from __future__ import annotations

import math

from tessel.config import OptimConfig


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Learning rate for optimizer step `step` (0-based). A pure function of the step, so the
    schedule needs no state of its own in a checkpoint."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return cfg.lr
    # The last step (total_steps - 1) lands exactly on the floor.
    span = max(total_steps - 1 - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    if cfg.schedule == "cosine":
        return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    if cfg.schedule == "linear":
        return cfg.lr - (cfg.lr - floor) * progress
    # wsd: warm-up, stable at lr, then linear decay over the last decay_fraction of the steps
    decay_start = total_steps - int(cfg.decay_fraction * total_steps)
    if step < decay_start:
        return cfg.lr
    frac = (step - decay_start) / max(total_steps - 1 - decay_start, 1)
    return cfg.lr - (cfg.lr - floor) * min(frac, 1.0)
