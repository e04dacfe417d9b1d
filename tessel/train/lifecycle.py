"""What a run says and records as it starts and ends: the announcement, run.json, the
timeline events (start, resume, restart, finish, preemption, halt, replica groups) and the
closing lines. A part of its own, given the parts it reads, so that the loop reads as
orchestration."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from tessel.data.chat_files import run_tokenizer_config
from tessel.errors import CollectiveTimeout, TesselError
from tessel.models import active_param_count, param_count
from tessel.train.control import EXIT_PAUSED, EXIT_SCORING_FAILED, EXIT_STOPPED
from tessel.train.harness_check import describe_failure


class Lifecycle:
    def __init__(self, cfg: Any, run: Any, proc: Any, dims: Any, device: torch.device,
                 display: Any, events: Any, alerts: Any, control: Any, counters: Any):
        """`run`: the RunDir; `proc`: process_info(); `dims`: the ParallelDims; `display`:
        the ConsoleDisplay; `events`: the EventLog; `alerts`: the AlertCenter or None;
        `control`: the StopControl (told the alerts' actions); `counters`: the run's
        tessel.train.state.Counters."""
        self.cfg, self.run, self.proc, self.dims, self.device = cfg, run, proc, dims, device
        self.display, self.events, self.alerts, self.control = display, events, alerts, control
        self.counters = counters

    @property
    def step(self) -> int:
        return self.counters.step

    def run_info(self) -> dict[str, Any]:
        """Where this run (or its latest resumption) ran: what calibrating the planner from
        the run directory needs besides config.toml and metrics.jsonl."""
        device = self.device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        return {"world_size": self.proc.world_size, "device": device.type,
                "device_name": name, "layout": self.dims.describe(), "torch": torch.__version__}

    def write_start(self, resuming: bool, checked: Any, chat_template: Any,
                    save_tokenizer: Any) -> None:
        """Rank 0's start of the run directory: its lock, config.toml (parallel.zero and the
        micro-batch as given: `checked`, tessel.train.build.Checked), run.json and tokenizer."""
        cfg = self.cfg
        self.run.lock()
        if not resuming and self.run.holds_run():
            # another new run took this directory since the start-up check
            raise TesselError(f"{str(self.run.path)!r} already holds a run; choose another "
                              "--run.dir")
        saved = cfg.model_copy(update={
            "parallel": cfg.parallel.model_copy(update={"zero": checked.zero_as_given}),
            "train": cfg.train.model_copy(update={"micro_batch_size": checked.mbs_as_given})})
        self.run.write_start(saved.to_toml(), self.run_info(), save_tokenizer,
                             run_tokenizer_config(chat_template)
                             if chat_template is not None else None)

    def announce(self, precision: str, accum: int, dp: Any) -> None:
        """The run's first line (`dp`: the model's data parallelism, which says which stage
        parallel.zero = auto took)."""
        cfg, t = self.cfg, self.cfg.train
        planned = t.steps * t.tokens_per_step
        verb = f"resuming at step {self.step}" if self.step else "training"
        m = cfg.model
        moe = (f"; MoE: {m.moe_experts} experts, top-{m.moe_top_k}, "
               f"{active_param_count(m):,} active" if m.moe_experts else "")
        if cfg.lora.enabled:  # the whole model's adapters (every rank's share counted once)
            from tessel.planner.lora import adapter_parameters

            n = adapter_parameters(m, cfg.lora, m.n_layers,
                                   sum(m.is_moe_layer(i) for i in range(m.n_layers)), 1)
            moe += (f"; LoRA r={cfg.lora.rank} on {', '.join(cfg.lora.targets)}: {n:,} "
                    f"trainable ({n / param_count(m):.2%}), base frozen")
        reduce = {"none": "", "ddp": ", zero 0: DDP", "replicate": ", zero 0: replicated",
                  "fsdp": f", ZeRO-{dp.zero}"}[dp.kind]
        self.display.print(
            f"tessel: {verb} {param_count(m):,}-parameter model "
            f"({m.preset or 'custom'}{moe}) on {self.proc.world_size} x {self.device.type} "
            f"({precision}; {self.dims.describe()}{reduce}), "
            f"{t.steps} steps x {t.global_batch_size} x {t.seq_len} tokens = {planned:,} tokens "
            f"(accumulation {accum}); run dir {self.run.path}"
        )

    def start_event(self, resumed: bool, auto_resume: bool, world_before: int | None,
                    accum: int) -> None:
        """`resumed`: from a checkpoint; `world_before`: that checkpoint's world size."""
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if not resumed:
            kind, msg = "start", "started"
        elif auto_resume or restarts:
            kind, msg = "restart", f"resumed automatically at step {self.step}"
        else:
            kind, msg = "resume", f"resumed at step {self.step}"
        if restarts:
            msg += f" (torchrun restart {restarts})"
        self.events.write(kind, self.step, msg, world_size=self.proc.world_size,
                          layout=self.dims.describe())
        self.world_change(world_before, accum)

    def world_change(self, before: int | None, accum: int) -> None:
        """A resume on another number of processes than the checkpoint's (an elastic run
        that lost or regained nodes, or a resume on another layout): a `world_shrink` or
        `world_grow` event, and the alert rules on it. (Checkpoints written before the world
        size was saved say nothing: no event.)"""
        after, step = self.proc.world_size, self.step
        if before is None or before == after:
            return
        kind = "world_shrink" if after < before else "world_grow"
        t = self.cfg.train
        msg = (f"world size {before} -> {after} processes at step {step} "
               f"({self.dims.describe()}; micro-batch {t.micro_batch_size}, accumulation "
               f"{accum}, global batch {t.global_batch_size} kept)")
        self.events.write(kind, step, msg, world_size=after, world_size_before=before,
                          layout=self.dims.describe(), micro_batch_size=t.micro_batch_size,
                          accumulation=accum)
        self.display.print(f"tessel: {msg}")
        if self.alerts is not None:
            self.control.request(self.alerts.handle(self.alerts.rules.world_changed(
                before, after, step)))

    def replicas_changed(self, kind: str, n: int, message: str, **fields: Any) -> None:
        """A replica-group event (tessel.train.replicas) of a quorum of `n` groups, and the
        replicas.* alert rules on it."""
        before = fields.get("replicas_before", n)
        self.events.write(kind, self.step, message, replicas=n, **fields)
        self.display.print(f"tessel: {message}")
        if self.alerts is not None:
            firings = self.alerts.rules.replicas_changed(kind, before, n, self.step)
            self.control.request(self.alerts.handle(firings))

    def rolled_back(self, bad_step: int, bad_batch: int, reason: str, rollbacks: int) -> None:
        """A spike rollback's event and line (the run is back at the checkpoint's step)."""
        msg = (f"step {bad_step}: {reason}; rolled back to step {self.step} and skipping global "
               f"batch {bad_batch} (rollback {rollbacks} of {self.cfg.recovery.max_rollbacks})")
        self.events.write("rollback", bad_step, msg, from_step=bad_step, to_step=self.step,
                          skipped_batches=[bad_batch], reason=reason)
        self.display.print(f"tessel: {msg}")

    def halt(self, code: int, message: str, kind: str, detail: str) -> None:
        """Record that the run ended on purpose, so automatic restarts do not undo it."""
        self.events.write(kind, self.step, detail)
        if self.proc.is_main:
            self.run.write_halted(code, message, self.step)

    def ended(self, stopped_by: str | None, scoring_failure: str | None,
              unigram_baseline: float, sample: Any) -> None:
        """The closing event and lines of a run that finished or stopped (`stopped_by`);
        `sample`: the FinalSample, printed when it is due."""
        latest, step, run_dir = self.run.latest_link, self.step, self.run.path
        if stopped_by in ("pause", "stop"):
            code = EXIT_PAUSED if stopped_by == "pause" else EXIT_STOPPED
            what = "paused" if stopped_by == "pause" else "stopped"
            msg = f"{what} by an alert at step {step} with a checkpoint in {latest}"
            self.halt(code, msg, stopped_by, msg)
            self.display.print(f"tessel: {msg}; continue with `tessel train --resume "
                               f"{run_dir}` (exit code {code})")
        elif stopped_by:
            what = " (preemption warning)" if stopped_by == "SIGUSR1" else ""
            msg = f"{stopped_by}{what}: stopped at step {step} with a checkpoint in {latest}"
            self.events.write("preempt" if stopped_by != "SIGINT" else "interrupt", step, msg)
            self.display.print(f"{msg}; continue with `tessel train --resume {run_dir}`")
        else:
            val_loss = self.counters.val_loss
            self.events.write("finish", step, f"finished at step {step}", val_loss=val_loss)
            msg = f"done: step {step}"
            if val_loss is not None:
                msg += f", val loss {val_loss:.4f}"
                if unigram_baseline == unigram_baseline:  # DPO has none (NaN)
                    msg += f" (unigram baseline {unigram_baseline:.4f})"
            self.display.print(msg + f"; checkpoint in {latest}")
            if sample.due(step):
                self.display.print(sample.text())
            if scoring_failure is not None:
                # Recorded like a halt: an automatic restart must not turn it into success.
                if self.proc.is_main:
                    self.run.write_halted(EXIT_SCORING_FAILED, scoring_failure, step)
                self.display.print(
                    f"tessel: {scoring_failure}; the final checkpoint is saved, the scores from "
                    f"then on are missing (exit code {EXIT_SCORING_FAILED}): score the "
                    "checkpoint with `lm_eval --model hf` on its `tessel convert tessel-to-hf` "
                    "export")

    def scoring_failed(self, exc: Exception) -> str | None:
        """lm_eval scoring raised `exc`. None for a collective that failed or timed out (the
        run's failure: the caller re-raises it). Anything else (a task's data file gone, a
        metric that fails) costs the scores only: said in one line, recorded as an
        `lm_eval_failed` event and returned (no more scoring in this run, and a run that
        finishes ends with EXIT_SCORING_FAILED); its checkpoints are written as usual."""
        if isinstance(exc, (dist.DistBackendError, CollectiveTimeout)) or (
                isinstance(exc, RuntimeError) and self.proc.distributed
                and is_collective_failure(exc)):
            return None
        failure = f"lm_eval scoring failed at step {self.step}: {describe_failure(exc)}"
        self.events.write("lm_eval_failed", self.step, failure)
        self.display.print(f"tessel: {failure}; training goes on without benchmark scores")
        return failure

    def collective_failure(self, exc: BaseException) -> CollectiveTimeout:
        """The one-line error (exit 3) of a collective that failed or timed out."""
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        return CollectiveTimeout(
            f"rank {self.proc.rank}: a collective failed or did not complete within "
            f"parallel.timeout_s={self.cfg.parallel.timeout_s}s (a peer process died or hangs: "
            f"{first}); resume from the last checkpoint with `tessel train --resume "
            f"{self.run.path}`"
        )


def is_collective_failure(exc: RuntimeError) -> bool:
    """A collective that timed out or lost its peer (a process died: gloo sees the
    connection reset), as opposed to a bug."""
    text = str(exc).lower()
    return any(k in text for k in ("timed out", "timeout", "connection reset", "connection closed",
                                   "broken pipe", "gloo/transport", "nccl"))
