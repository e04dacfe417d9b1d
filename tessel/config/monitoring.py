"""The sections that watch a run and act on what they see: metrics sinks, alert rules and
their notifications, loss-spike recovery, the hang watchdog."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tessel.config.base import Section


class MetricsConfig(Section):
    log_interval: int = Field(10, gt=0)
    """Log metrics to the console, metrics.jsonl and TensorBoard every N steps."""
    tensorboard: bool = True
    """Write TensorBoard event files to the run directory."""
    wandb: bool = False
    """Also log to Weights & Biases (needs `pip install wandb`; rank 0 only)."""
    wandb_project: str = "tessel"
    """W&B project name."""
    wandb_mode: Literal["online", "offline"] = "offline"
    """offline writes to RUN_DIR/wandb with no network (upload later with `wandb sync`);
    online streams to the W&B server."""
    prometheus_port: int | None = Field(None, ge=0, le=65535)
    """Serve the latest metrics as Prometheus text on http://HOST:PORT/metrics from rank 0
    (0: any free port, printed at start; unset: no endpoint)."""
    comm_sample_interval: int = Field(200, ge=0)
    """Profile one training step in every N (the last of each N) to measure how long each
    rank was held up by communication (`time_comm_exposed_s`, `comm_exposed_share` in the
    next log record; docs/monitoring.md); the other steps run unprofiled. 0: never. A
    profiled step took 1.4-1.8x a plain one on toy CPU models, so one in 200 costs under
    0.5% of a run (2-4% at 20; benchmarks/comm_sampling.py, docs/performance.md)."""
    comm_sample_after: int = Field(0, ge=0)
    """No step up to this one (the run's step number) is profiled for communication; the
    sampling counts from here (steps after+N, after+2N, ...). For a benchmark or a scaling
    sweep: its timed steps then run unprofiled, which interleaving does not give on several
    processes (the plain steps between profiled ones ran up to 20% slower under DDP on
    gloo; docs/scaling.md). 0: sampling from the first step."""


AlertCondition = Literal[
    "val_loss.no_improvement", "loss.no_improvement", "loss.above", "val_loss.above",
    "grad_norm.above", "nan", "tokens_per_s.drop", "step_time.stall",
    "comm_exposed_share.above", "time_comm_exposed_s.above", "world_size.shrink",
    "world_size.grow", "replicas.lost", "replicas.joined", "replicas.healed",
]


class AlertConfig(Section):
    name: str = Field(min_length=1)
    """The rule's name, shown in notifications and the report."""
    when: AlertCondition
    """Condition: `val_loss.no_improvement` / `loss.no_improvement` (no new best by more
    than `min_delta` over `patience` evaluations / log steps); `loss.above`,
    `val_loss.above`, `grad_norm.above` (over `threshold`); `nan` (NaN/Inf loss or grad
    norm); `tokens_per_s.drop` (below `fraction` of the moving median of the last `window`
    log steps); `step_time.stall` (no step finished for `threshold` seconds);
    `comm_exposed_share.above` (the share of a step spent waiting on communication, 0 to 1) and
    `time_comm_exposed_s.above` (those seconds), judged at log steps that carry them
    (metrics.comm_sample_interval); `world_size.shrink` / `world_size.grow` (the run resumed on
    fewer / more processes than its checkpoint was written by: an elastic run that lost or
    regained nodes, or a resume on another layout; judged once, at the start);
    `replicas.lost` / `replicas.joined` (fault_tolerance: fewer / more replica groups took
    part in a step than in the one before) and `replicas.healed` (this replica group took its
    state from a peer)."""
    patience: int = Field(3, gt=0)
    """Evaluations (or log steps) without improvement before a no_improvement rule fires."""
    min_delta: float = Field(0.0, ge=0)
    """Smallest decrease that counts as an improvement."""
    threshold: float | None = None
    """Limit for the .above rules; seconds for step_time.stall."""
    fraction: float = Field(0.5, gt=0, lt=1)
    """tokens_per_s.drop fires below this fraction of the moving median."""
    window: int = Field(10, gt=1)
    """Log steps in tokens_per_s.drop's moving median."""
    notify: list[Literal["log", "webhook", "email"]] = Field(default_factory=lambda: ["log"])
    """Where to send it: the run's log, a webhook (JSON POST), e-mail (see [notify])."""
    webhook_url: str | None = None
    """Webhook for this rule; falls back to the TESSEL_WEBHOOK_URL environment variable
    (prefer it: config.toml is saved in the run directory). Never printed."""
    action: Literal["continue", "pause", "stop"] = "continue"
    """What the run does: continue; pause (checkpoint, exit code 4, `tessel train --resume`
    continues); stop (checkpoint, exit code 5)."""

    @model_validator(mode="after")
    def _needs(self) -> AlertConfig:
        if self.when.endswith(".above") or self.when == "step_time.stall":
            if self.threshold is None:
                raise ValueError(f"alert {self.name!r}: when={self.when!r} needs a threshold")
        if self.when == "comm_exposed_share.above" and (self.threshold or 0) >= 1:
            raise ValueError(
                f"alert {self.name!r}: comm_exposed_share is a share of the step (0 to 1), so "
                f"threshold={self.threshold:g} can never be passed; use a threshold below 1 "
                "(e.g. 0.3), or time_comm_exposed_s.above for seconds")
        if self.when == "step_time.stall" and self.action != "continue":
            raise ValueError(
                f"alert {self.name!r}: a stalled step cannot checkpoint; use action='continue' "
                "(the watchdog ends a hung job)"
            )
        return self


COMM_CONDITIONS = ("comm_exposed_share.above", "time_comm_exposed_s.above")
"""The alert conditions judged on the profiled steps' communication figures."""


def check_comm_alerts(alerts: list[AlertConfig], metrics: MetricsConfig) -> None:
    """Refuse (ValueError, for the config's validation) a communication rule that can never
    fire because no step is profiled for communication."""
    if metrics.comm_sample_interval:
        return
    for a in alerts:
        if a.when in COMM_CONDITIONS:
            raise ValueError(
                f"alert {a.name!r}: when={a.when!r} can never fire with "
                "metrics.comm_sample_interval = 0 (no step is profiled for communication); "
                "set metrics.comm_sample_interval (e.g. 20) or drop the rule")


class NotifyConfig(Section):
    smtp_host: str | None = None
    """SMTP server for alerts with notify = ["email"]."""
    smtp_port: int = Field(587, gt=0, le=65535)
    """SMTP port (587 with STARTTLS, 25 without)."""
    smtp_starttls: bool = True
    """Upgrade the SMTP connection with STARTTLS."""
    smtp_user: str | None = None
    """SMTP login; the password comes only from the TESSEL_SMTP_PASSWORD environment
    variable, never from a file."""
    email_from: str = "tessel@localhost"
    """Sender address."""
    email_to: list[str] = Field(default_factory=list)
    """Recipients."""


class RecoveryConfig(Section):
    spike_sigma: float = Field(0.0, ge=0)
    """Roll back when a step's loss or grad norm exceeds the mean of the last `window` steps
    by this many standard deviations, or is NaN/Inf (0: off). Costs one host sync per step."""
    window: int = Field(50, gt=1)
    """Steps in the moving window of loss and grad-norm statistics."""
    min_history: int = Field(10, gt=1)
    """Steps seen before a spike can be judged (NaN/Inf are judged from the first step)."""
    max_rollbacks: int = Field(3, ge=0)
    """Rollbacks allowed in a run; the next spike ends it (exit code 6)."""
    skip_batches: list[int] = Field(default_factory=list)
    """Global batch indices (0-based positions in the training stream) never trained on;
    rollbacks add the offending ones to RUN_DIR/skipped_batches.json."""


class WatchdogConfig(Section):
    timeout_s: int = Field(480, ge=0)
    """No progress (step, evaluation or checkpoint) for this many seconds: every rank dumps
    its Python stacks to RUN_DIR/watchdog/ and the job exits with code 3 (0: off). Below
    parallel.timeout_s, so it sees a hang before the collective times out."""
