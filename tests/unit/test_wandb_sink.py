"""The W&B sink against a fake `wandb` module (wandb is not a dependency of tessel)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from tessel.errors import TesselError
from tessel.observe.wandb_sink import WandbSink


class FakeRun:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def log(self, data: dict, step: int | None = None) -> None:
        self.calls.append(("log", dict(data), step))

    def finish(self) -> None:
        self.calls.append(("finish",))


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch) -> list:
    calls: list = []
    mod = types.ModuleType("wandb")

    def init(**kwargs):
        calls.append(("init", kwargs))
        return FakeRun(calls)

    mod.init = init
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return calls


CONFIG = {
    "model": {"preset": "tiny"},
    "data": {"tokenizer": "auto"},
    "alerts": [{"name": "plateau", "webhook_url": "https://hooks.example.com/T0SECRET"}],
    "notify": {"smtp_user": "bot", "smtp_password": "PWSECRET"},
}


def test_offline_init_log_finish(fake_wandb: list, tmp_path: Path) -> None:
    sink = WandbSink(tmp_path, "tessel", "exp1", "offline", CONFIG)
    sink.write({"step": 10, "loss": 3.5, "lr": 1e-3, "mfu": None, "kind": "train", "ok": True})
    sink.write({"step": 20, "val_loss": 3.25, "val_ppl": 25.8})
    sink.write({"step": 20, "note": "text only"})  # nothing numeric: nothing logged
    sink.close()
    sink.close()  # idempotent

    (_, init), *rest = fake_wandb
    assert init["mode"] == "offline" and init["dir"] == str(tmp_path)
    assert init["project"] == "tessel" and init["name"] == "exp1"
    assert init["config"]["alerts"][0]["webhook_url"] == "https://hooks.example.com/***"
    assert init["config"]["notify"]["smtp_password"] == "***"
    assert init["config"]["data"]["tokenizer"] == "auto"
    assert "SECRET" not in repr(init)
    assert CONFIG["notify"]["smtp_password"] == "PWSECRET"  # the caller's dict is untouched
    assert rest == [
        ("log", {"loss": 3.5, "lr": 1e-3}, 10),
        ("log", {"val_loss": 3.25, "val_ppl": 25.8}, 20),
        ("finish",),
    ]


def test_resume_continues_the_same_wandb_run(fake_wandb: list, tmp_path: Path) -> None:
    WandbSink(tmp_path, "p", None, "offline", {}).close()
    WandbSink(tmp_path, "p", None, "offline", {}).close()
    first, second = (c[1] for c in fake_wandb if c[0] == "init")
    assert first["id"] == second["id"] and first["resume"] == "allow"


def test_missing_wandb_is_a_config_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(TesselError) as e:
        WandbSink(tmp_path, "p", None, "offline", {})
    assert str(e.value) == (
        "metrics.wandb = true needs the wandb package: pip install wandb (or set metrics.wandb = false)"
    )


def test_init_failure_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    mod = types.ModuleType("wandb")

    def init(**kwargs):
        raise RuntimeError("api_key not configured\n(no-tty)")

    mod.init = init
    monkeypatch.setitem(sys.modules, "wandb", mod)
    with pytest.raises(TesselError) as e:
        WandbSink(tmp_path, "p", None, "online", {})
    assert "\n" not in str(e.value) and "wandb login" in str(e.value)


def test_bad_mode(fake_wandb: list, tmp_path: Path) -> None:
    with pytest.raises(TesselError, match="wandb_mode"):
        WandbSink(tmp_path, "p", None, "disabled", {})
