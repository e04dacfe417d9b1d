"""Text and JSON output of `tessel plan`."""

from __future__ import annotations

from typing import Any

from tessel.config import Config
from tessel.planner.async_tp import FUSED_SHARE
from tessel.planner.cpu import ASSUMPTIONS as CPU_ASSUMPTIONS
from tessel.planner.dpo import ASSUMPTIONS as DPO_ASSUMPTIONS
from tessel.planner.dpo import ROWS_PER_PAIR, is_dpo
from tessel.planner.fp8 import described as fp8_described
from tessel.planner.hardware import GpuProfile
from tessel.planner.memory import ASSUMPTIONS as MEMORY_ASSUMPTIONS
from tessel.planner.memory import GIB
from tessel.planner.optimizer import ASSUMPTIONS as OPTIMIZER_ASSUMPTIONS
from tessel.planner.search import Plan, SearchResult, precision_for
from tessel.planner.speed import ASSUMPTIONS as SPEED_ASSUMPTIONS
from tessel.planner.stack import generation, tessel_stack

ASSUMPTIONS = [*MEMORY_ASSUMPTIONS, *OPTIMIZER_ASSUMPTIONS, *SPEED_ASSUMPTIONS, *CPU_ASSUMPTIONS,
               *DPO_ASSUMPTIONS]
TOP_REJECTED = 3


def duration(seconds: float) -> str:
    if seconds >= 86400:
        return f"{seconds / 86400:.1f} d"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"


def profile_text(hw: GpuProfile, device_type: str) -> str:
    """`989 TFLOP/s bf16, 80.0 GiB, 8 per node`; on CPU processes the profile's peak, not
    bf16, which they do not run."""
    rate = "bf16" if device_type == "cuda" else "peak"
    return (f"{hw.bf16_flops / 1e12:.3g} TFLOP/s {rate}, {hw.memory_gib:.1f} GiB, "
            f"{hw.gpus_per_node} per node")


def columns(device_type: str) -> tuple[str, str]:
    """The headings of the memory per rank and of the model FLOP/s over the peak: a GPU's
    (MFU: against its dense BF16 peak), or per process and the profile's peak on CPU
    processes."""
    return ("GiB/GPU", "MFU") if device_type == "cuda" else ("GiB/proc", "of peak")


def header(cfg: Config, gpus: int, hw: GpuProfile) -> str:
    t = cfg.train
    from tessel.models import active_param_count, param_count

    m = cfg.model
    active = f", {active_param_count(m) / 1e9:.2f}B active" if m.moe_experts else ""
    batch = f"{t.global_batch_size} ({t.global_batch_size * t.seq_len:,} tokens/step)"
    if is_dpo(cfg):  # pairs, each two rows through the model
        rows = ROWS_PER_PAIR * t.global_batch_size
        batch = f"{t.global_batch_size} DPO pairs ({rows} rows, {rows * t.seq_len:,} tokens/step)"
    return (
        f"tessel plan: {m.preset or 'custom'} model ({param_count(m) / 1e9:.2f}B "
        f"parameters{active}), {gpus} x {hw.name} ({profile_text(hw, hw.device_type)}), "
        f"seq {t.seq_len}, global batch {batch}, "
        f"{precision_for(cfg, hw.device_type)}, {t.steps:,} steps"
    )


def stack_line(cfg: Config, hw: GpuProfile) -> str:
    """Which software stack the speed assumes (planner/stack.py), and what replaces it."""
    if hw.device_type != "cuda":
        return "speed: as measured on these CPU processes (the profile's own figures)"
    stack = tessel_stack(cfg.train.compile)
    return (f"speed: tessel's stack, {stack.description} ({stack.name}): "
            f"{stack.factor(hw):.2f} x the profile's matmul efficiency {hw.matmul_efficiency:.3f} "
            f"on {generation(hw)} GPUs, fitted on torchtitan's published runs; "
            "`--calibrate` with a tessel bench JSON of this GPU replaces the assumption"
            + fp8_described(cfg, hw)
            + ("; parallel.async_tp: each block's sequence-parallel transfers hidden behind up "
               f"to (tp-1)/tp of its fused matmuls ({FUSED_SHARE:.2f} of its linears' time: "
               "forward and input gradient)" if cfg.parallel.async_tp else ""))


