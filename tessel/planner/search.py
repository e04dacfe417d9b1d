"""Evaluate one layout, or search every layout tessel can run on N GPUs and rank them.

A layout is valid when tessel's own checks accept it: `ParallelDims.validate`, the config's
combination rules and the trainer's device checks, called here unchanged, so every plan
can be launched as printed. Valid layouts are pruned by predicted memory and ranked by
predicted tokens/s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tessel.config import Config, ModelConfig
from tessel.errors import TesselError
from tessel.models.transformer import flops_per_token
from tessel.parallel.dims import ParallelDims
from tessel.planner.dpo import ReferencePass, as_run, is_dpo, reference_pass
from tessel.planner.fp8 import Fp8Terms, fp8_memory
from tessel.planner.hardware import GpuProfile
from tessel.planner.layout import Layout
from tessel.planner.memory import GIB, Memory, estimate_memory, fsdp_active
from tessel.planner.optimizer import OptimizerSpec
from tessel.planner.speed import MIN_CP_POSITIONS, StepTime, estimate_step
from tessel.planner.stack import Stack, on_stack, tessel_stack

MAX_MICRO_BATCH = 64
MAX_CP = 64  # context-parallel degrees tried: 1, 2, 4, ... up to this (and MIN_CP_POSITIONS)
HOST_USABLE = 0.8  # of a node's host memory, for offloaded state
# Zero-bubble is left out: its memory is predicted only roughly (see memory.in_flight).
SCHEDULES = (("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 4))


@dataclass
class Plan:
    layout: Layout
    memory: Memory
    step: StepTime
    tokens_per_s: float
    mfu: float
    fits: bool
    time_to_budget_s: float
    shortfall_gib: float = 0.0
    """How much more memory than the device has (0 when it fits)."""
    reference: ReferencePass | None = None
    """DPO: the reference log-probabilities' pass before the first step (planner/dpo.py),
    whose time `time_to_budget_s` includes; `memory` is its memory where that is the peak."""

    def as_dict(self) -> dict[str, Any]:
        lay = self.layout
        return {
            "dp": lay.dp, "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard,
            "tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "cp_mode": lay.cp_mode,
            "cp_load_balance": lay.cp_load_balance, "ep": lay.ep, "zero": lay.zero,
            "micro_batch": lay.micro_batch, "activation_checkpointing": lay.activation_checkpointing,
            "offload": lay.offload, "pp_schedule": lay.pp_schedule,
            "pp_virtual_stages": lay.pp_virtual_stages, "pp_layers_first": lay.pp_layers_first,
            "pp_layers_last": lay.pp_layers_last, "sequence_parallel": lay.sequence_parallel,
            "memory_gib": self.memory.gib(), "step_time_s": self.step.total,
            "step_breakdown_s": dict(vars(self.step)),
            "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "fits": self.fits,
            "shortfall_gib": round(self.shortfall_gib, 3),
            "time_to_budget_s": self.time_to_budget_s,
            "overrides": lay.overrides(),
        } | ({} if self.reference is None else {"reference_pass": self._reference()})

    def _reference(self) -> dict[str, Any]:
        ref = self.reference
        assert ref is not None
        return {"pairs": ref.pairs, "seconds": ref.seconds, "is_peak": ref.is_peak,
                "memory_gib": ref.memory.gib() if ref.memory is not None else None,
                "training_memory_gib": ref.training.gib()}


@dataclass
class SearchResult:
    plans: list[Plan]
    """Layouts that fit, fastest first."""
    too_big: list[Plan]
    """The fastest layouts that do not fit, with their shortfall."""
    invalid: dict[str, tuple[int, str]] = field(default_factory=dict)
    """Layouts rejected before evaluation: kind of reason -> (how many, one full message)."""
    evaluated: int = 0


def precision_for(cfg: Config, device_type: str = "cuda") -> str:
    """The precision a plan assumes: `auto` is bf16 on a GPU, fp32 on a CPU (as the trainer
    resolves it)."""
    if cfg.train.precision == "auto":
        return "bf16" if device_type == "cuda" else "fp32"
    return cfg.train.precision


def evaluate(cfg: Config, layout: Layout, hw: GpuProfile, device_type: str | None = None,
             dp_overlap: float | None = None, stack: Stack | None = None) -> Plan:
    """`device_type` None: the profile's (`hw.device_type`); `stack` None: tessel's own
    (planner/stack.py: compiled blocks or eager, as train.compile says)."""
    device_type = device_type or hw.device_type
    t, m = cfg.train, cfg.model
    precision = precision_for(cfg, device_type)
    opt = OptimizerSpec.from_config(cfg.optim)
    # DPO: twice the rows of the configured pairs through the model (planner/dpo.py)
    rows, batch, document_mask = as_run(cfg, layout)
    flex = device_type == "cuda"
    mem = estimate_memory(m, rows, t.seq_len, batch, precision, document_mask,
                          cfg.lora if cfg.lora.enabled else None, flex_attention=flex,
                          optimizer=opt)
    # train.fp8 (planner/fp8.py): its casts on the FSDP shard of a weight, where it is one
    fp8 = Fp8Terms.of(cfg, hw, layout.dp_shard * layout.cp if fsdp_active(layout) else 1)
    mem = fp8_memory(mem, m, rows, t.seq_len, fp8)
    run_hw = on_stack(hw, stack or tessel_stack(t.compile))
    step = estimate_step(m, rows, run_hw, t.seq_len, batch, precision,
                         dp_overlap, opt, fp8=fp8, async_tp=cfg.parallel.async_tp)
    tokens = batch * t.seq_len
    tps = tokens / step.total
    # MoE: FLOPs of the active parameters (the top_k experts a token is sent to).
    mfu = _flops_per_token(m, t.seq_len) * tps / (layout.world * hw.bf16_flops)
    ref = (reference_pass(cfg, rows, run_hw, precision, opt, fp8, flex, mem)
           if is_dpo(cfg) else None)
    host = mem.host  # the training step's: more than the reference pass puts there
    if ref is not None and ref.is_peak and ref.memory is not None:
        mem = ref.memory  # the peak is the reference pass's
    shortfall = mem.total / GIB - hw.memory_gib
    # Offloaded state shares the node's host memory (80% of it usable, the rest for the OS,
    # the data loader and pinned staging).
    per_node = min(hw.gpus_per_node, layout.world)
    host_short = host * per_node / GIB - HOST_USABLE * hw.host_memory_gib
    fits = shortfall <= 0 and host_short <= 0
    budget = t.steps * tokens / tps
    if ref is not None:
        budget += ref.seconds
    return Plan(layout, mem, step, tps, mfu, fits, budget,
                max(shortfall, host_short / per_node, 0.0), ref)


_FLOPS: dict[int, tuple[ModelConfig, int, int]] = {}


def _flops_per_token(m: ModelConfig, seq_len: int) -> int:
    """flops_per_token, remembered per model object and sequence length: a search evaluates
    thousands of layouts of one model, and DeepSeek-V3's 61 layers cost ~1 ms a count."""
    hit = _FLOPS.get(id(m))
    if hit is None or hit[0] is not m or hit[1] != seq_len:
        if len(_FLOPS) > 64:
            _FLOPS.clear()
        hit = _FLOPS[id(m)] = (m, seq_len, flops_per_token(m, seq_len))
    return hit[2]


