"""The training loop, for one process or one rank of any parallel layout.

`Trainer(cfg).train()` runs a whole job. The Trainer only orchestrates; each job is a part
with its own module and tests, built by tessel.train.build: `TrainStep` (forward/backward/
optimizer, step.py), `Evaluator` (eval.py), `CheckpointManager` (checkpoint/manager.py),
`StopControl` (signals, alert actions, control.py), `Recovery` (spikes and rollbacks,
recovery.py), `StepLogger` (metrics sinks, step_log.py), `Lifecycle` (what a run says and
records as it starts and ends, lifecycle.py), `RunState` (the one registry of stateful parts,
state.py) and `RunDir` (file names, run_dir.py). Parts on a cadence (evaluation,
checkpoints, lm_eval scores, the final sample) say when they are due. Under torchrun every
rank runs it; rank 0 alone prints and writes metrics.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tessel.checkpoint import CheckpointError, read_state
from tessel.config import Config
from tessel.observe.console import ConsoleDisplay
from tessel.observe.secrets import redact_config
from tessel.optim.lr_schedule import lr_at
from tessel.parallel.dist import process_info, shutdown
from tessel.planner.prelaunch import device_peak_flops
from tessel.train.build import build_run, check_run
from tessel.train.lifecycle import is_collective_failure
from tessel.train.recovery import RecoveryGaveUp, TrainingDiverged, check_finite
from tessel.train.replicas import TrainerReplicas
from tessel.train.result import TrainResult
from tessel.train.resume import resume_point
from tessel.train.run_dir import RunDir
from tessel.train.state import Counters, counter
from tessel.train.step_log import StepLogger, open_metrics


class Trainer:
    # how far the run is (tessel.train.state.Counters), as the trainer's own attributes
    step, tokens_seen, batches_drawn = map(counter, ("step", "tokens_seen", "batches_drawn"))
    last_val_loss, elapsed_prev = map(counter, ("val_loss", "elapsed_prev"))

    def __init__(self, cfg: Config, resume: bool = False, console: bool = True,
                 force: bool = False, auto_resume: bool = False):
        self.run = RunDir(cfg.run.dir)
        self.run_dir = self.run.path
        self.auto_resume, self.resuming = auto_resume, resume
        self.proc = proc = process_info()
        self.display = ConsoleDisplay(cfg.train.steps, enabled=console and proc.is_main)
        # Everything that can reject the input happens before anything is written.
        self.checked = c = check_run(cfg, proc, resume, force, self.display.print)
        self.cfg, self.device, self.precision, self.dims = c.cfg, c.device, c.precision, c.dims
        self.faults = c.faults
        if proc.is_main and resume and self.run.path.is_dir():
            self.run.lock()  # before reading its checkpoints: nobody else writes them now
        try:
            self._build(resume_point(self.run, self.cfg, resume, auto_resume,
                                     self.display.print))
        except BaseException:
            self.run.unlock()
            raise

    def _build(self, resume_from: tuple[Path, dict[str, Any]] | None) -> None:
        """Everything the run needs, from the checked config: data, model, the parts."""
        self.counters = Counters()
        p = build_run(self.checked, self.proc, self.run, self.display, self.counters,
                      resume_from)
        self.cfg, self.device, self.lora_base, self.data = p.cfg, p.device, p.lora_base, p.data
        self.tokenizer, self.model, self.optimizers = p.data.tokenizer, p.model, p.optimizers
        self.timer, self.events, self.alerts, self.watchdog = p.timer, p.events, p.alerts, p.watchdog
        self.train_step, self.evaluator, self.harness = p.train_step, p.evaluator, p.harness
        self.recovery, self.control, self.comm, self.sample = p.recovery, p.control, p.comm, p.sample
        self.checkpoints, self.state, self.lifecycle = p.checkpoints, p.state, p.lifecycle
        self.world_before: int | None = None  # the resumed checkpoint's world size
        self._last_loss: float | None = None  # all-reduced by the spike check
        if resume_from is not None:
            self._restore(*resume_from)
        self.replicas: TrainerReplicas | None = None  # [fault_tolerance]: the group's membership
        if self.cfg.fault_tolerance.enable:
            self.replicas = TrainerReplicas(self.cfg, self.device, self.dims.dp, self.data,
                                            self.state, self.counters, self.faults,
                                            self.lifecycle)
        self.train_step.replicas = self.replicas

    def _restore(self, ckpt: Path, state: dict[str, Any]) -> None:
        """The run as checkpoint `ckpt` (with `state`, its state.json) saved it: the weights
        and optimizer state, then the other parts of the registry (tessel.train.state),
        which a recovering replica group receives from its peer too."""
        self.checkpoints.restore(ckpt, self.device)
        try:
            self.state.load_state_dict(state)
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
        if self.proc.is_main:  # written only now: a refused or no-op call leaves it as it was
            self.lifecycle.write_start(self.resuming, self.checked, self.data.chat_template,
                                       self.tokenizer.save)
        self.lifecycle.announce(self.precision.name, self.train_step.accum, self.model.dp)
        self.lifecycle.start_event(self.checkpoints.last_saved_step >= 0, self.auto_resume,
                                   self.world_before, self.train_step.accum)
        log = StepLogger(cfg, self.display, open_metrics(cfg, self.run, self.display.print)
                         if self.proc.is_main else None, self.device, self.proc.world_size,
                         device_peak_flops(self.device),
                         (lambda rec: self.control.request(self.alerts.observe(rec)))
                         if self.alerts is not None else None)
        self.control.install()
        start = self.counters.start_clock()
        self.display.start(self.step)
        self.model.train()  # evaluation puts it back after each evaluation
        self.watchdog.start()
        try:
            loss = self._loop(log, start)
        except dist.DistBackendError as exc:
            raise self.lifecycle.collective_failure(exc) from None
        except (RecoveryGaveUp, TrainingDiverged) as exc:
            what, kind = (("gave up recovering from loss spikes", "recovery_gave_up")
                          if isinstance(exc, RecoveryGaveUp) else ("diverged", "diverged"))
            self.lifecycle.halt(exc.exit_code, what, kind, str(exc))
            raise
        except RuntimeError as exc:
            if not (self.proc.distributed and is_collective_failure(exc)):
                raise
            raise self.lifecycle.collective_failure(exc) from None
        finally:
            self._stop_parts(log)
        # A signal or an alert's action that came after the last step (during the final
        # evaluation or save) stopped nothing: the run is done, and says so (a `finish`
        # event, exit 0), or a SLURM job would requeue itself for a run with no step left.
        stopped_by = self.control.reason() if self.step < t.steps else None
        self.lifecycle.ended(stopped_by, getattr(self.harness, "failure", None),
                             self.data.unigram_baseline, self.sample)
        return self._result(loss, stopped_by)

    def _loop(self, log: StepLogger, start: float) -> torch.Tensor | None:
        """Optimizer steps up to train.steps, or to a stop at a step boundary, then the last
        checkpoint; the last step's loss (a device tensor), None when no step ran."""
        t, loss, grad_norm, first_step = self.cfg.train, None, None, self.step
        window_start, window_steps = time.perf_counter(), 0
        while self.step < t.steps:
            self.watchdog.beat(self.step, "step boundary")
            self.faults.at_step(self.step)
            if self.control.should_stop(self.checkpoints.written_here()):
                break
            loss, grad_norm = self.run_step()
            if not self.train_step.committed:  # a replica group failed: retried
                continue
            if self.recovery.enabled and self._spiked(loss, grad_norm):
                first_step = min(first_step, self.step)
                self.timer.discard()
                window_start, window_steps = time.perf_counter(), 0
                continue
            self.checkpoints.publish_finished(all_written=self.control.save_written)
            self.step += 1
            self.tokens_seen += t.tokens_per_step
            window_steps += 1
            self.display.step(self.step)
            if self.alerts is not None:
                self.alerts.rules.progressed()
            if self.step % self.cfg.metrics.log_interval == 0 or self.step == t.steps:
                self._log_train(log, loss, grad_norm, time.perf_counter() - window_start,
                                window_steps, time.perf_counter() - start, first_step)
                window_start, window_steps = time.perf_counter(), 0
            # the parts on a cadence say when they are due (each after the last step too,
            # but the checkpoint, written below)
            evaluate, save = self.evaluator.due(self.step), self.checkpoints.due(self.step)
            if evaluate:
                self._evaluate(log, start)
            if save:
                self._save(loss, grad_norm)
            score = self.harness is not None and self.harness.due(self.step)
            if score:
                self._score(log, start)
            if evaluate or save or score or self.step == t.steps:
                self.timer.discard()
                window_start, window_steps = time.perf_counter(), 0
        if self.step != self.checkpoints.last_saved_step:
            self._save(loss, grad_norm)
        self.checkpoints.finish()
        return loss

    def _stop_parts(self, log: StepLogger) -> None:
        """After the loop, however it ended: stop what runs beside it, deliver alerts."""
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
            self.batches_drawn = self.recovery.skips.pass_over(loader, accum, self.batches_drawn)
            batches = [loader.next_batch() for _ in range(accum)]
            self.train_step.loss_factor = self.faults.loss_factor(self.batches_drawn)
            self.batches_drawn += 1
            return self.train_step(batches)

    def _log_train(self, log: StepLogger, loss: torch.Tensor, grad_norm: torch.Tensor,
                   window: float, window_steps: int, elapsed: float, first_step: int) -> None:
        t, objective = self.cfg.train, self.train_step.objective
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
                   **(objective.metrics() if objective is not None else {}),
                   **(self.replicas.figures() if self.replicas is not None else {})})

    def _evaluate(self, log: StepLogger, start: float) -> None:
        if self.evaluator.val is None:  # no validation split
            return
        self.last_val_loss = self.evaluator.loss()
        log.eval(step=self.step, val_loss=self.last_val_loss, tokens_seen=self.tokens_seen,
                 elapsed_s=self.elapsed_prev + time.perf_counter() - start,  # DPO's eval_*:
                 extra=getattr(self.train_step.objective, "eval_metrics", None))

    def _score(self, log: StepLogger, start: float) -> None:
        """Benchmark scores through lm_eval (every rank runs them; rank 0 writes). A failure
        costs the scores, never the training or its checkpoints (Lifecycle.scoring_failed)."""
        assert self.harness is not None
        self.watchdog.phase("lm_eval benchmark scores (every rank calls the model together)")
        try:
            scores = self.harness.scores()
        except Exception as exc:  # noqa: BLE001 (whatever a task makes lm_eval raise)
            self.harness.failure = self.lifecycle.scoring_failed(exc)
            if self.harness.failure is None:
                raise
            return
        log.scores(step=self.step, scores=scores, tokens_seen=self.tokens_seen,
                   elapsed_s=self.elapsed_prev + time.perf_counter() - start)

    def evaluate(self) -> float:
        """Held-out loss of the model as it is now (see Evaluator)."""
        assert self.evaluator.val is not None, "this run has no validation split"
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
            **self.state.state_dict(),  # what a resume restores (tessel.train.state)
            "config": redact_config(self.cfg.to_dict()),  # no secret in a checkpoint
            "layout": self.dims.describe(),
            "world_size": self.proc.world_size,  # an elastic resume says when it changed
        }
        if self.lora_base is not None:
            state["lora_base"] = self.lora_base  # tessel.checkpoint.lora.FINGERPRINT_KEY
        self.checkpoints.save(self.step, state, self.device)
        if self.checkpoints.pending is not None:
            self.control.save_written = False  # until all ranks say otherwise

    def _spiked(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Whether the step just taken spiked (the loss all-reduced first: one collective);
        if so the run rolled back."""
        self.watchdog.phase("collective: all-reduce of the step's loss (spike check)")
        self._last_loss = self.train_step.global_loss(loss)
        bad = self.recovery.judge(self._last_loss, float(grad_norm.item()))
        if bad is not None:
            self._rollback(bad)
        return bad is not None

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
        self.lifecycle.rolled_back(bad_step, bad_batch, reason, self.recovery.skips.rollbacks)

    def _result(self, loss: torch.Tensor | None, stopped_by: str | None) -> TrainResult:
        return TrainResult(
            step=self.step, loss=self.train_step.global_loss(loss) if loss is not None else None,
            val_loss=self.last_val_loss, unigram_baseline=self.data.unigram_baseline,
            stopped_by=stopped_by, run_dir=self.run_dir,
            scoring_failure=getattr(self.harness, "failure", None))

    def close(self) -> None:
        """Release the process group and the run directory's lock (the trainer cannot
        train again afterwards)."""
        self.run.unlock()
        shutdown()