def table_head(device_type: str) -> str:
    memory, used = columns(device_type)
    return (f"{'rank':>4}  {'layout':58s} {memory:>7} {'step s':>8} {'tokens/s':>12} "
            f"{used:>6}  {'to budget':>9}")


def plan_row(rank: int | str, p: Plan, device_type: str = "cuda") -> str:
    memory, used = (max(len(c), w) for c, w in zip(columns(device_type), (7, 6)))
    return (f"{rank!s:>4}  {p.layout.short():58s} {p.memory.total / GIB:{memory}.1f} "
            f"{p.step.total:8.3f} {p.tokens_per_s:12,.0f} {p.mfu:{used}.1%}  "
            f"{duration(p.time_to_budget_s):>9}")


def breakdown(p: Plan, hw: GpuProfile) -> str:
    g = p.memory.gib()
    parts = ", ".join(f"{k} {g[k]:.2f}" for k in
                      ("parameters", "gradients", "optimizer", "activations", "communication", "margin"))
    verdict = "fits" if p.fits else f"does NOT fit: {p.shortfall_gib:.1f} GiB short"
    s = p.step
    times = [("compute", s.compute_s), ("tp", s.tp_comm_s), ("dp exposed", s.dp_comm_s),
             ("pp", s.pp_comm_s), ("cp exposed", s.cp_comm_s), ("ep all-to-all", s.ep_comm_s),
             ("bubble", s.bubble_s),
             ("optimizer", s.optimizer_s), ("offload", s.offload_s)]
    host = f"; host {g['host']:.2f} GiB" if "host" in g else ""
    during = " during the DPO reference pass" if p.reference and p.reference.is_peak else ""
    return (f"      memory {columns(hw.device_type)[0]}{during} (pipeline rank {p.memory.stage}): "
            f"{parts}; total {g['total']:.2f} of {hw.memory_gib:.1f} ({verdict}){host}\n"
            "      step s: " + ", ".join(f"{k} {v:.3f}" for k, v in times if v or k == "compute")
            + reference_line(p))


def reference_line(p: Plan) -> str:
    """DPO: the reference pass's time and memory (planner/dpo.py), as a line of its own."""
    ref = p.reference
    if ref is None:
        return ""
    line = (f"\n      DPO reference pass before step 1: {ref.pairs:,} pairs (train.steps x global "
            f"batch + the validation share), forward only, dealt out over the data-parallel "
            f"replicas, {duration(ref.seconds)} (in the time to budget); ")
    if ref.memory is None:
        return line + ("memory: the policy's own pass, below a training step's (no gradients "
                       "or optimizer state yet, nothing saved for backward)")
    which = "the peak" if ref.is_peak else "below"
    return line + (f"memory with dpo.reference_model: {ref.memory.total / GIB:.2f} GiB "
                   f"({which}; a training step: {ref.training.total / GIB:.2f} GiB)")


def launch_line(cfg_path: str | None, p: Plan) -> str:
    args = " ".join(f"--{k}={_toml(v)}" for k, v in p.layout.overrides().items()
                    if not _is_default(k, v))
    words = ["tessel train", cfg_path or "", f"--nproc {p.layout.world}", args]
    return " ".join(w for w in words if w)


_DEFAULTS = {"parallel.dp_replicate": 1, "parallel.cp": 1, "parallel.pp": 1, "parallel.tp": 1,
             "parallel.ep": 1, "parallel.cp_mode": "allgather", "parallel.cp_load_balance": True,
             "parallel.offload": "none", "parallel.activation_checkpointing": "none",
             "parallel.pp_schedule": "1f1b", "parallel.pp_virtual_stages": 1,
             "parallel.pp_layers_first": 0, "parallel.pp_layers_last": 0,
             "parallel.sequence_parallel": True}


def _is_default(key: str, value: Any) -> bool:
    return key in _DEFAULTS and _DEFAULTS[key] == value


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return f'"{v}"' if isinstance(v, str) else str(v)


