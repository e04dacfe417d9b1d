"""The training loop, for one process or one rank of any parallel layout.

`Trainer(cfg).train()` runs a whole job. The Trainer only orchestrates; each job is a part
with its own module and tests: `TrainStep` (forward/backward/optimizer, step.py),
`Evaluator` (eval.py), `CheckpointManager` (checkpoint/manager.py), `StopControl` (signals,
alert actions, control.py), `Recovery` (spikes and rollbacks, recovery.py), `StepLogger`
(metrics sinks, step_log.py) and `RunDir` (file names, run_dir.py). Under torchrun every rank
runs it; rank 0 alone prints and writes metrics.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tessel.checkpoint import CheckpointError, read_state
from tessel.checkpoint.manager import CheckpointManager
from tessel.config import Config
from tessel.data import build_data
from tessel.data.chat_files import run_tokenizer_config
from tessel.errors import TesselError
from tessel.launch.elastic import replan_if_elastic
from tessel.observe.alerts import check_alerts
from tessel.observe.comm import CommMeter
from tessel.observe.console import ConsoleDisplay
from tessel.observe.events import EventLog
from tessel.observe.secrets import redact_config
from tessel.observe.timing import PhaseTimer
from tessel.observe.watchdog import Watchdog
from tessel.optim.build import build_optimizer, check_muon_force
from tessel.optim.lr_schedule import lr_at
from tessel.parallel.apply import build_parallel_model
from tessel.parallel.check import check_layout
from tessel.parallel.dims import ParallelDims, flat_mesh, resolved
from tessel.parallel.dist import init_distributed, process_info, shutdown
from tessel.parallel.fp8 import check_fp8
from tessel.parallel.replica_group import data_share, replica_groups
from tessel.planner.prelaunch import auto_layout, device_peak_flops, refuse_if_too_big
from tessel.train import lifecycle
from tessel.train.control import StopControl, stop_at_once
from tessel.train.device import pick_device
from tessel.train.eval import Evaluator
from tessel.train.faults import Faults
from tessel.train.harness import Harness
from tessel.train.harness_check import check_lm_eval
from tessel.train.precision import resolve_precision
from tessel.train.recovery import Recovery, RecoveryGaveUp, SkipList, TrainingDiverged, check_finite
from tessel.train.replicas import replicas_for
from tessel.train.result import TrainResult
from tessel.train.resume import check_tokenizer, resume_point
from tessel.train.run_dir import RunDir
from tessel.train.state import load_run_state, run_state
from tessel.train.step import TrainStep
from tessel.train.step_log import StepLogger, open_metrics


class Trainer:
    def __init__(self, cfg: Config, resume: bool = False, console: bool = True,
                 force: bool = False, auto_resume: bool = False):
        self.run = RunDir(cfg.run.dir)
        self.run_dir = self.run.path
        self.auto_resume = auto_resume
        self.resuming = resume
        self.proc = proc = process_info()
        self.display = ConsoleDisplay(cfg.train.steps, enabled=console and proc.is_main)
        say = self.display.print

        # Everything that can reject the input happens before anything is written.
        self.device = pick_device(cfg.train.device)
        cfg = auto_layout(cfg, self.device, proc.world_size, say)
        self.zero_as_given = cfg.parallel.zero  # saved: auto takes a resume's layout's stage
        cfg, note = resolved(cfg)  # parallel.zero = auto -> the stage the layout takes
        if note:
            say(note)
        self.precision = resolve_precision(cfg.train.precision, self.device)
        self.dims = dims = ParallelDims.from_config(cfg.parallel, proc.world_size)
        self.mbs_as_given = cfg.train.micro_batch_size  # saved: each restart re-plans from it
        cfg = replan_if_elastic(cfg, dims, say)
        check_layout(cfg, dims, self.device, self.precision.name)
        refuse_if_too_big(cfg, self.device, proc.world_size, force, say)
        check_fp8(cfg, self.device)
        check_alerts(cfg.alerts, cfg.notify)
        self.faults = Faults(proc.rank, world_size=proc.world_size, steps=cfg.train.steps)
        if not resume:  # a resumed run keeps its patterns (optim.muon_force is frozen)
            check_muon_force(cfg)
        self.lm_eval_tasks = check_lm_eval(cfg)  # unknown task names: refused now, not in an hour
        self.cfg = cfg
        if proc.is_main and resume and self.run.path.is_dir():
            self.run.lock()  # before reading its checkpoints: nobody else writes them now
        try:
            self._build(resume_point(self.run, cfg, resume, auto_resume, say), say)
        except BaseException:
            self.run.unlock()
            raise

    def _build(self, resume_from: tuple[Path, dict[str, Any]] | None, say: Any) -> None:
        """Everything the run needs, from the checked config: data, model, the parts."""
        proc, dims = self.proc, self.dims
        # A LoRA run's checkpoints hold only its adapters: the frozen base is read from
        # model.init_from on every start, resumes included, and must be the one it was.
        lora = self.cfg.lora.enabled
        self.init_source = self._init_source() if resume_from is None or lora else None
        cfg = self.cfg
        self.lora_base = None
        if lora:
            from tessel.checkpoint.lora import base_fingerprint, check_base

            self.lora_base = base_fingerprint(cfg)
            if resume_from is not None:
                check_base(resume_from[1], self.lora_base, resume_from[0], cfg.model.init_from)

        mesh = None
        if proc.distributed:
            self.device = init_distributed(proc, self.device, cfg.parallel.timeout_s)
            mesh = dims.build_mesh(self.device.type)
        self.data = self._build_data(*data_share(cfg, flat_mesh(mesh, "dp").get_local_rank()
                                                 if mesh is not None else 0, dims.dp))
        self.tokenizer = self.data.tokenizer
        if resume_from is not None:
            check_tokenizer(self.run, self.tokenizer)

        torch.manual_seed(cfg.train.seed)
        param_dtype = torch.bfloat16 if self.precision.name == "bf16" else None
        source = self.init_source
        self.model = build_parallel_model(cfg, dims, mesh, self.device, param_dtype,
                                          source.get if source is not None else None,
                                          source.buffer if source is not None else None)
        self.optimizers = [build_optimizer(m, cfg.optim, self.device,
                                           cfg.parallel.offload == "optimizer")
                           for m in self.model.inner]
        self.timer = PhaseTimer(self.device)
        self.alerts = None
        self.events = EventLog(self.run.events, enabled=proc.is_main)
        if proc.is_main and cfg.alerts:
            from tessel.observe.alerts import AlertCenter

            self.alerts = AlertCenter(cfg.alerts, cfg.notify, str(self.run_dir), self.events, say)
        stall_rules = self.alerts is not None and any(a.when == "step_time.stall" for a in cfg.alerts)
        self.watchdog = Watchdog(cfg.watchdog.timeout_s, self.run.watchdog, proc.rank,
                                 proc.world_size, on_wait=self._on_wait if stall_rules else None,
                                 on_fire=lambda msg, step: self.events.write("watchdog", step, msg))
        self.train_step = TrainStep(
            self.model, self.optimizers, dims, mesh, self.device, self.precision,
            accum=cfg.train.global_batch_size // (cfg.train.micro_batch_size * dims.dp
                                                  * replica_groups(cfg)),
            grad_clip=cfg.train.grad_clip, parallel_cfg=cfg.parallel,
            distributed=proc.distributed, timer=self.timer, phase=self.watchdog.phase,
            masked=cfg.data.source == "sft")
        self.evaluator = (Evaluator(self.train_step, self.data.val, cfg.train.eval_iters,
                                    beat=lambda what: self.watchdog.beat(self.step, what))
                          if self.data.val is not None else None)
        self.harness = (Harness(cfg, self.lm_eval_tasks, self.train_step, self.tokenizer,
                                beat=lambda what: self.watchdog.beat(self.step, what))
                        if cfg.lm_eval.enabled else None)
        self.scoring_failure: str | None = None  # set once scoring fails: no more of it
        self.recovery = Recovery(cfg.recovery, SkipList(
            self.run.skipped_batches, cfg.recovery.skip_batches, writer=proc.is_main))
        self.control = StopControl(proc.distributed, self.device.type, self.watchdog.phase)
        self.comm = CommMeter(self.device, cfg.metrics.comm_sample_interval, proc.distributed,
                              self.control.cpu_group, say,  # exposed communication, sampled steps
                              after=cfg.metrics.comm_sample_after)
        hf_export = None
        if proc.is_main and cfg.checkpoint.hf_export_interval:
            from tessel.checkpoint.hf_export import HFExporter

            hf_export = HFExporter(cfg.checkpoint.hf_export_interval, self.run.hf_export_log, say,
                                   peft=cfg.lora.enabled and cfg.lora.export == "peft",
                                   drop_expert_bias=cfg.checkpoint.hf_export_drop_expert_bias)
        self.checkpoints = CheckpointManager(
            self.run.checkpoints, self.model.inner, self.optimizers,
            keep_last=cfg.checkpoint.keep_last, async_save=cfg.checkpoint.async_save,
            distributed=proc.distributed, hf_export=hf_export, phase=self.watchdog.phase,
            barrier_group=self.control.cpu_group)
        self.step = self.batches_drawn = self.tokens_seen = 0  # batches_drawn counts skipped ones
        self.world_before: int | None = None  # the resumed checkpoint's world size
        self.elapsed_prev = 0.0  # training time before this start's (tessel.train.state)
        self.clock_start: float | None = None  # when this start's training began
        self.last_val_loss: float | None = None
        self._last_loss: float | None = None  # all-reduced by the spike check
        if resume_from is not None:
            self._restore(*resume_from)
        self.replicas = self.train_step.replicas = replicas_for(self)  # [fault_tolerance]

    def _init_source(self):  # noqa: ANN202
        """The weights of model.init_from for a new run, and their tokenizer when the data's
        is left to `auto` (a fine-tune must read text with the tokenizer the weights know)."""
        if not self.cfg.model.init_from:
            return None
        from tessel.checkpoint.init_from import WeightSource, check_shape

        check_shape(self.cfg.model, Path(self.cfg.model.init_from))  # Config.load's defaults
        source = WeightSource(Path(self.cfg.model.init_from), self.cfg.model)
        self.display.print(f"tessel: initialising from {source.kind} {source.path}")
        if self.cfg.data.tokenizer == "auto" and source.tokenizer.is_file():
            tokenizer = {"data.tokenizer": str(source.tokenizer)}
            self.cfg = self.cfg.with_overrides(tokenizer)  # saved too: a resume reads the same
            self.display.print(f"tessel: tokenizer from {source.tokenizer}")
        return source

    def _build_data(self, dp_rank: int, dp: int):  # noqa: ANN202
        """This process's share (`dp_rank` of `dp`) of every global batch. Rank 0 builds any
        corpus cache first; the others then read it. SIGTERM stops it at once."""
        build = lambda: build_data(self.cfg, dp_rank, dp, console=self.display.print)
        with stop_at_once("preparing the data"):
            if not self.proc.distributed:
                return build()
            data = build() if self.proc.is_main else None
            dist.barrier()
            return data if data is not None else build()

    def _restore(self, ckpt: Path, state: dict[str, Any]) -> None:
        """The run as checkpoint `ckpt` (with `state`, its state.json) saved it: the weights
        and optimizer state, then the parts of tessel.train.state, which a recovering replica
        group receives from its peer too."""
        self.checkpoints.restore(ckpt, self.device)
        try:
            load_run_state(self, state)
        except KeyError as exc:
            raise CheckpointError(f"checkpoint {str(ckpt)!r} lacks {exc}; it is damaged") from None
        self.checkpoints.last_saved_step = self.step
        self.world_before = state.get("world_size")

    # ---- the loop -------------------------------------------------------------------------

    def train(self) -> TrainResult:
        """Train to `train.steps` (or until a signal, an alert or a failure stops it)."""
        try:
            return self._train()
        finally:
            self.run.unlock()  # the run is written; another process may take it now

    def _train(self) -> TrainResult:
        cfg, t = self.cfg, self.cfg.train
        if self.step >= t.steps:
            self.display.print(
                f"{self.run_dir} is already at step {self.step} of train.steps={t.steps}; "
                f"pass --train.steps=N with N > {self.step} to train further"
            )
            return self._result(None, None)
        if self.replicas is not None:
            self.replicas.join()  # [fault_tolerance]: refuses a taken replica_id, unwritten
        # Written only now that the run really starts: a refused or no-op call leaves the
        # run directory as it was.
        if self.proc.is_main:
            self.run.lock()
            if not self.resuming and self.run.holds_run():
                # another new run took this directory since the start-up check
                raise TesselError(f"{str(self.run_dir)!r} already holds a run; choose another "
                                  "--run.dir")
            saved = cfg.model_copy(update={
                "parallel": cfg.parallel.model_copy(update={"zero": self.zero_as_given}),
                "train": cfg.train.model_copy(update={"micro_batch_size": self.mbs_as_given})})
            template = self.data.chat_template
            self.run.write_start(saved.to_toml(), lifecycle.run_info(self), self.tokenizer.save,
                                 run_tokenizer_config(template) if template is not None else None)
        lifecycle.announce(self)
        lifecycle.start_event(self)
        log = StepLogger(cfg, self.display, open_metrics(cfg, self.run, self.display.print)
                         if self.proc.is_main else None, self.device, self.proc.world_size,
                         device_peak_flops(self.device),
                         (lambda rec: self.control.request(self.alerts.observe(rec)))
                         if self.alerts is not None else None)
        self.control.install()
        loss = grad_norm = None
        start = self.clock_start = time.perf_counter()
        first_step = self.step
        window_start, window_steps = time.perf_counter(), 0
        self.display.start(self.step)
        self.model.train()  # evaluation puts it back after each evaluation
        self.watchdog.start()
        try:
            while self.step < t.steps:
                self.watchdog.beat(self.step, "step boundary")
                self.faults.at_step(self.step)
                if self.control.should_stop(self.checkpoints.written_here()):
                    break
                loss, grad_norm = self.run_step()
                if not self.train_step.committed:  # a replica group failed: retried
                    continue
                if self.recovery.enabled:
                    self.watchdog.phase("collective: all-reduce of the step's loss (spike check)")
                    self._last_loss = self.train_step.global_loss(loss)
                    bad = self.recovery.judge(self._last_loss, float(grad_norm.item()))
                    if bad is not None:
                        self._rollback(bad)
                        first_step = min(first_step, self.step)
                        self.timer.discard()
                        window_start, window_steps = time.perf_counter(), 0
                        continue
                self.checkpoints.publish_finished(all_written=self.control.save_written)
                self.step += 1
                self.tokens_seen += t.global_batch_size * t.seq_len
                window_steps += 1
                self.display.step(self.step)
                if self.alerts is not None:
                    self.alerts.rules.progressed()
                if self.step % cfg.metrics.log_interval == 0 or self.step == t.steps:
                    self._log_train(log, loss, grad_norm, time.perf_counter() - window_start,
                                    window_steps, time.perf_counter() - start, first_step)
                    window_start, window_steps = time.perf_counter(), 0
                eval_now = t.eval_interval and self.step % t.eval_interval == 0
                save_now = cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0
                if eval_now or self.step == t.steps:
                    self._evaluate(log, start)
                if save_now:
                    self._save(loss, grad_norm)
                scores_now = (self.harness is not None and self.scoring_failure is None
                              and self.harness.due(self.step, self.step == t.steps))
                if scores_now:
                    self._score(log, start)
                if eval_now or save_now or scores_now or self.step == t.steps:
                    self.timer.discard()
                    window_start, window_steps = time.perf_counter(), 0
            if self.step != self.checkpoints.last_saved_step:
                self._save(loss, grad_norm)
            self.checkpoints.finish()
        except dist.DistBackendError as exc:
            raise lifecycle.collective_failure(self, exc) from None
        except (RecoveryGaveUp, TrainingDiverged) as exc:
            what, kind = (("gave up recovering from loss spikes", "recovery_gave_up")
                          if isinstance(exc, RecoveryGaveUp) else ("diverged", "diverged"))
            lifecycle.halt(self, exc.exit_code, what, kind, str(exc))
            raise
        except RuntimeError as exc:
            if not (self.proc.distributed and lifecycle.is_collective_failure(exc)):
                raise
            raise lifecycle.collective_failure(self, exc) from None
        finally:
            self.watchdog.stop()
            if self.replicas is not None:
                self.replicas.close()
            self.faults.close()
            self.display.stop()
            self.control.restore()
            if self.alerts is not None:
                self.alerts.flush()  # a pause or stop exits right after: deliver first
                self.alerts.close()
            log.close()
        # A signal or an alert's action that came after the last step (during the final
        # evaluation or save) stopped nothing: the run is done, and says so (a `finish`
        # event, exit 0), or a SLURM job would requeue itself for a run with no step left.
        stopped_by = self.control.reason() if self.step < t.steps else None
        lifecycle.ended(self, stopped_by)
        return self._result(loss, stopped_by)

    def run_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step of the run: its learning rate, its global batch (skipping the
        batches recovery skips for good), then the TrainStep. Returns device tensors (loss,
        grad norm); no host sync."""
        if self.replicas is not None:  # the quorum; a group behind takes a peer's state
            self.replicas.begin_step()
        # one step in metrics.comm_sample_interval is profiled (by step number: the same on
        # every rank, and after a resume)
        with self.comm.sampled(self.step + 1):
            self.train_step.set_lr(lr_at(self.step, self.cfg.train.steps, self.cfg.optim))
            self.timer.start("data")
            accum, loader = self.train_step.accum, self.data.train
            while self.batches_drawn in self.recovery.skips.batches:
                for _ in range(accum):
                    loader.next_batch()
                self.batches_drawn += 1
            batches = [loader.next_batch() for _ in range(accum)]
            self.train_step.loss_factor = self.faults.loss_factor(self.batches_drawn)
            self.batches_drawn += 1
            return self.train_step(batches)

    def _log_train(self, log: StepLogger, loss: torch.Tensor, grad_norm: torch.Tensor,
                   window: float, window_steps: int, elapsed: float, first_step: int) -> None:
        t = self.cfg.train
        scaler = self.precision.scaler
        log.train(
            step=self.step,
            # With spike recovery on the loss was all-reduced already; else it is here, at
            # log steps only.
            loss=self._last_loss if self.recovery.enabled else self.train_step.global_loss(loss),
            lr=self.train_step.first_lr(), grad_norm=grad_norm.item(), window_s=window,
            window_steps=window_steps, tokens_seen=self.tokens_seen,
            elapsed_s=self.elapsed_prev + elapsed,
            eta_s=elapsed / max(self.step - first_step, 1) * (t.steps - self.step),
            time_split=self.timer.window(),
            loss_scale=float(scaler.get_scale()) if scaler is not None else None,
            extra={**self.train_step.moe.metrics(self.cfg.model.moe_capacity_factor is not None),
                   **self.data.figures, **self.comm.window(window / window_steps),
                   **(self.replicas.figures() if self.replicas is not None else {})})

    def _evaluate(self, log: StepLogger, start: float) -> None:
        if self.evaluator is None:
            return
        self.last_val_loss = self.evaluator.loss()
        log.eval(step=self.step, val_loss=self.last_val_loss, tokens_seen=self.tokens_seen,
                 elapsed_s=self.elapsed_prev + time.perf_counter() - start)

    def _score(self, log: StepLogger, start: float) -> None:
        """Benchmark scores through lm_eval (every rank runs them; rank 0 writes). A failure
        costs the scores, never the training or its checkpoints (lifecycle.scoring_failed)."""
        assert self.harness is not None
        self.watchdog.phase("lm_eval benchmark scores (every rank calls the model together)")
        try:
            scores = self.harness.scores()
        except Exception as exc:  # noqa: BLE001 (whatever a task makes lm_eval raise)
            if not lifecycle.scoring_failed(self, exc):
                raise
            return
        log.scores(step=self.step, scores=scores, tokens_seen=self.tokens_seen,
                   elapsed_s=self.elapsed_prev + time.perf_counter() - start)

    def evaluate(self) -> float:
        """Held-out loss of the model as it is now (see Evaluator)."""
        assert self.evaluator is not None, "this run has no validation split"
        return self.evaluator.loss()

    # ---- checkpoints and recovery ---------------------------------------------------------

    def _save(self, loss: torch.Tensor | None, grad_norm: torch.Tensor | None) -> None:
        """Checkpoint the run, once the last step is known to be finite (one host sync):
        non-finite weights are never saved, so a rollback or resume always finds good ones."""
        if loss is not None and grad_norm is not None and not self.recovery.enabled:
            # (with recovery on, every step was judged already)
            check_finite(self.step, self.train_step.global_loss(loss), float(grad_norm.item()),
                         self.checkpoints.last_saved_step, self.run_dir)
        self.watchdog.beat(self.step, "checkpoint save")
        state: dict[str, Any] = {
            **run_state(self),  # what a resume restores (tessel.train.state)
            "config": redact_config(self.cfg.to_dict()),  # no secret in a checkpoint
            "layout": self.dims.describe(),
            "world_size": self.proc.world_size,  # an elastic resume says when it changed
        }
        if self.lora_base is not None:
            state["lora_base"] = self.lora_base  # tessel.checkpoint.lora.FINGERPRINT_KEY
        self.checkpoints.save(self.step, state, self.device)
        if self.checkpoints.pending is not None:
            self.control.save_written = False  # until all ranks say otherwise

    def _rollback(self, reason: str) -> None:
        """Back to the latest checkpoint (judged good when it was written), skipping the
        global batch that spiked; every rank does the same."""
        bad_step, bad_batch = self.step + 1, self.batches_drawn - 1
        self.checkpoints.publish_finished(wait=True)
        ckpt = self.recovery.check_rollback(reason, bad_step, bad_batch,
                                            self.checkpoints.latest(), self.run_dir)
        self.watchdog.beat(self.step, "rollback")
        state = read_state(ckpt)
        self.recovery.skips.add(bad_batch, bad_step, reason, int(state["step"]))
        self._restore(ckpt, state)
        rc = self.cfg.recovery
        msg = (f"step {bad_step}: {reason}; rolled back to step {self.step} and skipping global "
               f"batch {bad_batch} (rollback {self.recovery.skips.rollbacks} of {rc.max_rollbacks})")
        self.events.write("rollback", bad_step, msg, from_step=bad_step, to_step=self.step,
                          skipped_batches=[bad_batch], reason=reason)
        self.display.print(f"tessel: {msg}")

    def _on_wait(self, seconds: float, step: int) -> None:
        """The watchdog's thread, while no progress is made: step_time.stall alerts."""
        if self.alerts is not None:
            self.alerts.handle(self.alerts.rules.stalled(seconds, step))

    def _result(self, loss: torch.Tensor | None, stopped_by: str | None) -> TrainResult:
        return TrainResult(
            step=self.step,
            loss=self.train_step.global_loss(loss) if loss is not None else None,
            val_loss=self.last_val_loss,
            unigram_baseline=self.data.unigram_baseline,
            stopped_by=stopped_by,
            run_dir=self.run_dir,
            scoring_failure=self.scoring_failure,
        )

    def close(self) -> None:
        """Release the process group and the run directory's lock (the trainer cannot
        train again afterwards)."""
        self.run.unlock()
        shutdown()

