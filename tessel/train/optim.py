"""AdamW with conventional parameter groups, and the learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from tessel.config import OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices; never norms, biases or embeddings (GPT-2/Megatron convention).

    Parameters are also grouped by the device mesh they are sharded over (plain tensors
    apart): the multi-tensor kernels run per group and cannot mix plain tensors with
    DTensors, or DTensors of different meshes."""
    groups: dict[tuple, list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_embedding = name.startswith(("tok_embeddings.", "pos_embeddings."))
        decay = not (p.ndim < 2 or is_embedding)
        mesh = getattr(p, "device_mesh", None)
        groups.setdefault((decay, id(mesh) if mesh is not None else None), []).append(p)
    # Decayed groups first, then the rest (stable order: the optimizer state follows it).
    return [
        {"params": params, "weight_decay": weight_decay if decay else 0.0}
        for (decay, _), params in sorted(groups.items(), key=lambda kv: not kv[0][0])
    ]


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, device: torch.device, offload: bool = False,
) -> torch.optim.Optimizer:
    """AdamW over `model`'s parameters; with `offload`, its state and update in host memory
    (`tessel.train.offload.HostAdamW`)."""
    if offload:
        from tessel.train.offload import HostAdamW

        return HostAdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr,
                         betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    # Fused kernels on CUDA, multi-tensor (foreach) elsewhere: both are bitwise deterministic
    # for a fixed device, which is what the resume test relies on.
    impl = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        **impl,
    )


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