def _rejected_lines(result: SearchResult, hw: GpuProfile) -> list[str]:
    lines: list[str] = []
    if result.too_big:
        lines += ["", "closest layouts that do not fit (short by):"]
        for p in result.too_big[:TOP_REJECTED]:
            lines.append(f"      {p.layout.short()}: needs {p.memory.total / GIB:.1f} GiB of "
                         f"{hw.memory_gib:.1f} ({p.shortfall_gib:.1f} GiB short; "
                         f"{p.tokens_per_s:,.0f} tokens/s if it did)")
    if result.invalid:
        lines += ["", "rejected before evaluation (layouts, first reason given):"]
        for count, example in sorted(result.invalid.values(), key=lambda ce: -ce[0])[:6]:
            lines.append(f"  {count:6d}  {example}")
    return lines


def no_fit_headline(result: SearchResult) -> str:
    """Why nothing fits, in one line: memory only when some layout was evaluated; when every
    layout was refused for a structural reason (a padded vocabulary tp does not divide, tied
    embeddings under pp, ...), that reason and its fix, since more GPUs would not help."""
    if result.evaluated == 0 and result.invalid:
        total = sum(count for count, _ in result.invalid.values())
        count, reason = max(result.invalid.values(), key=lambda ce: ce[0])
        return (f"no layout can run these settings: all {total:,} were refused before "
                f"evaluation, most often ({count:,}) because {reason}")
    return ("no layout fits: more GPUs, a shorter train.seq_len, a smaller model or GPUs with "
            "more memory" + (" (or lift the refusals below)" if result.invalid else ""))


def search_text(cfg: Config, gpus: int, hw: GpuProfile, result: SearchResult, seconds: float,
                cfg_path: str | None, top: int) -> str:
    lines = [header(cfg, gpus, hw), stack_line(cfg, hw),
             f"evaluated {result.evaluated:,} valid layouts in {seconds:.1f} s; "
             f"the {min(top, len(result.plans))} fastest that fit:", "",
             table_head(hw.device_type)]
    for i, p in enumerate(result.plans[:top], 1):
        lines.append(plan_row(i, p, hw.device_type))
        if i == 1:
            lines.append(breakdown(p, hw))
    if not result.plans:
        lines.append("   -  " + no_fit_headline(result))
    lines += _rejected_lines(result, hw)
    if result.plans:
        lines += ["", "run the best: " + launch_line(cfg_path, result.plans[0])]
    lines += ["", "assumptions:"] + [f"  - {a}" for a in ASSUMPTIONS]
    return "\n".join(lines) + "\n"


def single_text(cfg: Config, gpus: int, hw: GpuProfile, p: Plan, nearest: list[Plan]) -> str:
    lines = [header(cfg, gpus, hw), stack_line(cfg, hw), "", table_head(hw.device_type),
             plan_row("-", p, hw.device_type), breakdown(p, hw)]
    if nearest:
        lines += ["", "nearest layouts that fit:"] + [plan_row("", q, hw.device_type)
                                                      for q in nearest]
    elif not p.fits:
        lines += ["", "no layout of this model fits on this many GPUs"]
    lines += ["", "assumptions:"] + [f"  - {a}" for a in ASSUMPTIONS]
    return "\n".join(lines) + "\n"


def as_json(cfg: Config, gpus: int, hw: GpuProfile, plans: list[Plan], too_big: list[Plan],
            invalid: dict[str, tuple[int, str]] | None = None) -> dict[str, Any]:
    return {
        "model": cfg.model.preset, "gpus": gpus, "gpu": hw.name,
        "seq_len": cfg.train.seq_len, "global_batch_size": cfg.train.global_batch_size,
        "precision": precision_for(cfg, hw.device_type),
        "stack": (tessel_stack(cfg.train.compile).name if hw.device_type == "cuda"
                  else "measured"),
        "layouts": [p.as_dict() for p in plans],
        "too_big": [p.as_dict() for p in too_big],
        "rejected": [{"count": c, "reason": r} for c, r in (invalid or {}).values()],
        "assumptions": ASSUMPTIONS,
    }
