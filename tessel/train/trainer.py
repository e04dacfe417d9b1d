"""The training loop, for one process or one rank of any parallel layout.

`Trainer(cfg).train()` runs a whole job: checks the run directory, builds data, model and
optimizer, trains with gradient accumulation and mixed precision, evaluates, logs, saves
atomic checkpoints (periodically, at the end and on SIGTERM/SIGINT) and resumes from them
bit-exactly. Under torchrun every rank runs it; the layout (tessel.parallel) decides which
part of the model and which data each rank holds, and rank 0 alone prints and writes
metrics.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tessel.checkpoint import (
    CheckpointError,
    PendingSave,
    latest_checkpoint,
    load_model,
    load_optimizer,
    load_tensors,
    read_state,
    save_checkpoint,
)
from tessel.config import Config
from tessel.data import Batch, build_data, load_tokenizer
from tessel.errors import CollectiveTimeout, DataError, TesselError
from tessel.fileio import write_text_atomic
from tessel.generate import sample
from tessel.models import flops_per_token, param_count
from tessel.observe.alerts import ACTIONS, check_alerts
from tessel.observe.console import ConsoleDisplay
from tessel.observe.events import EventLog
from tessel.observe.metrics import MetricsWriter
from tessel.observe.mfu import device_peak_flops
from tessel.observe.timing import PhaseTimer
from tessel.observe.watchdog import Watchdog
from tessel.parallel.apply import build_parallel_model
from tessel.parallel.context import check_context_parallel, context_parallel_step
from tessel.parallel.dims import ParallelDims, ParallelError
from tessel.parallel.dist import all_reduce_sum, init_distributed, process_info, shutdown
from tessel.parallel.fsdp import check_offload
from tessel.parallel.grad_norm import clip_grad_norm
from tessel.parallel.pipeline import build_schedule
from tessel.parallel.tensor import local_value, loss_context
from tessel.train.faults import Faults
from tessel.train.fp8 import check_fp8
from tessel.train.loss import token_loss_sum
from tessel.train.optim import build_optimizer, lr_at
from tessel.train.precision import resolve_precision
from tessel.train.recovery import RecoveryGaveUp, SkipList, SpikeDetector

# Changing these on resume would silently change what the checkpoint means.
# (Mixture weights and cache locations may change; the loader checks the datasets themselves.)
_FROZEN_ON_RESUME = (
    "model", "data.source", "data.tokenizer", "data.split", "data.json_key", "train.seq_len",
    "train.seed",
)

# Exit codes of runs that end early on purpose (README "Exit codes").
EXIT_PAUSED, EXIT_STOPPED = 4, 5
# Signals that ask for a checkpoint and a clean exit: SIGTERM (schedulers, torchrun),
# SIGUSR1 (SLURM's warning before the time limit, `#SBATCH --signal=USR1@120`), SIGINT.
_STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")
# Run directory marker of a run that paused or stopped on purpose: --auto-resume (job
# scripts, torchrun restarts) honours it; an explicit --resume clears it.
HALTED_FILE = "HALTED.json"


class RunHalted(TesselError):
    """--auto-resume on a run that paused or stopped on purpose; exits with its code."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class TrainResult:
    step: int
    """Optimizer steps completed."""
    loss: float | None
    """Training loss of the last step."""
    val_loss: float | None
    """Validation loss of the last evaluation."""
    unigram_baseline: float
    """Validation loss of a context-free unigram model, for comparison."""
    stopped_by: str | None
    """Why training stopped early: a signal name (SIGTERM, SIGUSR1, SIGINT), "pause" or
    "stop" (an alert's action), else None."""
    run_dir: Path

    @property
    def exit_code(self) -> int:
        return {"SIGINT": 130, "pause": EXIT_PAUSED, "stop": EXIT_STOPPED}.get(self.stopped_by or "", 0)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise TesselError("train.device='cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
    return torch.device(name)


class Trainer:
    def __init__(self, cfg: Config, resume: bool = False, console: bool = True,
                 force: bool = False, auto_resume: bool = False):
        self.run_dir = Path(cfg.run.dir)
        self.auto_resume = auto_resume
        self.ckpt_root = self.run_dir / "checkpoints"
        self.proc = process_info()
        self.display = ConsoleDisplay(cfg.train.steps, enabled=console and self.proc.is_main)

        # Everything that can reject the input happens before anything is written.
        self.device = pick_device(cfg.train.device)
        self.cfg = cfg = self._plan(cfg, force)
        self.dims = ParallelDims.from_config(cfg.parallel, self.proc.world_size)
        self.dims.validate(cfg)
        resume_from = self._check_run_dir(resume)
        self.init_source = self._init_source() if resume_from is None else None
        self._check_layout_on_device()
        self.precision = resolve_precision(cfg.train.precision, self.device)
        self.mesh = None
        if self.proc.distributed:
            self.device = init_distributed(self.proc, self.device, cfg.parallel.timeout_s)
            self.mesh = self.dims.build_mesh(self.device.type)
        self.peak_flops = device_peak_flops(self.device)
        self.dp_rank = self.mesh["dp"].get_local_rank() if self.mesh is not None else 0
        # The ranks that report the loss: in each data-parallel replica, the last pipeline
        # stage's first tensor-parallel rank, once per context-parallel part of the sequence.
        self.reports_loss = self._holds_last_stage() and (
            self.mesh is None or self.mesh["tp"].get_local_rank() == 0
        )
        self.cp_mesh = self.mesh["cp"] if self.mesh is not None and self.dims.cp > 1 else None
        self.data = self._build_data()
        self.tokenizer = self.data.tokenizer
        if resume_from is not None:
            self._check_tokenizer()

        torch.manual_seed(cfg.train.seed)
        param_dtype = torch.bfloat16 if self.precision.name == "bf16" else None
        initial = self.init_source.get if self.init_source is not None else None
        self.model = build_parallel_model(cfg, self.dims, self.mesh, self.device, param_dtype,
                                          initial)
        offload_optimizer = cfg.parallel.offload == "optimizer"
        self.optimizers = [build_optimizer(m, cfg.optim, self.device, offload_optimizer)
                           for m in self.model.inner]
        self.accum = cfg.train.global_batch_size // (cfg.train.micro_batch_size * self.dims.dp)
        self._loss_tokens = 1  # the divisor of the pipeline's loss function (see _train_step)
        self.schedule = None
        if self.dims.pp > 1:
            assert self.mesh is not None
            stages = list(zip(self.model.stage_ids, self.model.parts))
            self.schedule = build_schedule(stages, cfg.parallel, self.mesh["pp"], self.device,
                                           self.accum, self._pipeline_loss)
        self.step = 0
        self.batches_drawn = 0  # global batches taken from the stream, skipped ones included
        self.tokens_seen = 0
        self.events = EventLog(self.run_dir, enabled=self.proc.is_main)
        self.faults = Faults(self.proc.rank)
        self.timer = PhaseTimer(self.device)
        self.skips = SkipList(self.run_dir, cfg.recovery.skip_batches, writer=self.proc.is_main)
        self.spikes = SpikeDetector(cfg.recovery) if cfg.recovery.spike_sigma > 0 else None
        self.alerts = None
        if self.proc.is_main and cfg.alerts:
            from tessel.observe.alerts import AlertCenter

            self.alerts = AlertCenter(cfg.alerts, cfg.notify, str(self.run_dir), self.events,
                                      self.display.print)
        self._alert_action = "continue"  # the strongest action asked for, not yet acted on
        self._loss_factor = 1.0  # fault injection only (TESSEL_FAULT)
        stall_rules = self.alerts is not None and any(a.when == "step_time.stall" for a in cfg.alerts)
        self.watchdog = Watchdog(cfg.watchdog.timeout_s, self.run_dir, self.proc.rank,
                                 self.proc.world_size, on_wait=self._on_wait if stall_rules else None,
                                 on_fire=self._on_watchdog)
        self.elapsed_prev = 0.0
        self.last_saved_step = -1
        self.last_val_loss: float | None = None
        self._pending_save: PendingSave | None = None
        self._save_written = True
        self.hf_export = None
        if self.proc.is_main and cfg.checkpoint.hf_export_interval:
            from tessel.checkpoint.hf_export import HFExporter

            self.hf_export = HFExporter(cfg.checkpoint.hf_export_interval,
                                        self.run_dir / "hf-export.log", self.display.print)
        if resume_from is not None:
            self._restore(*resume_from)
        self._stop_signal: int | None = None

    def _plan(self, cfg: Config, force: bool) -> Config:
        """Ask the planner before anything is built: the layout when parallel.auto is set,
        and whether the layout is predicted to fit in device memory (a GPU's; on a CPU the
        memory is the host's, shared and swappable, so nothing is refused there)."""
        from tessel.planner.prelaunch import MemoryRefusal, check_memory, choose_layout, device_profile

        hw = device_profile(self.device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        world = self.proc.world_size
        if cfg.parallel.auto:
            cfg, plan = choose_layout(cfg, world, hw, self.device.type)
            self.display.print(
                f"tessel: parallel.auto chose {plan.layout.short()} for {world} x {hw.name} "
                f"({hw.memory_gib:.0f} GiB each): the fastest of the layouts predicted to fit "
                f"(predicted {plan.memory.total / 2**30:.1f} GiB per device, "
                f"{plan.tokens_per_s:,.0f} tokens/s)"
            )
            return cfg
        ParallelDims.from_config(cfg.parallel, world).validate(cfg)
        if self.device.type != "cuda":
            return cfg
        _, refusal = check_memory(cfg, world, hw)
        if refusal is not None and not force:
            raise MemoryRefusal(refusal)
        if refusal is not None:
            self.display.print(f"tessel: --force: {refusal.split('; layouts')[0]}; trying anyway")
        return cfg

    def _init_source(self):  # noqa: ANN202
        """The weights of model.init_from for a new run, and their tokenizer when the data's
        is left to `auto` (a fine-tune must read text with the tokenizer the weights know)."""
        if not self.cfg.model.init_from:
            return None
        from tessel.checkpoint.init_from import WeightSource

        source = WeightSource(Path(self.cfg.model.init_from), self.cfg.model)
        self.display.print(f"tessel: initialising from {source.kind} {source.path}")
        if self.cfg.data.tokenizer == "auto" and source.tokenizer.is_file():
            self.cfg = self.cfg.with_overrides({"data.tokenizer": str(source.tokenizer)})
            self.display.print(f"tessel: tokenizer from {source.tokenizer}")
        return source

    def _check_layout_on_device(self) -> None:
        p = self.cfg.parallel
        check_offload(p, self.device)
        if p.dp_comm_hook == "bf16" and self.device.type != "cuda":
            raise ParallelError(
                "dp_comm_hook='bf16' needs NCCL (CUDA); on CPU use 'fp16' or 'powersgd'"
            )
        check_context_parallel(self.cfg, self.device)
        check_fp8(self.cfg, self.device)
        check_alerts(self.cfg.alerts, self.cfg.notify)
        if self.cfg.train.precision == "fp16" and (self.dims.world_size > 1 and (
            p.zero > 0 or self.dims.tp > 1 or self.dims.pp > 1
        )):
            raise ParallelError(
                "fp16 loss scaling is supported for one process or DDP (zero=0) only; use "
                "train.precision='bf16' (no loss scaling needed) for sharded layouts"
            )

    def _holds_last_stage(self) -> bool:
        if self.mesh is None or self.dims.pp == 1:
            return True
        n_stages = self.dims.pp * self.cfg.parallel.pp_virtual_stages
        pp_rank = self.mesh["pp"].get_local_rank()
        return (n_stages - 1) % self.dims.pp == pp_rank

    def _build_data(self):  # noqa: ANN202
        """Rank 0 builds any corpus cache first; the others then read it."""
        build = lambda: build_data(self.cfg, self.dp_rank, self.dims.dp, console=self.display.print)
        if not self.proc.distributed:
            return build()
        data = build() if self.proc.is_main else None
        dist.barrier()
        return data if data is not None else build()

    # ---- setup ----------------------------------------------------------------------------

    def _check_run_dir(self, resume: bool) -> tuple[Path, dict[str, Any]] | None:
        """Refuse to overwrite a run, or to resume one incompatibly; returns the checkpoint
        to resume from and its state."""
        holds_run = (self.run_dir / "config.toml").exists() or self.ckpt_root.exists()
        if not resume:
            if holds_run:
                raise TesselError(
                    f"{str(self.run_dir)!r} already holds a run; continue it with "
                    f"`tessel train --resume {self.run_dir}` or choose another --run.dir"
                )
            return None
        if not holds_run:
            raise CheckpointError(f"nothing to resume: {str(self.run_dir)!r} holds no run")
        halted = self._halted()
        if halted is not None and self.auto_resume:
            raise RunHalted(
                f"{self.run_dir} {halted.get('message', 'was halted')}; not resuming it "
                f"automatically: continue it with `tessel train --resume {self.run_dir}`",
                int(halted.get("exit_code", EXIT_PAUSED)),
            )
        ckpt = latest_checkpoint(self.ckpt_root)
        if ckpt is None:  # stopped before its first checkpoint: start it again from step 0
            self.display.print(f"tessel: {self.run_dir} has no checkpoint yet; starting from step 0")
            return None
        state = read_state(ckpt)
        try:
            then = Config.from_dict(state["config"])
        except KeyError:
            raise CheckpointError(f"checkpoint {str(ckpt)!r} lacks its config; it is damaged") from None
        for key in _FROZEN_ON_RESUME:
            old, new = _get(then, key), _get(self.cfg, key)
            if old != new:
                diff = _first_difference(key, old, new)
                raise CheckpointError(
                    f"cannot resume {str(self.run_dir)!r}: {diff}; resume without changing it "
                    f"or start a new run"
                )
        return ckpt, state

    def _check_tokenizer(self) -> None:
        saved = load_tokenizer(self.run_dir / "tokenizer.json")
        if saved.fingerprint() != self.tokenizer.fingerprint():
            raise DataError(
                f"the data's tokenizer differs from the one {str(self.run_dir)!r} was trained "
                "with; resume with the data the run was started with"
            )

    def _restore(self, ckpt: Path, state: dict[str, Any]) -> None:
        load_model(ckpt, self.model.inner)
        load_optimizer(ckpt, self.model.inner, self.optimizers)
        try:
            self.data.train.load_state_dict(state["loader"])
            if self.precision.scaler is not None and state.get("scaler"):
                self.precision.scaler.load_state_dict(state["scaler"])
            rng = load_tensors(ckpt, self._rng_state())
            torch.set_rng_state(rng["torch_cpu"])
            if self.device.type == "cuda" and "torch_cuda" in rng:
                torch.cuda.set_rng_state(rng["torch_cuda"], self.device)
            self.step = self.last_saved_step = int(state["step"])
            self.tokens_seen = int(state["tokens_seen"])
        except KeyError as exc:
            raise CheckpointError(f"checkpoint {str(ckpt)!r} lacks {exc}; it is damaged") from None
        self.elapsed_prev = float(state.get("elapsed_s", 0.0))
        self.last_val_loss = state.get("val_loss")
        self.batches_drawn = int(state.get("batches_drawn", self.step))
        if self.spikes is not None:
            self.spikes.load_state_dict(state.get("recovery", {}))
        if self.alerts is not None:
            self.alerts.rules.load_state_dict(state.get("alerts", []))

    # ---- the loop -------------------------------------------------------------------------

    def train(self) -> TrainResult:
        cfg, t = self.cfg, self.cfg.train
        tokens_per_step = t.global_batch_size * t.seq_len
        if self.step >= t.steps:
            self.display.print(
                f"{self.run_dir} is already at step {self.step} of train.steps={t.steps}; "
                f"pass --train.steps=N with N > {self.step} to train further"
            )
            return self._result(None, None)
        # Written only now that the run really starts: a refused or no-op call leaves the
        # run directory as it was.
        if self.proc.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.run_dir / "config.toml", cfg.to_toml())
            write_text_atomic(self.run_dir / "run.json", json.dumps(self._run_info(), indent=1))
            self.tokenizer.save(self.run_dir / "tokenizer.json")
            (self.run_dir / HALTED_FILE).unlink(missing_ok=True)  # an explicit --resume
        self._announce()
        self._start_event()
        metrics = self._open_metrics() if self.proc.is_main else None
        previous_handlers = self._install_signal_handlers()
        loss = grad_norm = None
        start = time.perf_counter()
        first_step = self.step
        window_start, window_steps = time.perf_counter(), 0
        self.display.start(self.step)
        self.model.train()  # evaluate() puts it back after each evaluation
        self.watchdog.start()
        try:
            while self.step < t.steps:
                self.watchdog.beat(self.step, "step boundary")
                self.faults.at_step(self.step)
                if self._should_stop():
                    break
                loss, grad_norm = self._train_step()
                if self.spikes is not None:
                    bad = self._judge_step(loss, grad_norm)
                    if bad is not None:
                        self._rollback(bad)
                        first_step = min(first_step, self.step)
                        self.timer.discard()
                        window_start, window_steps = time.perf_counter(), 0
                        continue
                self._publish_finished_save()
                self.step += 1
                self.tokens_seen += tokens_per_step
                window_steps += 1
                self.display.step(self.step)
                if self.alerts is not None:
                    self.alerts.rules.progressed()
                if self.step % cfg.metrics.log_interval == 0 or self.step == t.steps:
                    window = time.perf_counter() - window_start
                    self._log_train(metrics, loss, grad_norm, window, window_steps,
                                    elapsed=time.perf_counter() - start, first_step=first_step)
                    window_start, window_steps = time.perf_counter(), 0
                eval_now = t.eval_interval and self.step % t.eval_interval == 0
                if eval_now or self.step == t.steps:
                    self._log_eval(metrics, start)
                    self.timer.discard()
                    window_start, window_steps = time.perf_counter(), 0
                if cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0:
                    self._save(start)
                    self.timer.discard()
                    window_start, window_steps = time.perf_counter(), 0
            if self.step != self.last_saved_step:
                self._save(start)
            self._publish_finished_save(wait=True)
            if self.hf_export is not None:
                self.hf_export.wait()
        except dist.DistBackendError as exc:
            raise self._collective_failure(exc) from None
        except RecoveryGaveUp as exc:
            self._halt(exc.exit_code, "gave up recovering from loss spikes", "recovery_gave_up", str(exc))
            raise
        except RuntimeError as exc:
            if not (self.proc.distributed and _is_collective_failure(exc)):
                raise
            raise self._collective_failure(exc) from None
        finally:
            self.watchdog.stop()
            self.display.stop()
            self._restore_signal_handlers(previous_handlers)
            if self.alerts is not None:
                self.alerts.flush()  # a pause or stop exits right after: deliver first
                self.alerts.close()
            if metrics is not None:
                metrics.close()

        stopped_by = self._stop_reason()
        if stopped_by in ("pause", "stop"):
            code = EXIT_PAUSED if stopped_by == "pause" else EXIT_STOPPED
            what = "paused" if stopped_by == "pause" else "stopped"
            msg = (f"{what} by an alert at step {self.step} with a checkpoint in "
                   f"{self.ckpt_root / 'latest'}")
            self._halt(code, msg, stopped_by, msg)
            self.display.print(
                f"tessel: {msg}; continue with `tessel train --resume {self.run_dir}` "
                f"(exit code {code})"
            )
        elif stopped_by:
            what = " (preemption warning)" if stopped_by == "SIGUSR1" else ""
            msg = (f"{stopped_by}{what}: stopped at step {self.step} with a checkpoint in "
                   f"{self.ckpt_root / 'latest'}")
            self.events.write("preempt" if stopped_by != "SIGINT" else "interrupt", self.step, msg)
            self.display.print(f"{msg}; continue with `tessel train --resume {self.run_dir}`")
        else:
            self.events.write("finish", self.step, f"finished at step {self.step}",
                              val_loss=self.last_val_loss)
            self._finish_message()
        return self._result(loss, stopped_by)

    # ---- resilience -------------------------------------------------------------------------

    def _start_event(self) -> None:
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if self.last_saved_step < 0:
            kind, msg = "start", "started"
        elif self.auto_resume or restarts:
            kind, msg = "restart", f"resumed automatically at step {self.step}"
        else:
            kind, msg = "resume", f"resumed at step {self.step}"
        if restarts:
            msg += f" (torchrun restart {restarts})"
        self.events.write(kind, self.step, msg, world_size=self.proc.world_size,
                          layout=self.dims.describe())

    def _halted(self) -> dict[str, Any] | None:
        path = self.run_dir / HALTED_FILE
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return {"message": "was halted"}

    def _halt(self, code: int, message: str, kind: str, detail: str) -> None:
        """Record that the run ended on purpose, so automatic restarts do not undo it."""
        self.events.write(kind, self.step, detail)
        if self.proc.is_main:
            write_text_atomic(self.run_dir / HALTED_FILE, json.dumps(
                {"message": message, "exit_code": code, "step": self.step, "time": time.time()}))

    def _stop_reason(self) -> str | None:
        if self._stop_signal:
            return signal.Signals(self._stop_signal).name
        if self._alert_action in ("pause", "stop"):
            return self._alert_action
        return None

    def _judge_step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> str | None:
        """Whether the step just taken spiked (one host sync, and on several ranks one
        all-reduce of the loss: every rank judges the same numbers the same way)."""
        assert self.spikes is not None
        self.watchdog.phase("collective: all-reduce of the step's loss (spike check)")
        value = self._global_loss(loss)
        self._last_loss = value
        return self.spikes.judge(value, float(grad_norm.item()))

    def _rollback(self, reason: str) -> None:
        """Back to the latest checkpoint (judged good when it was written), skipping the
        global batch that spiked; every rank does the same."""
        bad_step, bad_batch = self.step + 1, self.batches_drawn - 1
        rc = self.cfg.recovery
        self._publish_finished_save(wait=True)
        ckpt = latest_checkpoint(self.ckpt_root)
        if self.skips.rollbacks >= rc.max_rollbacks:
            raise RecoveryGaveUp(
                f"step {bad_step}: {reason}; recovery.max_rollbacks={rc.max_rollbacks} rollbacks "
                f"already done, giving up (last good checkpoint: {ckpt}); inspect the data "
                f"around global batch {bad_batch} or lower optim.lr, then `tessel train --resume "
                f"{self.run_dir}`"
            )
        if ckpt is None:
            raise RecoveryGaveUp(
                f"step {bad_step}: {reason}; no checkpoint to roll back to yet; lower "
                "checkpoint.interval so a good state is saved before spikes can occur"
            )
        self.watchdog.beat(self.step, "rollback")
        state = read_state(ckpt)
        self.skips.add(bad_batch, bad_step, reason, int(state["step"]))
        self._restore(ckpt, state)
        msg = (f"step {bad_step}: {reason}; rolled back to step {self.step} and skipping global "
               f"batch {bad_batch} (rollback {self.skips.rollbacks} of {rc.max_rollbacks})")
        self.events.write("rollback", bad_step, msg, from_step=bad_step, to_step=self.step,
                          skipped_batches=[bad_batch], reason=reason)
        self.display.print(f"tessel: {msg}")

    def _on_wait(self, seconds: float, step: int) -> None:
        """The watchdog's thread, while no progress is made: step_time.stall alerts."""
        if self.alerts is not None:
            self.alerts.handle(self.alerts.rules.stalled(seconds, step))

    def _on_watchdog(self, message: str, step: int) -> None:
        self.events.write("watchdog", step, message)

    def _open_metrics(self) -> MetricsWriter:
        m = self.cfg.metrics
        sinks: list[Any] = []
        if m.wandb:
            from tessel.observe.notify import scrub_secrets
            from tessel.observe.wandb_sink import WandbSink

            sinks.append(WandbSink(self.run_dir, m.wandb_project, self.run_dir.name, m.wandb_mode,
                                   scrub_secrets(self.cfg.to_dict())))
        if m.prometheus_port is not None:
            from tessel.observe.prometheus import PrometheusExporter

            prom = PrometheusExporter(m.prometheus_port, str(self.run_dir))
            sinks.append(prom)
            self.display.print(f"tessel: Prometheus metrics on http://0.0.0.0:{prom.port}/metrics")
        return MetricsWriter(self.run_dir, m.tensorboard, sinks)

    def _run_info(self) -> dict[str, Any]:
        """Where this run (or its latest resumption) ran: what calibrating the planner from
        the run directory needs besides config.toml and metrics.jsonl."""
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        return {"world_size": self.proc.world_size, "device": self.device.type,
                "device_name": name, "layout": self.dims.describe(), "torch": torch.__version__}

    def _collective_failure(self, exc: BaseException) -> CollectiveTimeout:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        return CollectiveTimeout(
            f"rank {self.proc.rank}: a collective failed or did not complete within "
            f"parallel.timeout_s={self.cfg.parallel.timeout_s}s (a peer process died or hangs: "
            f"{first}); resume from the last checkpoint with `tessel train --resume "
            f"{self.run_dir}`"
        )

    def close(self) -> None:
        """Release the process group (the trainer cannot train again afterwards)."""
        shutdown()

    def _should_stop(self) -> bool:
        """Whether a signal asked to stop; under torchrun all ranks agree, so they all stop
        (and checkpoint) at the same step even if the signal reached them at different
        times. The same all-reduce settles whether an asynchronous save has been written on
        every rank (`_save_written`): publishing it ends in a barrier, so the ranks must
        decide together, not each by its own thread's progress. A two-element all-reduce on
        the CPU group: no device synchronisation."""
        pending = self._pending_save
        written_here = pending is None or pending.done()
        action = ACTIONS.index(self._alert_action)  # alerts are judged on rank 0
        if not self.proc.distributed:
            self._save_written = written_here
            return self._stop_signal is not None or action > 0
        flags = torch.tensor([self._stop_signal or 0, 0 if written_here else 1, action],
                             dtype=torch.int64)
        self.watchdog.phase("collective: all-reduce of the stop flags (step boundary)")
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._cpu_group())
        signum, unwritten, action = int(flags[0]), int(flags[1]), int(flags[2])
        self._save_written = not unwritten
        if signum and self._stop_signal is None:
            self._stop_signal = signum
        self._alert_action = ACTIONS[action]
        return bool(signum) or action > 0

    def _cpu_group(self) -> dist.ProcessGroup | None:
        if self.device.type != "cuda":
            return None  # the default (gloo) group
        if not hasattr(self, "_gloo"):
            self._gloo = dist.new_group(backend="gloo")
        return self._gloo

    def _async_group(self) -> dist.ProcessGroup | None:
        """A gloo group used only by asynchronous checkpoint saves (created on every rank)."""
        if not (self.proc.distributed and self.cfg.checkpoint.async_save):
            return None
        if not hasattr(self, "_async_pg"):
            self._async_pg = dist.new_group(backend="gloo")
        return self._async_pg

    def _result(self, loss: torch.Tensor | None, stopped_by: str | None) -> TrainResult:
        return TrainResult(
            step=self.step,
            loss=self._global_loss(loss) if loss is not None else None,
            val_loss=self.last_val_loss,
            unigram_baseline=self.data.unigram_baseline,
            stopped_by=stopped_by,
            run_dir=self.run_dir,
        )

    def _log_train(
        self,
        metrics: MetricsWriter | None,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        window: float,
        window_steps: int,
        elapsed: float,
        first_step: int,
    ) -> None:
        """One metrics line for the steps since the last one (`window` seconds)."""
        t = self.cfg.train
        tokens_per_step = t.global_batch_size * t.seq_len
        tps = window_steps * tokens_per_step / window
        # With spike recovery on, the loss was reduced already (_judge_step); else the host
        # syncs happen here, at log steps only.
        loss_value = self._last_loss if self.spikes is not None else self._global_loss(loss)
        eta = elapsed / max(self.step - first_step, 1) * (t.steps - self.step)
        rec: dict[str, Any] = {
            "step": self.step,
            "loss": loss_value,
            "lr": self.optimizers[0].param_groups[0]["lr"],
            "grad_norm": grad_norm.item(),
            "tokens_per_s": tps,
            "tokens_per_s_per_device": tps / self.proc.world_size,
            "tokens_seen": self.tokens_seen,
            "elapsed_s": self.elapsed_prev + elapsed,
            "step_time_s": window / window_steps,
            "eta_s": eta,
            "token_budget_pct": 100 * self.tokens_seen / (t.steps * tokens_per_step),
            # null on devices without a known dense BF16 peak (CPUs included): never a guess
            "mfu": (flops_per_token(self.cfg.model, t.seq_len) * tps / self.peak_flops
                    if self.peak_flops is not None else None),
        }
        split = self.timer.window()
        rec.update({f"time_{k}_s": v / window_steps for k, v in split.items()})
        if self.precision.scaler is not None:
            rec["loss_scale"] = float(self.precision.scaler.get_scale())
        rec.update(memory_stats(self.device))
        if metrics is not None:
            metrics.write(rec)
        self.display.log(rec, t.steps, eta, rec["token_budget_pct"])
        if self.alerts is not None:
            self._act(self.alerts.observe(rec))

    def _act(self, action: str) -> None:
        """Remember the strongest action asked for; every rank acts on it at the next step
        boundary (_should_stop)."""
        if ACTIONS.index(action) > ACTIONS.index(self._alert_action):
            self._alert_action = action

    def _global_loss(self, loss: torch.Tensor) -> float:
        """The step's loss averaged over data-parallel replicas (a host sync)."""
        if not self.proc.distributed:
            return loss.item()
        self.watchdog.phase("collective: all-reduce of the loss")
        mine = loss.detach().float().reshape(1) if self.reports_loss else torch.zeros(1, device=self.device)
        return all_reduce_sum(mine.to(self.device)).item() / (self.dims.dp * self.dims.cp)

    def _pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = token_loss_sum(logits, targets) / self._loss_tokens
        return loss * self._loss_factor if self._loss_factor != 1.0 else loss

    def _train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over `accum` micro-batches; returns device tensors (no sync).
        The loss is this replica's (on the rank that reports it; zero elsewhere)."""
        cfg = self.cfg
        lr = lr_at(self.step, cfg.train.steps, cfg.optim)
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr
        self.timer.start("data")
        while self.batches_drawn in self.skips.batches:  # recovery skips these for good
            for _ in range(self.accum):
                self.data.train.next_batch()
            self.batches_drawn += 1
        batches = [self.data.train.next_batch() for _ in range(self.accum)]
        self._loss_factor = self.faults.loss_factor(self.batches_drawn)
        self.batches_drawn += 1
        self.watchdog.phase("forward/backward (DDP/FSDP/TP/PP collectives inside)")
        self.timer.start("compute")
        # The loss is a mean over every target token of the step, not a mean of
        # micro-batch means, so accumulation never changes its value.
        n_tokens = sum(b.targets.numel() for b in batches)
        scaler = self.precision.scaler
        total = torch.zeros((), device=self.device)
        if self.schedule is not None:
            total = self._pipeline_step(batches, n_tokens)
        else:
            model = self.model.parts[0]
            # Under context parallelism each rank holds 1/cp of every sequence's tokens and
            # gradients are averaged over the cp ranks too: scale so they sum instead.
            divisor = n_tokens / self.dims.cp
            for i, batch in enumerate(batches):
                x, y, docs = self._on_device(batch)
                last = i == len(batches) - 1
                with (self.model.dp.micro_batch(self.model.parts, last), loss_context(self.dims.tp > 1),
                      context_parallel_step(self.model.inner[0], self.cp_mesh, x, y)):
                    with self.precision.autocast():
                        logits = model(x, docs)  # (B, T, V)
                    loss = token_loss_sum(logits, y) / divisor
                    if self._loss_factor != 1.0:
                        loss = loss * self._loss_factor
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                total += local_value(loss.detach())
        self.watchdog.phase("optimizer (grad-norm all-reduce inside)")
        self.timer.start("optimizer")
        if scaler is not None:
            for opt in self.optimizers:
                scaler.unscale_(opt)
        clip = cfg.train.grad_clip if cfg.train.grad_clip > 0 else math.inf
        pp_group = self.mesh["pp"].get_group() if self.dims.pp > 1 and self.mesh is not None else None
        grad_norm = clip_grad_norm(self.model.parameters(), clip, pp_group)
        for opt in self.optimizers:
            if scaler is not None:
                scaler.step(opt)
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.update()
        self.timer.end()
        return total, grad_norm

    def _pipeline_step(self, batches: list[Batch], n_tokens: int) -> torch.Tensor:
        """All micro-batches of the step through the pipeline schedule (which interleaves
        their forward and backward passes); the loss lives on the last stage."""
        x, y, docs = self._on_device(_concat(batches))
        self._loss_tokens = n_tokens
        losses: list[torch.Tensor] = []
        args = (x,) if self.model.has_first else ()
        kwargs = {"doc_ids": docs} if docs is not None else {}
        target = y if self.model.has_last else None
        assert self.schedule is not None
        with loss_context(self.dims.tp > 1), self.precision.autocast():
            self.schedule.step(*args, target=target, losses=losses, **kwargs)
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack([local_value(v.detach()).float() for v in losses]).sum()

    def _on_device(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        if self.device.type != "cuda":
            return tuple(batch)
        # Pinned memory lets the copy overlap with compute (non_blocking).
        return tuple(
            t.pin_memory().to(self.device, non_blocking=True) if t is not None else None
            for t in batch
        )

    @torch.no_grad()
    def evaluate(self) -> float:
        """Token-mean cross-entropy over `train.eval_iters` validation micro-batches of every
        data-parallel rank."""
        val = self.data.val
        assert val is not None
        val.reset()
        # eval_iters micro-batches in total over the data-parallel ranks (never past the end
        # of the split), so every layout evaluates the same sequences.
        available = max(1, val.n_samples // val.mbs)
        iters = math.ceil(min(self.cfg.train.eval_iters, available) / self.dims.dp)
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        count = 0
        self.model.train(False)
        if self.schedule is not None:
            # The schedule runs whole steps of `accum` micro-batches.
            for i in range(math.ceil(iters / self.accum)):
                self.watchdog.beat(self.step, f"evaluation step {i}")
                batches = [val.next_batch() for _ in range(self.accum)]
                x, y, docs = self._on_device(_concat(batches))
                self._loss_tokens = 1  # sums
                losses: list[torch.Tensor] = []
                with loss_context(self.dims.tp > 1), self.precision.autocast():
                    self.schedule.eval(*((x,) if self.model.has_first else ()),
                                       target=y if self.model.has_last else None,
                                       losses=losses, **({"doc_ids": docs} if docs is not None else {}))
                for v in losses:
                    total += local_value(v).double()
                count += y.numel()
        else:
            model = self.model.parts[0]
            for i in range(iters):
                self.watchdog.beat(self.step, f"evaluation batch {i}")
                x, y, docs = self._on_device(val.next_batch())
                with (loss_context(self.dims.tp > 1), self.precision.autocast(),
                      context_parallel_step(self.model.inner[0], self.cp_mesh, x, y)):
                    logits = model(x, docs)
                    total += local_value(token_loss_sum(logits, y)).double()
                    count += y.numel()  # this rank's share under context parallelism
        self.model.train(True)
        if not self.proc.distributed:
            return total.item() / count
        # Each replica's loss-reporting rank contributes its sum; all replicas count equally.
        sums = torch.stack([total if self.reports_loss else torch.zeros_like(total),
                            torch.tensor(float(count) if self.reports_loss else 0.0,
                                         dtype=torch.float64, device=self.device)])
        sums = all_reduce_sum(sums)
        return (sums[0] / sums[1]).item()

    def _log_eval(self, metrics: MetricsWriter | None, start: float) -> None:
        if self.data.val is None:
            return
        val_loss = self.evaluate()
        self.last_val_loss = val_loss
        rec = {
            "step": self.step,
            "val_loss": val_loss,
            "val_ppl": math.exp(min(val_loss, 50.0)),
            "tokens_seen": self.tokens_seen,
            "elapsed_s": self.elapsed_prev + time.perf_counter() - start,
        }
        if metrics is not None:
            metrics.write(rec)
        self.display.log(rec, self.cfg.train.steps, 0.0, 0.0)
        if self.alerts is not None:
            self._act(self.alerts.observe(rec))

    # ---- checkpoints and signals ---------------------------------------------------------

    def _rng_state(self) -> dict[str, torch.Tensor]:
        rng = {"torch_cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["torch_cuda"] = torch.cuda.get_rng_state(self.device)
        return rng

    def _save(self, start: float) -> None:
        self.watchdog.beat(self.step, "checkpoint save")
        self._publish_finished_save(wait=True)  # one save in flight at a time
        if self.hf_export is not None:
            self.hf_export.wait()  # pruning must not remove a checkpoint being exported
        state: dict[str, Any] = {
            "tokens_seen": self.tokens_seen,
            "elapsed_s": self.elapsed_prev + time.perf_counter() - start,
            "loader": self.data.train.state_dict(),
            "val_loss": self.last_val_loss,
            "config": self.cfg.to_dict(),
            "layout": self.dims.describe(),
            "batches_drawn": self.batches_drawn,
        }
        if self.spikes is not None:
            state["recovery"] = self.spikes.state_dict()
        if self.alerts is not None:
            state["alerts"] = self.alerts.rules.state_dict()
        if self.precision.scaler is not None:
            state["scaler"] = self.precision.scaler.state_dict()
        result = save_checkpoint(
            self.ckpt_root, self.step, self.model.inner, self.optimizers, state, self._rng_state(),
            keep_last=self.cfg.checkpoint.keep_last, async_save=self.cfg.checkpoint.async_save,
            async_group=self._async_group(),
        )
        if isinstance(result, PendingSave):
            self._pending_save = result
            self._save_written = False  # until all ranks say otherwise (_should_stop)
        elif self.hf_export is not None:
            self.hf_export.after_publish(result, self.step)
        self.last_saved_step = self.step

    def _publish_finished_save(self, wait: bool = False) -> None:
        """Publish an asynchronous save once every rank has written it (or wait for it)."""
        pending = self._pending_save
        if pending is not None and (wait or self._save_written):
            path = pending.finish()
            self._pending_save = None
            if self.hf_export is not None:
                self.hf_export.after_publish(path, int(path.name.removeprefix("step_")))
            if self.proc.distributed:
                self.watchdog.phase("collective: barrier after publishing a checkpoint")
                dist.barrier(group=self._cpu_group())

    def _install_signal_handlers(self) -> dict[int, Any]:
        def on_signal(signum: int, _frame: Any) -> None:
            self._stop_signal = signum
            # A second Ctrl-C interrupts at once; checkpoints stay safe (saves are atomic).
            signal.signal(signal.SIGINT, signal.default_int_handler)

        previous = {}
        for sig in (getattr(signal, name) for name in _STOP_SIGNALS if hasattr(signal, name)):
            try:
                previous[sig] = signal.signal(sig, on_signal)
            except ValueError:  # not the main thread (e.g. some notebook runners)
                pass
        return previous

    @staticmethod
    def _restore_signal_handlers(previous: dict[int, Any]) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    # ---- messages -------------------------------------------------------------------------

    def _announce(self) -> None:
        cfg, t = self.cfg, self.cfg.train
        planned = t.steps * t.global_batch_size * t.seq_len
        verb = f"resuming at step {self.step}" if self.step else "training"
        self.display.print(
            f"tessel: {verb} {param_count(cfg.model):,}-parameter model "
            f"({cfg.model.preset or 'custom'}) on {self.proc.world_size} x {self.device.type} "
            f"({self.precision.name}; {self.dims.describe()}), "
            f"{t.steps} steps x {t.global_batch_size} x {t.seq_len} tokens = {planned:,} tokens "
            f"(accumulation {self.accum}); run dir {self.run_dir}"
        )

    def _finish_message(self) -> None:
        msg = f"done: step {self.step}"
        if self.last_val_loss is not None:
            msg += (
                f", val loss {self.last_val_loss:.4f} "
                f"(unigram baseline {self.data.unigram_baseline:.4f})"
            )
        self.display.print(msg + f"; checkpoint in {self.ckpt_root / 'latest'}")
        n = self.cfg.run.sample_tokens
        if n and self.proc.distributed:
            self.display.print(
                f"(no sample under a parallel layout; `tessel generate {self.run_dir}` samples "
                "from the checkpoint)"
            )
        elif n:
            prompt = self.cfg.run.sample_prompt
            ids = sample(self.model.inner[0], self.tokenizer.encode(prompt), n, seed=self.cfg.train.seed,
                         stop_id=self.tokenizer.eod_id)
            self.display.print("sample:\n" + prompt + self.tokenizer.decode(ids))


def _is_collective_failure(exc: RuntimeError) -> bool:
    """A collective that timed out or lost its peer (a process died: gloo sees the
    connection reset), as opposed to a bug."""
    text = str(exc).lower()
    return any(k in text for k in ("timed out", "timeout", "connection reset", "connection closed",
                                   "broken pipe", "gloo/transport", "nccl"))


def memory_stats(device: torch.device) -> dict[str, float]:
    """Device memory in GiB: allocated now, reserved by the caching allocator, peak
    allocated since the start; on a CPU the process's resident memory and its peak."""
    if device.type == "cuda":
        return {
            "mem_allocated_gib": torch.cuda.memory_allocated(device) / 2**30,
            "mem_reserved_gib": torch.cuda.memory_reserved(device) / 2**30,
            "mem_peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        }
    import resource

    out = {"mem_rss_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30}
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        out["mem_rss_gib"] = pages * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError, IndexError):  # not Linux
        pass
    return out


def _get(cfg: Config, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node.model_dump() if hasattr(node, "model_dump") else node


def _first_difference(key: str, old: Any, new: Any) -> str:
    if isinstance(old, dict) and isinstance(new, dict):
        for k in old:
            if old[k] != new.get(k):
                return f"{key}.{k} was {old[k]!r} in the run, now {new.get(k)!r}"
    return f"{key} was {old!r} in the run, now {new!r}"


def _concat(batches: list[Batch]) -> Batch:
    """Micro-batches stacked into one batch (the pipeline schedule splits it again)."""
    docs = [b.doc_ids for b in batches]
    return Batch(
        torch.cat([b.inputs for b in batches]),
        torch.cat([b.targets for b in batches]),
        torch.cat(docs) if docs[0] is not None else None,  # type: ignore[arg-type]
    )
