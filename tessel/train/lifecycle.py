"""What a run says and records as it starts and ends: the announcement, run.json, the
timeline events (start, resume, restart, finish, preemption, halt) and the closing lines.
Functions of a Trainer, kept out of the loop so that it reads as orchestration."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tessel.errors import CollectiveTimeout
from tessel.generate import sample
from tessel.models import active_param_count, param_count
from tessel.train.control import EXIT_PAUSED, EXIT_SCORING_FAILED, EXIT_STOPPED
from tessel.train.harness_check import describe_failure

if TYPE_CHECKING:
    from tessel.train.trainer import Trainer


def run_info(tr: Trainer) -> dict[str, Any]:
    """Where this run (or its latest resumption) ran: what calibrating the planner from
    the run directory needs besides config.toml and metrics.jsonl."""
    name = torch.cuda.get_device_name(tr.device) if tr.device.type == "cuda" else "cpu"
    return {"world_size": tr.proc.world_size, "device": tr.device.type,
            "device_name": name, "layout": tr.dims.describe(), "torch": torch.__version__}


def announce(tr: Trainer) -> None:
    cfg, t = tr.cfg, tr.cfg.train
    planned = t.steps * t.global_batch_size * t.seq_len
    verb = f"resuming at step {tr.step}" if tr.step else "training"
    m = cfg.model
    moe = (f"; MoE: {m.moe_experts} experts, top-{m.moe_top_k}, "
           f"{active_param_count(m):,} active" if m.moe_experts else "")
    if cfg.lora.enabled:  # the whole model's adapters (every rank's share counted once)
        from tessel.planner.lora import adapter_parameters

        n = adapter_parameters(m, cfg.lora, m.n_layers,
                               sum(m.is_moe_layer(i) for i in range(m.n_layers)), 1)
        moe += (f"; LoRA r={cfg.lora.rank} on {', '.join(cfg.lora.targets)}: {n:,} trainable "
                f"({n / param_count(m):.2%}), base frozen")
    tr.display.print(
        f"tessel: {verb} {param_count(m):,}-parameter model "
        f"({m.preset or 'custom'}{moe}) on {tr.proc.world_size} x {tr.device.type} "
        f"({tr.precision.name}; {tr.dims.describe()}{_data_parallel(tr)}), "
        f"{t.steps} steps x {t.global_batch_size} x {t.seq_len} tokens = {planned:,} tokens "
        f"(accumulation {tr.train_step.accum}); run dir {tr.run_dir}"
    )


def _data_parallel(tr: Trainer) -> str:
    """How gradients are reduced: says which stage parallel.zero = auto took."""
    dp = tr.model.dp
    return {"none": "", "ddp": ", zero 0: DDP", "replicate": ", zero 0: replicated",
            "fsdp": f", ZeRO-{dp.zero}"}[dp.kind]


def start_event(tr: Trainer) -> None:
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if tr.checkpoints.last_saved_step < 0:
        kind, msg = "start", "started"
    elif tr.auto_resume or restarts:
        kind, msg = "restart", f"resumed automatically at step {tr.step}"
    else:
        kind, msg = "resume", f"resumed at step {tr.step}"
    if restarts:
        msg += f" (torchrun restart {restarts})"
    tr.events.write(kind, tr.step, msg, world_size=tr.proc.world_size, layout=tr.dims.describe())
    world_change(tr, tr.world_before)


def world_change(tr: Trainer, before: int | None) -> None:
    """A resume on another number of processes than the checkpoint's (an elastic run that
    lost or regained nodes, or a resume on another layout): a `world_shrink` or `world_grow`
    event, and the alert rules on it. (Checkpoints written before the world size was saved
    say nothing: no event.)"""
    after = tr.proc.world_size
    if before is None or before == after:
        return
    kind = "world_shrink" if after < before else "world_grow"
    t = tr.cfg.train
    msg = (f"world size {before} -> {after} processes at step {tr.step} "
           f"({tr.dims.describe()}; micro-batch {t.micro_batch_size}, accumulation "
           f"{tr.train_step.accum}, global batch {t.global_batch_size} kept)")
    tr.events.write(kind, tr.step, msg, world_size=after, world_size_before=before,
                    layout=tr.dims.describe(), micro_batch_size=t.micro_batch_size,
                    accumulation=tr.train_step.accum)
    tr.display.print(f"tessel: {msg}")
    if tr.alerts is not None:
        tr.control.request(tr.alerts.handle(tr.alerts.rules.world_changed(before, after,
                                                                           tr.step)))


def halt(tr: Trainer, code: int, message: str, kind: str, detail: str) -> None:
    """Record that the run ended on purpose, so automatic restarts do not undo it."""
    tr.events.write(kind, tr.step, detail)
    if tr.proc.is_main:
        tr.run.write_halted(code, message, tr.step)


def ended(tr: Trainer, stopped_by: str | None) -> None:
    """The closing event and lines of a run that finished or stopped (`stopped_by`)."""
    latest = tr.run.latest_link
    if stopped_by in ("pause", "stop"):
        code = EXIT_PAUSED if stopped_by == "pause" else EXIT_STOPPED
        what = "paused" if stopped_by == "pause" else "stopped"
        msg = f"{what} by an alert at step {tr.step} with a checkpoint in {latest}"
        halt(tr, code, msg, stopped_by, msg)
        tr.display.print(
            f"tessel: {msg}; continue with `tessel train --resume {tr.run_dir}` (exit code {code})"
        )
    elif stopped_by:
        what = " (preemption warning)" if stopped_by == "SIGUSR1" else ""
        msg = f"{stopped_by}{what}: stopped at step {tr.step} with a checkpoint in {latest}"
        tr.events.write("preempt" if stopped_by != "SIGINT" else "interrupt", tr.step, msg)
        tr.display.print(f"{msg}; continue with `tessel train --resume {tr.run_dir}`")
    else:
        tr.events.write("finish", tr.step, f"finished at step {tr.step}",
                        val_loss=tr.last_val_loss)
        _finish_message(tr)
        if tr.scoring_failure is not None:
            # Recorded like a halt: an automatic restart must not turn it into success.
            if tr.proc.is_main:
                tr.run.write_halted(EXIT_SCORING_FAILED, tr.scoring_failure, tr.step)
            tr.display.print(
                f"tessel: {tr.scoring_failure}; the final checkpoint is saved, the scores from "
                f"then on are missing (exit code {EXIT_SCORING_FAILED}): score the checkpoint "
                "with `lm_eval --model hf` on its `tessel convert tessel-to-hf` export")


def scoring_failed(tr: Trainer, exc: Exception) -> bool:
    """lm_eval scoring raised `exc`. False for a collective that failed or timed out (the
    run's failure: the caller re-raises it). Anything else (a task's data file gone, a
    metric that fails) costs the scores only: said in one line, recorded as an
    `lm_eval_failed` event, no more scoring in this run, and a run that finishes ends with
    EXIT_SCORING_FAILED; its checkpoints are written as usual."""
    if isinstance(exc, (dist.DistBackendError, CollectiveTimeout)) or (
            isinstance(exc, RuntimeError) and tr.proc.distributed and is_collective_failure(exc)):
        return False
    tr.scoring_failure = f"lm_eval scoring failed at step {tr.step}: {describe_failure(exc)}"
    tr.events.write("lm_eval_failed", tr.step, tr.scoring_failure)
    tr.display.print(f"tessel: {tr.scoring_failure}; training goes on without benchmark "
                     "scores")
    return True


def _finish_message(tr: Trainer) -> None:
    msg = f"done: step {tr.step}"
    if tr.last_val_loss is not None:
        msg += (f", val loss {tr.last_val_loss:.4f} "
                f"(unigram baseline {tr.data.unigram_baseline:.4f})")
    tr.display.print(msg + f"; checkpoint in {tr.run.latest_link}")
    n = tr.cfg.run.sample_tokens
    if n and tr.proc.distributed:
        tr.display.print(
            f"(no sample under a parallel layout; `tessel generate {tr.run_dir}` samples "
            "from the checkpoint)"
        )
    elif n and tr.cfg.data.source == "sft":  # a reply to the prompt as a user message
        from tessel.generate import chat_prompt, chat_template_for

        prompt = tr.cfg.run.sample_prompt
        template = chat_template_for(tr.run_dir, None, tr.tokenizer)
        ids, end, stop_id = chat_prompt(template, tr.tokenizer, prompt)
        reply = tr.tokenizer.hf.decode(sample(tr.model.inner[0], ids, n, seed=tr.cfg.train.seed,
                                              stop_id=stop_id), skip_special_tokens=False)
        tr.display.print(f"sample (chat):\nuser: {prompt}\nassistant: "
                         + (reply.split(end, 1)[0] if end else reply))
    elif n:
        prompt = tr.cfg.run.sample_prompt
        ids = sample(tr.model.inner[0], tr.tokenizer.encode(prompt), n, seed=tr.cfg.train.seed,
                     stop_id=tr.tokenizer.eod_id)
        tr.display.print("sample:\n" + prompt + tr.tokenizer.decode(ids))


def collective_failure(tr: Trainer, exc: BaseException) -> CollectiveTimeout:
    """The one-line error (exit 3) of a collective that failed or timed out."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    return CollectiveTimeout(
        f"rank {tr.proc.rank}: a collective failed or did not complete within "
        f"parallel.timeout_s={tr.cfg.parallel.timeout_s}s (a peer process died or hangs: "
        f"{first}); resume from the last checkpoint with `tessel train --resume {tr.run_dir}`"
    )


def is_collective_failure(exc: RuntimeError) -> bool:
    """A collective that timed out or lost its peer (a process died: gloo sees the
    connection reset), as opposed to a bug."""
    text = str(exc).lower()
    return any(k in text for k in ("timed out", "timeout", "connection reset", "connection closed",
                                   "broken pipe", "gloo/transport", "nccl"))
