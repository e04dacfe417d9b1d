"""Alert rules from the config, evaluated on the metrics as they are logged.

`AlertRules` only decides (it is pure and testable); `AlertCenter` delivers what fired (log,
webhook, e-mail through `notify.Notifier`), records it in events.jsonl and tells the
trainer the strongest action asked for (stop > pause > continue). Rank 0 evaluates; the
trainer shares the action with every rank at the next step boundary.
"""

from __future__ import annotations

import math
import os
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tessel.config import AlertConfig, NotifyConfig
from tessel.observe.events import EventLog
from tessel.observe.notify import Alert, EmailSettings, Notifier, resolve_secret

ACTIONS = ("continue", "pause", "stop")  # in order of strength


@dataclass
class Firing:
    rule: AlertConfig
    step: int
    values: dict[str, float | None]
    message: str


class _RuleState:
    """What one rule remembers between observations."""

    def __init__(self, rule: AlertConfig):
        self.rule = rule
        self.best: float | None = None
        self.since_best = 0
        self.armed = True  # threshold-like rules fire once per episode, then re-arm
        self.history: deque[float] = deque(maxlen=rule.window)

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "since_best": self.since_best, "armed": self.armed,
                "history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = state.get("best")
        self.since_best = int(state.get("since_best", 0))
        self.armed = bool(state.get("armed", True))
        self.history.clear()  # a rollback or a peer's state replaces what this rule holds
        self.history.extend(float(v) for v in state.get("history", []))


