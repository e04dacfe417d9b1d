"""Alerts that act, spike/NaN rollback, pause and resume, preemption signals (one process).

Multi-process cases (a SIGKILLed rank under torchrun --max-restarts, the watchdog naming a
hung rank) are in tests/distributed/test_restarts.py.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from tessel import Config, Trainer
from tessel.checkpoint import read_full
from tessel.cli import main as tessel_main
from tessel.observe.events import read_events
from tessel.observe.metrics import read_metrics
from tessel.train.recovery import RecoveryGaveUp


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return read_full(run_dir / "checkpoints/latest", "model")


def _with_alerts(cfg: Config, *alerts: dict) -> Config:
    return Config.from_dict({**cfg.to_dict(), "alerts": list(alerts)})


RECOVERY = {"train.steps": 12, "checkpoint.interval": 4, "checkpoint.keep_last": 5,
            "recovery.spike_sigma": 6.0, "recovery.min_history": 3, "recovery.window": 10}


@pytest.mark.parametrize("fault", ["spike:batch=6:scale=1000", "nan:batch=6"])
def test_a_spike_rolls_back_skips_the_batch_and_ends_like_a_run_without_it(
        tiny_config, monkeypatch, fault):
    clean = tiny_config("clean", **RECOVERY, **{"recovery.skip_batches": [6]})
    Trainer(clean, console=False).train()

    monkeypatch.setenv("TESSEL_FAULT", fault)
    hit = tiny_config("hit", **RECOVERY)
    result = Trainer(hit, console=False).train()
    run = Path(hit.run.dir)

    assert result.step == 12 and result.exit_code == 0
    # Batch 6 was trained on in step 7, judged bad, rolled back to the step-4 checkpoint and
    # skipped: from then on the run is the run that never saw it, to the bit.
    assert _losses(run) == _losses(Path(clean.run.dir))
    wa, wb = _weights(run), _weights(Path(clean.run.dir))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    skipped = json.loads((run / "skipped_batches.json").read_text())["skipped"]
    assert [(s["batch"], s["step"], s["rolled_back_to"]) for s in skipped] == [(6, 7, 4)]
    rollbacks = [e for e in read_events(run) if e["kind"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["to_step"] == 4
    assert rollbacks[0]["skipped_batches"] == [6]


def test_recovery_gives_up_after_max_rollbacks(tiny_config, monkeypatch):
    monkeypatch.setenv("TESSEL_FAULT", "nan:batch=5;nan:batch=6")
    cfg = tiny_config(**RECOVERY, **{"recovery.max_rollbacks": 1})
    with pytest.raises(RecoveryGaveUp, match=r"max_rollbacks=1 rollbacks already done") as exc:
        Trainer(cfg, console=False).train()
    assert exc.value.exit_code == 6
    run = Path(cfg.run.dir)
    halted = json.loads((run / "HALTED.json").read_text())
    assert halted["exit_code"] == 6
    assert [e["kind"] for e in read_events(run)][-1] == "recovery_gave_up"
    # The checkpoints left are good ones: the first NaN was rolled back, the second never saved.
    w = _weights(run)
    assert all(torch.isfinite(v).all() for v in w.values())


class _Hook(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append({"path": self.path, **json.loads(body)})
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def webhook():
    _Hook.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/T0/SECRETPART", _Hook.received
    server.shutdown()


def test_a_plateau_alert_notifies_pauses_and_resumes_to_the_same_losses(
        tiny_config, webhook, monkeypatch, capsys):
    url, received = webhook
    monkeypatch.setenv("TESSEL_WEBHOOK_URL", url)  # the secret is never in config.toml
    common = {"train.steps": 12, "train.eval_interval": 2}
    plain = tiny_config("plain", **common)
    Trainer(plain, console=False).train()

    # A forced plateau: no evaluation improves by 100 nats, so after 2 evaluations without
    # a new best (steps 4 and 6) the rule fires and the run pauses at step 6.
    cfg = _with_alerts(tiny_config("paused", **common), {
        "name": "plateau", "when": "val_loss.no_improvement", "patience": 2, "min_delta": 100.0,
        "notify": ["log", "webhook"], "action": "pause"})
    run = Path(cfg.run.dir)
    result = Trainer(cfg, console=True).train()
    assert (result.stopped_by, result.step, result.exit_code) == ("pause", 6, 4)
    assert [p["rule"] for p in received] == ["plateau"]
    hook = received[0]
    assert hook["path"] == "/T0/SECRETPART" and hook["step"] == 6 and hook["action"] == "pause"
    assert hook["when"] == "val_loss.no_improvement" and "val_loss" in hook["values"]
    assert json.loads((run / "HALTED.json").read_text())["exit_code"] == 4

    # A job script's automatic resume honours the pause: exit 4 again, nothing trained.
    code = tessel_main(["train", "--auto-resume", "--quiet", str(run / "config.toml")])
    assert code == 4 and max(_losses(run)) == 6
    # A person's --resume continues; the rule keeps its state, fires again at step 10.
    assert tessel_main(["train", "--resume", str(run), "--quiet"]) == 4
    assert tessel_main(["train", "--resume", str(run), "--quiet"]) == 0
    assert not (run / "HALTED.json").exists()
    assert [p["step"] for p in received] == [6, 10]
    assert _losses(run) == _losses(Path(plain.run.dir))
    kinds = [e["kind"] for e in read_events(run)]
    assert kinds == ["start", "alert", "pause", "resume", "alert", "pause", "resume", "finish"]

    out = capsys.readouterr()
    assert "alert plateau at step 6" in out.out
    text = out.out + out.err + "".join(p.read_text() for p in run.glob("*.jsonl"))
    assert "SECRETPART" not in text


def test_threshold_and_nan_rules_fire_once_per_episode_and_stop(tiny_config):
    cfg = _with_alerts(
        tiny_config(**{"train.steps": 10}),
        {"name": "high-loss", "when": "loss.above", "threshold": 0.0, "action": "continue"},
        {"name": "stop-on-grad", "when": "grad_norm.above", "threshold": 0.0, "action": "stop"},
    )
    result = Trainer(cfg, console=False).train()
    # grad_norm > 0 at step 1: stop at the next step boundary with a checkpoint (exit 5).
    assert (result.stopped_by, result.step, result.exit_code) == ("stop", 1, 5)
    alerts = [e for e in read_events(Path(cfg.run.dir)) if e["kind"] == "alert"]
    assert sorted(a["rule"] for a in alerts) == ["high-loss", "stop-on-grad"]


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGUSR1"])
def test_preemption_signals_checkpoint_and_exit_zero(tiny_config, monkeypatch, capsys, signame):
    cfg = tiny_config(**{"train.steps": 10})
    trainer = Trainer(cfg, console=True)
    real_step, calls = trainer.run_step, {"n": 0}

    def step_then_signal():
        out = real_step()
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), getattr(signal, signame))
        return out

    monkeypatch.setattr(trainer, "run_step", step_then_signal)
    result = trainer.train()
    assert (result.stopped_by, result.step, result.exit_code) == (signame, 3, 0)
    assert (Path(cfg.run.dir) / "checkpoints/step_000003").is_dir() or \
        (Path(cfg.run.dir) / "checkpoints/latest").resolve().name.endswith("3")
    assert f"{signame}" in capsys.readouterr().out
    assert [e["kind"] for e in read_events(Path(cfg.run.dir))][-1] == "preempt"


def test_metrics_split_the_step_and_report_memory_eta_and_budget(tiny_config):
    cfg = tiny_config(**{"train.steps": 4, "metrics.log_interval": 2})
    Trainer(cfg, console=False).train()
    rec = next(r for r in read_metrics(Path(cfg.run.dir) / "metrics.jsonl") if r["step"] == 4)
    split = rec["time_data_s"] + rec["time_compute_s"] + rec["time_optimizer_s"]
    assert 0 < split <= rec["step_time_s"] * 1.01
    assert rec["time_compute_s"] > rec["time_data_s"]
    assert rec["token_budget_pct"] == 100.0 and rec["eta_s"] == 0.0
    assert rec["tokens_per_s_per_device"] == rec["tokens_per_s"]  # one process
    assert rec["mfu"] is None and rec["mem_rss_gib"] > 0.05
    assert not (Path(cfg.run.dir) / "watchdog").exists()  # nothing left when it never fired


def test_a_stalled_step_alerts_while_it_hangs(tiny_config, monkeypatch):
    import time

    cfg = _with_alerts(tiny_config(**{"train.steps": 4, "watchdog.timeout_s": 0}),
                       {"name": "stall", "when": "step_time.stall", "threshold": 1.5})
    trainer = Trainer(cfg, console=False)
    real_step, starts = trainer.run_step, []

    def slow_third_step():
        starts.append(time.monotonic())
        if len(starts) == 3:
            time.sleep(3.5)  # a stall the watchdog thread sees while it lasts
        return real_step()

    monkeypatch.setattr(trainer, "run_step", slow_third_step)
    assert trainer.train().exit_code == 0
    alerts = [e for e in read_events(Path(cfg.run.dir)) if e["kind"] == "alert"]
    assert {a["rule"] for a in alerts} == {"stall"}
    stalled = [a for a in alerts if a["step"] == 2]
    assert len(stalled) == 1 and stalled[0]["values"]["seconds_without_progress"] >= 1.5
    # No alert where no step was late: each step that took well under the threshold, from
    # one step's start to the next. (On a loaded machine any step, the first above all, can
    # itself take longer than 1.5 s, and then it rightly alerts too: "no step finished for
    # 1.5 s".)
    took = [b - a for a, b in zip(starts, starts[1:])]
    quick = [step for step, seconds in enumerate(took) if seconds < 1.4]
    assert not [a for a in alerts if a["step"] in quick], (took, alerts)


def test_an_alert_that_cannot_deliver_is_refused_before_anything_starts(tiny_config, monkeypatch):
    from tessel import TesselError

    monkeypatch.delenv("TESSEL_WEBHOOK_URL", raising=False)
    cfg = _with_alerts(tiny_config(), {"name": "p", "when": "nan", "notify": ["webhook"]})
    with pytest.raises(TesselError, match="alert 'p' notifies a webhook but none is set"):
        Trainer(cfg, console=False)
    assert not Path(cfg.run.dir).exists()
