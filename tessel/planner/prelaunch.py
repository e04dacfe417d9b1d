"""What `tessel train` asks the planner before it builds anything: the layout to use when
`parallel.auto = true`, whether the layout is predicted to fit in device memory, and the
device's peak that MFU is reported against."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch

from tessel.config import Config
from tessel.errors import TesselError
from tessel.planner.hardware import GpuProfile, load_profiles, profile_for_device
from tessel.planner.layout import Layout
from tessel.planner.memory import GIB
from tessel.planner.search import Plan, check_fits, search, trainer_refusal

# Stand-in rates for a device no profile describes: they only rank layouts against each
# other (the memory check uses the device's real capacity).
_NOMINAL = dict(bf16_flops=100e12, fp8_flops=None, intra_node_gbps=100.0, inter_node_gbps=25.0)


class MemoryRefusal(TesselError):
    """The layout is predicted not to fit; the message gives the shortfall and the fix."""


def device_profile(device: torch.device, local_world: int) -> GpuProfile:
    """The profile of this machine's device with its actual memory: a known GPU's figures,
    nominal rates for an unknown GPU, and host memory shared by the local ranks on CPU."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        memory = props.total_memory / GIB
        known = profile_for_device(props.name, load_profiles())
        if known is not None:
            return dataclasses.replace(known, memory_gib=memory)
        return GpuProfile(name=props.name, memory_gib=memory,
                          gpus_per_node=max(torch.cuda.device_count(), 1), **_NOMINAL)
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    return GpuProfile(name="cpu", memory_gib=host / max(local_world, 1),
                      gpus_per_node=max(local_world, 1), **_NOMINAL)


def device_peak_flops(device: torch.device) -> float | None:
    """The dense BF16 peak MFU is measured against (docs/monitoring.md), FLOP/s: that of the
    built-in profile this GPU is (`profile_for_device`); None for a device none describes,
    CPUs included: MFU is never guessed."""
    if device.type != "cuda":
        return None
    known = profile_for_device(torch.cuda.get_device_name(device))
    return None if known is None else known.mfu_peak_flops


def choose_layout(cfg: Config, world: int, hw: GpuProfile, device_type: str = "cuda"
                  ) -> tuple[Config, Plan]:
    """The fastest layout predicted to fit on `world` devices that the trainer runs today;
    the config with it applied."""
    result = search(cfg, world, hw, keep=10**9, device_type=device_type)
    # The search also plans what the trainer does not run yet (expert parallelism).
    runnable = (p for p in result.plans if trainer_refusal(cfg, p.layout, device_type) is None)
    result.plans = [p for p in (next(runnable, None),) if p is not None]
    if not result.plans:
        closest = result.too_big[0] if result.too_big else None
        need = (f"; the closest, {closest.layout.short()}, needs {closest.memory.total / GIB:.1f} "
                f"GiB" if closest else "")
        raise TesselError(
            f"parallel.auto: no layout of this model on {world} device(s) of "
            f"{hw.memory_gib:.1f} GiB is predicted to fit{need}; use more devices, a shorter "
            "train.seq_len or a smaller model"
        )
    best = result.plans[0]
    chosen = cfg.with_overrides({**best.layout.overrides(), "parallel.auto": True})
    return chosen, best


def check_memory(cfg: Config, world: int, hw: GpuProfile) -> tuple[Plan, str | None]:
    """(the plan of the configured layout, None if it fits, else the one-line refusal)."""
    plan, nearest = check_fits(cfg, world, hw)
    if plan.fits:
        return plan, None
    g = plan.memory.gib()
    biggest = max(("parameters", "gradients", "optimizer", "activations", "communication"),
                  key=lambda k: g[k])
    current = Layout.from_config(cfg, world)
    alternatives = "; ".join(
        " ".join(f"--{k}={v}" for k, v in _changed(p.layout, current).items())
        + f" ({p.memory.total / GIB:.1f} GiB)"
        for p in nearest
    ) or "none on this many devices"
    # DPO with dpo.reference_model: the peak may be the reference pass's (planner/dpo.py)
    during = (" in the DPO reference pass (dpo.reference_model beside the policy)"
              if plan.reference is not None and plan.reference.is_peak else "")
    return plan, (
        f"layout {plan.layout.short()} is predicted to need {g['total']:.1f} GiB per device{during}, "
        f"{plan.shortfall_gib:.1f} GiB more than the {hw.memory_gib:.1f} GiB available (largest "
        f"part: {biggest} {g[biggest]:.1f} GiB); layouts predicted to fit: {alternatives}; or "
        "pass --force to try anyway"
    )


def _changed(new: Layout, old: Layout) -> dict[str, object]:
    a, b = new.overrides(), old.overrides()
    return {k: v for k, v in a.items() if b.get(k) != v}


def auto_layout(cfg: Config, device: torch.device, world: int,
                say: Callable[[str], None]) -> Config:
    """With parallel.auto: the config with the fastest layout predicted to fit applied
    (said in one line); otherwise the config unchanged."""
    if not cfg.parallel.auto:
        return cfg
    hw = device_profile(device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    cfg, plan = choose_layout(cfg, world, hw, device.type)
    say(
        f"tessel: parallel.auto chose {plan.layout.short()} for {world} x {hw.name} "
        f"({hw.memory_gib:.0f} GiB each): the fastest of the layouts predicted to fit "
        f"(predicted {plan.memory.total / 2**30:.1f} GiB per device, "
        f"{plan.tokens_per_s:,.0f} tokens/s)"
    )
    return cfg


def refuse_if_too_big(cfg: Config, device: torch.device, world: int, force: bool,
                      say: Callable[[str], None]) -> None:
    """Refuse (MemoryRefusal) a checked layout predicted not to fit in GPU memory, unless
    `force`. On a CPU the memory is the host's, shared and swappable: only a model that
    cannot fit however it is sharded is refused (before the allocator fails on it)."""
    if device.type != "cuda":
        _refuse_beyond_host_memory(cfg, world)
        return
    if cfg.parallel.auto:  # auto chose a layout that fits
        return
    hw = device_profile(device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    _, refusal = check_memory(cfg, world, hw)
    if refusal is not None and not force:
        raise MemoryRefusal(refusal)
    if refusal is not None:
        say(f"tessel: --force: {refusal.split('; layouts')[0]}; trying anyway")


def _refuse_beyond_host_memory(cfg: Config, world: int) -> None:
    """A lower bound that no layout beats: fp32 weights, gradients and AdamW's two moments
    (16 bytes a parameter) spread perfectly over all ranks, for the ranks on this host."""
    from tessel.models import param_count

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    need = 16 * param_count(cfg.model) * local / max(world, 1)
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > host:
        raise MemoryRefusal(
            f"this model has {param_count(cfg.model):,} parameters and needs at least "
            f"{need / GIB:,.0f} GiB for its weights, gradients and optimizer state on this "
            f"machine, which has {host / GIB:,.0f} GiB; use a smaller model (model.* or "
            "model.preset) or more machines"
        )