def trainer_refusal(cfg: Config, layout: Layout, device_type: str = "cuda", full: bool = False
                    ) -> str | None:
    """None if the trainer runs `layout` for `cfg` on `device_type` devices, else what it says
    (one line): the config's combination rules, then `tessel.parallel.check.check_layout`
    (the one layout check, ParallelDims.validate and expert parallelism's rules included), as
    the trainer calls it. `full` also re-validates the whole config (what a launch does)."""
    from tessel.parallel.check import check_layout

    try:
        if full:
            c = cfg.with_overrides(layout.overrides())
        else:
            c = layout.applied(cfg)
            c.parallel.check_combinations()  # the config's own rules, which a copy skips
        dims = ParallelDims.from_config(c.parallel, layout.world)
        check_layout(c, dims, device_type, precision_for(cfg, device_type))
    except (TesselError, ValueError) as exc:
        return str(exc)
    return None


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _pipeline_splits(n_layers: int, stages: int) -> list[tuple[int, int]]:
    """(pp_layers_first, pp_layers_last): an even split, else lighter first and last stages
    (they also hold the embeddings and the head), else none."""
    if n_layers % stages == 0:
        return [(0, 0)]
    if stages == 2:
        return [(n_layers // 2, n_layers - n_layers // 2)]
    middle = math.ceil(n_layers / stages)
    rest = n_layers - middle * (stages - 2)
    if rest >= 2:
        return [(rest // 2, rest - rest // 2)]
    return []


def candidates(cfg: Config, gpus: int, hw: GpuProfile,
               device_type: str | None = None) -> list[Layout]:
    """Every layout worth evaluating on `gpus` GPUs (validity is checked separately). On a
    CPU nothing is offloaded: host memory is the device's."""
    device_type = device_type or hw.device_type  # None: the profile's
    m, t = cfg.model, cfg.train
    out: list[Layout] = []
    for tp, cp, cp_mode in _sequence_splits(cfg, gpus, hw):
        for pp in _divisors(gpus // (tp * cp)):
            if pp > m.n_layers:
                continue
            dp = gpus // (tp * cp * pp)
            if t.global_batch_size % dp:
                continue
            per_rank = t.global_batch_size // dp
            schedules = SCHEDULES if pp > 1 else (("1f1b", 1),)
            for schedule, v in schedules:
                for first, last in _pipeline_splits(m.n_layers, pp * v):
                    zeros = (0,) if dp * cp == 1 else (0, 1, 2, 3)
                    for zero in zeros:
                        replicas = _replica_counts(zero, dp, hw.gpus_per_node // (tp * cp))
                        offloads = _offloads(device_type, zero)
                        for rep in replicas:
                            for ep in _expert_degrees(m, (dp // rep) * cp * tp, zero):
                                for mbs in _divisors(per_rank):
                                    if mbs > MAX_MICRO_BATCH:
                                        break
                                    if pp > 1 and per_rank // mbs < pp:
                                        continue
                                    for ac in ("none", "selective", "matmuls", "full"):
                                        for offload in offloads:
                                            out.append(Layout(
                                                rep, dp // rep, tp, pp, cp, zero, mbs, ac,
                                                offload, schedule, v, first, last, ep=ep,
                                                cp_mode=cp_mode,
                                                cp_load_balance=cfg.parallel.cp_load_balance))
    return out


def _replica_counts(zero: int, dp: int, per_node: int) -> list[int]:
    """Data-parallel replica counts worth trying at ZeRO stage `zero`: 1 (shard over every
    data-parallel rank) and, where `dp` spans whole nodes of `per_node` ranks, one replica
    per node's worth (HSDP: shard within a node); every rank a replica without sharding."""
    if zero == 0:
        return [dp]  # nothing sharded: every rank a replica
    replicas = [1]
    if zero >= 1 and per_node >= 1 and dp > per_node and dp % per_node == 0:
        replicas.append(dp // per_node)  # HSDP: shard within a node
    return replicas


def _offloads(device_type: str, zero: int) -> list[str]:
    """What may be offloaded to the host: nothing on a CPU (host memory is the device's);
    on CUDA the optimizer states, and the parameters too at ZeRO-3."""
    offloads = ["none"]
    if device_type == "cuda":
        offloads += ["optimizer"] + (["params"] if zero == 3 else [])
    return offloads


def _sequence_splits(cfg: Config, gpus: int, hw: GpuProfile) -> list[tuple[int, int, str]]:
    """(tp, cp, cp_mode) worth trying: tp within a node dividing the key/value heads; cp a
    power of two up to MAX_CP that leaves each rank MIN_CP_POSITIONS positions or more, cuts
    train.seq_len into its chunks (2 x cp of them with cp_load_balance) and leaves each
    rank's positions divisible by tp (sequence parallelism); each cp in the allgather mode
    and, where both head counts per tp rank divide by it, in the ulysses mode (only the
    configured mode when parallel.cp_mode is set)."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    pieces = 2 if p.cp_load_balance else 1
    modes = ((p.cp_mode,) if "cp_mode" in p.model_fields_set else ("allgather", "ulysses"))
    out = []
    for tp in _divisors(gpus):
        if tp > hw.gpus_per_node or m.n_kv_heads % tp:
            continue
        out.append((tp, 1, "allgather"))
        cp = 2
        while (cp <= MAX_CP and t.seq_len // cp >= MIN_CP_POSITIONS and gpus % (tp * cp) == 0
               and t.seq_len % (pieces * cp) == 0):
            if (t.seq_len // cp) % tp == 0:
                out += [(tp, cp, mode) for mode in modes if mode == "allgather" or (
                    (m.n_heads // tp) % cp == 0 and (m.n_kv_heads // tp) % cp == 0)]
            cp *= 2
    return out


def _expert_degrees(m: ModelConfig, borrowable: int, zero: int) -> list[int]:
    """Expert-parallel degrees worth trying: 1 for a dense model; for an MoE model every
    divisor of moe_experts that divides the dp_shard x cp x tp ranks ep borrows (ZeRO >= 1)."""
    if not m.moe_experts or zero == 0:
        return [1]
    return [e for e in _divisors(m.moe_experts) if borrowable % e == 0]


def _reason_kind(reason: str) -> str:
    """Group rejection messages by their first clause with the numbers taken out."""
    head = reason.split(";")[0]
    return "".join("N" if c.isdigit() else c for c in head)


def search(cfg: Config, gpus: int, hw: GpuProfile, keep: int = 10,
           device_type: str | None = None) -> SearchResult:
    """Evaluate every valid candidate; the fastest that fit and the closest that do not
    (`device_type` None: the profile's)."""
    device_type = device_type or hw.device_type
    fits: list[Plan] = []
    big: list[Plan] = []
    invalid: dict[str, tuple[int, str]] = {}
    checked: dict[tuple, str | None] = {}
    kinds: dict[str, str] = {}
    n = 0
    for layout in candidates(cfg, gpus, hw, device_type):
        # Validity depends on the degrees, schedule, split, micro-batch and offload only.
        key = (layout.dp_replicate, layout.tp, layout.pp, layout.cp, layout.zero,
               layout.pp_schedule, layout.pp_virtual_stages, layout.pp_layers_first,
               layout.micro_batch, layout.offload, layout.ep, layout.cp_mode)
        if key not in checked:
            checked[key] = trainer_refusal(cfg, layout, device_type)
        reason = checked[key]
        if reason is not None:
            kind = kinds.get(reason) or kinds.setdefault(reason, _reason_kind(reason))
            count, example = invalid.get(kind, (0, reason))
            invalid[kind] = (count + 1, example)
            continue
        n += 1
        plan = evaluate(cfg, layout, hw, device_type)
        (fits if plan.fits else big).append(plan)
    fits.sort(key=_rank_key)
    big.sort(key=lambda p: (p.shortfall_gib, -p.tokens_per_s))
    return SearchResult(fits[:keep], big[:keep], invalid, n)


def _rank_key(p: Plan) -> tuple[int, float, float]:
    """Fastest first; predictions within 0.5% of each other count as a tie, broken by less
    communication (a prediction that leans less on overlap) and then less memory."""
    return (-math.floor(math.log(p.tokens_per_s) / math.log(1.005)), p.step.raw_comm_s,
            p.memory.total)


def _changes(a: Layout, b: Layout) -> int:
    return sum(getattr(a, f) != getattr(b, f) for f in (
        "dp_replicate", "dp_shard", "tp", "pp", "cp", "zero", "micro_batch",
        "activation_checkpointing", "offload", "pp_schedule", "pp_virtual_stages", "ep"))


def nearest_fitting(cfg: Config, current: Layout, hw: GpuProfile, limit: int = 3) -> list[Plan]:
    """Layouts on the same number of GPUs that fit: fewest changes from `current` first,
    then the fastest."""
    result = search(cfg, current.world, hw, keep=10**9)
    return sorted(result.plans, key=lambda p: (_changes(p.layout, current), -p.tokens_per_s))[:limit]


def check_fits(cfg: Config, world: int, hw: GpuProfile) -> tuple[Plan, list[Plan]]:
    """The plan of the configured layout and, when it does not fit, the nearest that do."""
    layout = Layout.from_config(cfg, world)
    plan = evaluate(cfg, layout, hw)
    return plan, ([] if plan.fits else nearest_fitting(cfg, layout, hw))