class AlertRules:
    def __init__(self, rules: list[AlertConfig]):
        self.states = [_RuleState(r) for r in rules]

    def observe(self, rec: dict[str, Any]) -> list[Firing]:
        """Judge one metrics record (a training log step or an evaluation)."""
        fired = []
        for st in self.states:
            f = self._judge(st, rec)
            if f is not None:
                fired.append(f)
        return fired

    def stalled(self, seconds: float, step: int) -> list[Firing]:
        """Called while waiting for a step (by the watchdog's thread)."""
        fired = []
        for st in self.states:
            r = st.rule
            if r.when != "step_time.stall":
                continue
            assert r.threshold is not None
            if seconds >= r.threshold and st.armed:
                st.armed = False
                fired.append(Firing(r, step, {"seconds_without_progress": round(seconds, 1)},
                                    f"no step finished for {seconds:.0f}s (threshold {r.threshold:g}s)"))
        return fired

    def world_changed(self, before: int, after: int, step: int) -> list[Firing]:
        """The run restarted on `after` processes where its checkpoint was written by
        `before` (an elastic run lost or regained nodes)."""
        when = ("world_size.shrink" if after < before else
                "world_size.grow" if after > before else None)
        verb = "shrank" if after < before else "grew"
        return [Firing(st.rule, step, {"world_size": after, "before": before},
                       f"world size {verb} from {before} to {after} processes")
                for st in self.states if st.rule.when == when]

    def replicas_changed(self, kind: str, before: int, after: int, step: int) -> list[Firing]:
        """Fault tolerance: the replica groups of a step went from `before` to `after`
        (`kind` replicas_lost / replicas_joined), or this group recovered from a peer
        (replica_healed)."""
        when, message = {
            "replicas_lost": ("replicas.lost", f"replica groups fell from {before} to {after}"),
            "replicas_joined": ("replicas.joined",
                                f"replica groups rose from {before} to {after}"),
            "replica_healed": ("replicas.healed", f"this replica group recovered from a peer "
                               f"at step {step}"),
        }[kind]
        return [Firing(st.rule, step, {"replicas": after, "before": before}, message)
                for st in self.states if st.rule.when == when]

    def progressed(self) -> None:
        for st in self.states:
            if st.rule.when == "step_time.stall":
                st.armed = True

    def _judge(self, st: _RuleState, rec: dict[str, Any]) -> Firing | None:
        r, step = st.rule, int(rec["step"])
        metric, _, kind = r.when.partition(".")
        if r.when == "nan":
            bad = {k: rec[k] for k in ("loss", "grad_norm", "val_loss")
                   if k in rec and not _finite(rec[k])}
            return self._episode(st, bool(bad), step, {k: None for k in bad},
                                 f"{' and '.join(bad)} not finite")
        if metric not in rec:
            return None
        value = _number(rec[metric])
        if kind == "no_improvement":
            if value is not None and (st.best is None or value < st.best - r.min_delta):
                st.best, st.since_best = value, 0
                return None
            st.since_best += 1
            if st.since_best < r.patience:
                return None
            st.since_best = 0  # re-armed: the next firing needs `patience` more
            best = f"{st.best:.4f}" if st.best is not None else "none"
            return Firing(r, step, {metric: value, "best": st.best},
                          f"{metric} has not improved on {best} by more than {r.min_delta:g} "
                          f"for {r.patience} {'evaluations' if metric == 'val_loss' else 'log steps'}")
        if kind == "above":
            assert r.threshold is not None
            above = value is not None and value > r.threshold
            return self._episode(st, above, step, {metric: value, "threshold": r.threshold},
                                 f"{metric} {_fmt(value)} above {r.threshold:g}")
        if r.when == "tokens_per_s.drop":
            if value is None:
                return None
            enough = len(st.history) >= max(3, r.window // 2)
            median = statistics.median(st.history) if st.history else None
            st.history.append(value)
            dropped = enough and median is not None and value < r.fraction * median
            return self._episode(st, dropped, step, {"tokens_per_s": value, "median": median},
                                 f"tokens/s {value:,.0f} below {r.fraction:g} x the moving median "
                                 f"{(median or 0):,.0f}")
        return None

    @staticmethod
    def _episode(st: _RuleState, condition: bool, step: int, values: dict[str, Any],
                 message: str) -> Firing | None:
        if not condition:
            st.armed = True
            return None
        if not st.armed:
            return None
        st.armed = False
        return Firing(st.rule, step, values, message)

    def state_dict(self) -> list[dict[str, Any]]:
        return [{"name": st.rule.name, **st.state_dict()} for st in self.states]

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        by_name = {s.get("name"): s for s in states}
        for st in self.states:
            if st.rule.name in by_name:
                st.load_state_dict(by_name[st.rule.name])


def check_alerts(rules: list[AlertConfig], notify: NotifyConfig) -> None:
    """Refuse, on every rank and before anything starts, rules that could not deliver."""
    from tessel.errors import TesselError

    for r in rules:
        if "webhook" in r.notify and not (r.webhook_url or os.environ.get("TESSEL_WEBHOOK_URL")):
            raise TesselError(
                f"alert {r.name!r} notifies a webhook but none is set; set TESSEL_WEBHOOK_URL "
                "in the environment (or webhook_url in the rule)"
            )
        if "webhook" in r.notify and r.webhook_url:
            resolve_secret(r.webhook_url, f"alert {r.name!r} webhook_url")  # env:NAME is set
        if "email" in r.notify and not (notify.smtp_host and notify.email_to):
            raise TesselError(
                f"alert {r.name!r} notifies by e-mail; set notify.smtp_host and notify.email_to"
            )
        if "email" in r.notify and notify.smtp_user:
            resolve_secret(notify.smtp_user, "notify.smtp_user")


class AlertCenter:
    """Rules plus delivery. `handle` returns the strongest action of what fired."""

    def __init__(self, rules: list[AlertConfig], notify: NotifyConfig, run: str, events: EventLog,
                 log: Callable[[str], None]):
        self.rules = AlertRules(rules)
        self.run, self.events, self.log = run, events, log
        email = None
        if notify.smtp_host:
            email = EmailSettings(
                host=notify.smtp_host, port=notify.smtp_port, sender=notify.email_from,
                to=list(notify.email_to), user=notify.smtp_user,
                password=os.environ.get("TESSEL_SMTP_PASSWORD"), starttls=notify.smtp_starttls,
            )
        self.notifiers = [
            Notifier(list(r.notify), r.webhook_url or os.environ.get("TESSEL_WEBHOOK_URL"), email, log)
            for r in rules
        ]
        self._index = {id(r): i for i, r in enumerate(rules)}

    def observe(self, rec: dict[str, Any]) -> str:
        return self.handle(self.rules.observe(rec))

    def handle(self, fired: list[Firing]) -> str:
        action = "continue"
        for f in fired:
            r = f.rule
            self.events.write("alert", f.step, f.message, rule=r.name, when=r.when,
                              action=r.action, values=f.values)
            self.notifiers[self._index[id(r)]].send(Alert(
                run=self.run, rule=r.name, when=r.when, step=f.step, values=f.values,
                message=f.message, action=r.action,
            ))
            if ACTIONS.index(r.action) > ACTIONS.index(action):
                action = r.action
        return action

    def flush(self, timeout_s: float = 30.0) -> None:
        """Deliver what is queued (before the process exits)."""
        for n in self.notifiers:
            n.flush(timeout_s)

    def close(self) -> None:
        for n in self.notifiers:
            n.close()


def _number(value: Any) -> float | None:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _finite(value: Any) -> bool:
    return _number(value) is not None


def _fmt(value: float | None) -> str:
    return "nan" if value is None else f"{value:.4g}"
