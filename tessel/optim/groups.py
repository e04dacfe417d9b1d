"""Parameter groups (AdamW's conventional ones, Muon's matrices) and the optimizer built over
them: AdamW, or Muon with AdamW beside it (the learning-rate schedule: lr_schedule.py)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from fnmatch import fnmatchcase

import torch
from torch import nn

from tessel.config import Config, OptimConfig
from tessel.errors import TesselError

WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
"""Name parts that activation checkpointing and compile insert: patterns see the model's
own names."""


def plain_name(name: str) -> str:
    """`name` as the model itself spells it (wrappers' name parts removed)."""
    for part in WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def is_expert_stack(name: str, p: torch.Tensor) -> bool:
    """An MoE layer's routed experts: (E, A, B), E matrices."""
    return p.ndim == 3 and ".experts." in name


def muon_trains(name: str, p: torch.Tensor, cfg: OptimConfig) -> bool:
    """Whether Muon trains parameter `name` (see optim.muon_adamw / muon_force); a forced
    parameter that is not a matrix is refused."""
    name = plain_name(name)
    matrix = p.ndim == 2 or is_expert_stack(name, p)
    if any(fnmatchcase(name, pat) for pat in cfg.muon_force):
        if not matrix:
            raise TesselError(
                f"optim.muon_force names {name} of shape {tuple(p.shape)}: Muon trains "
                "matrices only (2-D, or an MoE expert stack); narrow the pattern")
        return True
    return matrix and not any(fnmatchcase(name, pat) for pat in cfg.muon_adamw)


def check_muon_force(cfg: Config) -> None:
    """Refuse (one line, TesselError) an `optim.muon_force` pattern that names no parameter of
    the model (a typo would train exactly as without it), or names one Muon cannot train.
    Checked on the whole model built on the meta device, before anything is written: a
    pipeline stage alone holds only some of the names."""
    if cfg.optim.name != "muon" or not cfg.optim.muon_force:
        return
    from tessel.models import build_model

    model = build_model(cfg.model, "meta")
    model.tie_weights()  # a tied output layer is the embedding: its own name is gone
    params = dict(model.named_parameters())
    for pattern in cfg.optim.muon_force:
        hits = [name for name in params if fnmatchcase(name, pattern)]
        if not hits:
            near = difflib.get_close_matches(pattern, params, n=3, cutoff=0.6)
            if cfg.model.tie_embeddings and fnmatchcase("output.weight", pattern):
                hint = "model.tie_embeddings: the output layer is tok_embeddings.weight"
            elif near:
                hint = f"did you mean {', '.join(near)}?"
            else:
                hint = f"names look like {', '.join(list(params)[1:3])}"
            raise TesselError(f"optim.muon_force pattern {pattern!r} names no parameter of this "
                              f"model ({hint}); fix or drop the pattern (fnmatch over names)")
        for name in hits:
            muon_trains(name, params[name], cfg.optim)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices; never norms, biases or embeddings (GPT-2/Megatron convention).

    Parameters are also grouped by the device mesh they are sharded over (plain tensors
    apart): the multi-tensor kernels run per group and cannot mix plain tensors with
    DTensors, or DTensors of different meshes."""
    return adamw_groups(model.named_parameters(), weight_decay)


def adamw_groups(named: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """`param_groups` over the (name, parameter) pairs `named`."""
    groups: dict[tuple, list[nn.Parameter]] = {}
    for name, p in named:
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


def muon_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """AdamW's groups (as `param_groups`) over the parameters Muon does not train, then
    Muon's (marked `muon: True`, decayed), by mesh."""
    muon: dict[int | None, list[nn.Parameter]] = {}
    rest: list[tuple[str, nn.Parameter]] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if muon_trains(name, p, cfg):
            mesh = getattr(p, "device_mesh", None)
            muon.setdefault(id(mesh) if mesh is not None else None, []).append(p)
        else:
            rest.append((name, p))
    return adamw_groups(rest, cfg.weight_decay) + [
        {"params": ps, "weight_decay": cfg.weight_decay, "muon": True} for ps in muon.values()]


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, device: torch.device, offload: bool = False,
) -> torch.optim.Optimizer:
    """The optimizer of `model`'s parameters: AdamW (with `offload`, its state and update in
    host memory: `tessel.optim.offload.HostAdamW`) or Muon (`tessel.optim.muon`)."""
    if cfg.name == "muon":
        from tessel.optim.muon import Muon

        assert not offload, "refused by tessel.parallel.check.check_layout"
        # Muon's AdamW part: the same kernels as optim.name = "adamw".
        impl = {"fused": True} if device.type == "cuda" else {"foreach": True}
        ns_dtype = cfg.muon_ns_dtype
        if ns_dtype == "auto":
            ns_dtype = "bfloat16" if device.type == "cuda" else "float32"
        return Muon(muon_groups(model, cfg), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                    eps=cfg.eps, momentum=cfg.muon_momentum, ns_steps=cfg.muon_ns_steps,
                    ns_dtype=ns_dtype, state_dtype=cfg.state_dtype, **impl)
    if cfg.state_dtype != "float32":
        from tessel.optim.lowbit import StateAdamW, adamw_8bit

        assert not offload, "refused by tessel.parallel.check.check_layout"
        hyper = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps}
        groups = param_groups(model, cfg.weight_decay)
        if cfg.state_dtype == "int8":
            return adamw_8bit(groups, **hyper)
        return StateAdamW(groups, state_dtype=cfg.state_dtype, **hyper)
    if offload:
        from tessel.optim.offload import HostAdamW

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
