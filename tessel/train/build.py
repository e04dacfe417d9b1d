"""Everything a run needs, from its config: the checks that may refuse it (all of them before
anything is written: `check_run`) and the parts the trainer orchestrates (`build_run`), each
given the parts it needs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tessel.checkpoint.hf_models import check_export
from tessel.checkpoint.manager import CheckpointManager
from tessel.config import Config
from tessel.data import build_data
from tessel.launch.elastic import replan_if_elastic
from tessel.observe.alerts import check_alerts
from tessel.observe.comm import CommMeter
from tessel.observe.events import EventLog
from tessel.observe.timing import PhaseTimer
from tessel.observe.watchdog import Watchdog
from tessel.optim.groups import build_optimizer, check_muon_force
from tessel.parallel.apply import build_parallel_model
from tessel.parallel.check import check_layout
from tessel.parallel.dims import ParallelDims, flat_mesh, resolved
from tessel.parallel.dist import init_distributed
from tessel.parallel.fp8 import check_fp8
from tessel.parallel.replica_group import data_share, replica_groups
from tessel.planner.prelaunch import auto_layout, refuse_if_too_big
from tessel.train.control import StopControl, stop_at_once
from tessel.train.device import pick_device
from tessel.train.dpo_run import check_dpo, dpo_objective, reference_model_step
from tessel.train.eval import Evaluator
from tessel.train.faults import Faults
from tessel.train.final_sample import FinalSample
from tessel.train.harness import Harness
from tessel.train.harness_check import check_lm_eval
from tessel.train.lifecycle import Lifecycle
from tessel.train.precision import resolve_precision
from tessel.train.recovery import Recovery, SkipList
from tessel.train.resume import check_tokenizer
from tessel.train.state import Counters, RunState
from tessel.train.step import TrainStep


@dataclass
class Checked:
    """The config as checked (auto layout, zero stage and elastic re-plan taken) and what
    the checks decided."""

    cfg: Config
    device: torch.device
    precision: Any
    dims: ParallelDims
    zero_as_given: Any  # saved: auto takes a resume's layout's stage
    mbs_as_given: int  # saved: each restart re-plans from it
    faults: Faults
    lm_eval_tasks: Any


def check_run(cfg: Config, proc: Any, resume: bool, force: bool, say: Any) -> Checked:
    """Everything that can reject the input, before anything is written."""
    check_export(cfg)  # checkpoint.hf_export_interval of a model HF cannot hold
    device = pick_device(cfg.train.device)
    cfg = auto_layout(cfg, device, proc.world_size, say)
    zero_as_given = cfg.parallel.zero
    cfg, note = resolved(cfg)  # parallel.zero = auto -> the stage the layout takes
    if note:
        say(note)
    precision = resolve_precision(cfg.train.precision, device)
    dims = ParallelDims.from_config(cfg.parallel, proc.world_size)
    mbs_as_given = cfg.train.micro_batch_size
    cfg = replan_if_elastic(cfg, dims, say)
    check_layout(cfg, dims, device, precision.name)
    check_dpo(cfg, dims)
    refuse_if_too_big(cfg, device, proc.world_size, force, say)
    check_fp8(cfg, device, dims.tp, say)
    check_alerts(cfg.alerts, cfg.notify)
    faults = Faults(proc.rank, world_size=proc.world_size, steps=cfg.train.steps)
    if not resume:  # a resumed run keeps its patterns (optim.muon_force is frozen)
        check_muon_force(cfg)
    lm_eval_tasks = check_lm_eval(cfg)  # unknown task names: refused now, not in an hour
    return Checked(cfg, device, precision, dims, zero_as_given, mbs_as_given, faults,
                   lm_eval_tasks)


@dataclass
class Parts:
    """What `build_run` makes: the run's parts, and the config and device as they end up
    (a model.init_from's tokenizer, the process group's device)."""

    cfg: Config
    device: torch.device
    lora_base: str | None
    data: Any
    model: Any
    optimizers: list[Any]
    timer: PhaseTimer
    events: EventLog
    alerts: Any
    watchdog: Watchdog
    train_step: TrainStep
    evaluator: Evaluator
    harness: Harness | None
    recovery: Recovery
    control: StopControl
    comm: CommMeter
    checkpoints: CheckpointManager
    state: RunState
    lifecycle: Lifecycle
    sample: FinalSample


def build_run(c: Checked, proc: Any, run: Any, display: Any, counters: Counters,
              resume_from: tuple[Path, dict[str, Any]] | None) -> Parts:
    """Everything the run needs, from the checked config `c`: data, model, the parts.
    `run`: the RunDir; `counters`: the run's Counters (the watchdog's beats read the step)."""
    say, cfg, dims, device = display.print, c.cfg, c.dims, c.device
    source, cfg, lora_base = _weights_source(cfg, resume_from, say)

    mesh = None
    if proc.distributed:
        device = init_distributed(proc, device, cfg.parallel.timeout_s)
        mesh = dims.build_mesh(device.type)
    data = load_data(cfg, proc, *data_share(cfg, flat_mesh(mesh, "dp").get_local_rank()
                                            if mesh is not None else 0, dims.dp), say)
    if resume_from is not None:
        check_tokenizer(run, data.tokenizer)

    torch.manual_seed(cfg.train.seed)
    param_dtype = torch.bfloat16 if c.precision.name == "bf16" else None
    model = build_parallel_model(cfg, dims, mesh, device, param_dtype,
                                 source.get if source is not None else None,
                                 source.buffer if source is not None else None)
    optimizers = [build_optimizer(m, cfg.optim, device, cfg.parallel.offload == "optimizer")
                  for m in model.inner]
    timer = PhaseTimer(device)
    events, alerts, watchdog = _monitoring(cfg, proc, run, say)
    beat = lambda what: watchdog.beat(counters.step, what)  # noqa: E731
    t = cfg.train
    train_step = TrainStep(
        model, optimizers, dims, mesh, device, c.precision,
        accum=t.global_batch_size // (t.micro_batch_size * dims.dp * replica_groups(cfg)),
        grad_clip=t.grad_clip, parallel_cfg=cfg.parallel, distributed=proc.distributed,
        timer=timer, phase=watchdog.phase, masked=cfg.data.source == "sft")
    if cfg.train.objective == "dpo":  # the loss hook, and the reference log-probabilities
        other = ((lambda: reference_model_step(cfg, train_step, mesh, say))
                 if cfg.dpo.reference_model else None)  # dpo.reference_model's weights
        train_step.objective = dpo_objective(cfg, train_step, data, run.path,
                                             resume_from is not None, proc, say, other)
    evaluator = Evaluator(train_step, data.val, t.eval_iters, beat=beat,
                          interval=t.eval_interval, last=t.steps)
    harness = (Harness(cfg, c.lm_eval_tasks, train_step, data.tokenizer, beat=beat)
               if cfg.lm_eval.enabled else None)
    recovery = Recovery(cfg.recovery, SkipList(
        run.skipped_batches, cfg.recovery.skip_batches, writer=proc.is_main))
    control = StopControl(proc.distributed, device.type, watchdog.phase)
    comm = CommMeter(device, cfg.metrics.comm_sample_interval, proc.distributed,
                     control.cpu_group, say,  # exposed communication, sampled steps
                     after=cfg.metrics.comm_sample_after)
    checkpoints = _checkpoints(cfg, proc, run, say, model, optimizers, watchdog, control)
    state = run_state(model, optimizers, data, c.precision, counters, recovery, alerts)
    lifecycle = Lifecycle(cfg, run, proc, dims, device, display, events, alerts, control,
                          counters)
    sample = FinalSample(cfg, model.inner[0], data.tokenizer, run.path, proc.distributed)
    return Parts(cfg, device, lora_base, data, model, optimizers, timer, events, alerts,
                 watchdog, train_step, evaluator, harness, recovery, control, comm,
                 checkpoints, state, lifecycle, sample)


def _weights_source(cfg: Any, resume_from: tuple[Path, dict[str, Any]] | None,
                    say: Any) -> tuple[Any, Any, Any]:
    """(the weights to start from or None, the config as the source completed it, the LoRA
    base's fingerprint or None)."""
    # A LoRA run's checkpoints hold only its adapters: the frozen base is read from
    # model.init_from on every start, resumes included, and must be the one it was.
    lora = cfg.lora.enabled
    source = None
    if resume_from is None or lora:
        source, cfg = init_source(cfg, say)
    lora_base = None
    if lora:
        from tessel.checkpoint.lora import base_fingerprint, check_base

        lora_base = base_fingerprint(cfg)
        if resume_from is not None:
            check_base(resume_from[1], lora_base, resume_from[0], cfg.model.init_from)
    return source, cfg, lora_base


def _monitoring(cfg: Any, proc: Any, run: Any, say: Any) -> tuple[EventLog, Any, Watchdog]:
    """The event log, the alert rules (main rank, when configured) and the watchdog, which
    tells the stall alert when no progress is seen."""
    alerts = None
    events = EventLog(run.events, enabled=proc.is_main)
    if proc.is_main and cfg.alerts:
        from tessel.observe.alerts import AlertCenter

        alerts = AlertCenter(cfg.alerts, cfg.notify, str(run.path), events, say)
    on_wait = None
    if alerts is not None and any(a.when == "step_time.stall" for a in cfg.alerts):
        def on_wait(seconds: float, step: int) -> None:  # the watchdog's thread, no progress
            alerts.handle(alerts.rules.stalled(seconds, step))
    watchdog = Watchdog(cfg.watchdog.timeout_s, run.watchdog, proc.rank, proc.world_size,
                        on_wait=on_wait,
                        on_fire=lambda msg, step: events.write("watchdog", step, msg))
    return events, alerts, watchdog


def _checkpoints(cfg: Any, proc: Any, run: Any, say: Any, model: Any, optimizers: list[Any],
                 watchdog: Watchdog, control: StopControl) -> CheckpointManager:
    """The checkpoint manager, with the Hugging Face exporter on the main rank when
    checkpoint.hf_export_interval asks for exports during training."""
    hf_export = None
    if proc.is_main and cfg.checkpoint.hf_export_interval:
        from tessel.checkpoint.hf_export import HFExporter

        hf_export = HFExporter(cfg.checkpoint.hf_export_interval, run.hf_export_log, say,
                               peft=cfg.lora.enabled and cfg.lora.export == "peft",
                               drop_expert_bias=cfg.checkpoint.hf_export_drop_expert_bias)
    return CheckpointManager(
        run.checkpoints, model.inner, optimizers, keep_last=cfg.checkpoint.keep_last,
        async_save=cfg.checkpoint.async_save, distributed=proc.distributed,
        hf_export=hf_export, phase=watchdog.phase, barrier_group=control.cpu_group,
        interval=cfg.checkpoint.interval)


def run_state(model: Any, optimizers: list[Any], data: Any, precision: Any,
              counters: Counters, recovery: Recovery, alerts: Any) -> RunState:
    """The registry of the run's stateful parts (tessel.train.state), in the order they load:
    the data position first, so that other data is refused before anything changed."""
    state = RunState(model.inner, optimizers)
    state.add("loader", data.train)
    if precision.scaler is not None:
        state.add("scaler", precision.scaler, default=None)
    state.add(None, counters)
    if recovery.enabled:
        state.add("recovery", recovery, default={})
    if alerts is not None:
        state.add("alerts", alerts.rules, default=[])
    return state


def init_source(cfg: Config, say: Any) -> tuple[Any, Config]:
    """The weights of model.init_from (None without one), and the config with their
    tokenizer when the data's is left to `auto` (a fine-tune must read text with the
    tokenizer the weights know)."""
    if not cfg.model.init_from:
        return None, cfg
    from tessel.checkpoint.init_from import WeightSource, check_shape

    check_shape(cfg.model, Path(cfg.model.init_from))  # Config.load's defaults
    source = WeightSource(Path(cfg.model.init_from), cfg.model)
    say(f"tessel: initialising from {source.kind} {source.path}")
    if cfg.data.tokenizer == "auto" and source.tokenizer.is_file():
        cfg = cfg.with_overrides({"data.tokenizer": str(source.tokenizer)})  # saved too
        say(f"tessel: tokenizer from {source.tokenizer}")
    return source, cfg


def load_data(cfg: Config, proc: Any, dp_rank: int, dp: int, say: Any) -> Any:
    """This process's share (`dp_rank` of `dp`) of every global batch. Rank 0 builds any
    corpus cache first; the others then read it. SIGTERM stops it at once."""
    build = lambda: build_data(cfg, dp_rank, dp, console=say)  # noqa: E731
    with stop_at_once("preparing the data"):
        if not proc.distributed:
            return build()
        data = build() if proc.is_main else None
        dist.barrier()
        return data if data is not None else build()
