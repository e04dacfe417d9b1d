"""tessel.observe.secrets: the one list of what a secret is, and every way tessel hides one.
Every secret in these tests contains "SECRET", and no output may."""

from __future__ import annotations

import ast
import copy
import json
from pathlib import Path

import pytest

import tessel.observe.notify as notify
import tessel.observe.report.page as report_page
import tessel.observe.report.plots as report_plots
import tessel.observe.wandb_sink as wandb_sink
from tessel.observe import secrets
from tessel.observe.secrets import (
    Redactor,
    hide_userinfo,
    is_secret_key,
    redact_config,
    redact_value,
    secret_strings,
)

ROOT = Path(__file__).resolve().parents[2]


# -- one list, one object ------------------------------------------------------------------


def test_report_notify_and_wandb_use_the_one_secrets_module() -> None:
    assert notify.Redactor is secrets.Redactor and notify.redact_value is secrets.redact_value
    assert report_page.Redactor is secrets.Redactor and report_plots.Redactor is secrets.Redactor
    assert wandb_sink.redact_config is secrets.redact_config
    # None keeps a copy of its own.
    for module in (notify, report_page, report_plots, wandb_sink):
        for name in ("SECRET_KEY", "_SECRET_KEY", "redact_url", "scrub_secrets", "_Redactor",
                     "_secret_strings", "_url_secrets"):
            assert not hasattr(module, name) or getattr(module, name) is getattr(secrets, name, None), \
                (module.__name__, name)


def test_no_other_module_decides_what_a_secret_is() -> None:
    """Only secrets.py compiles a pattern of secret key names."""
    offenders = []
    for path in sorted((ROOT / "tessel").rglob("*.py")):
        if path.name == "secrets.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and "password" in node.value and "|" in node.value:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def _imports_from(module_prefix: str) -> list[tuple[str, int, str, str]]:
    found = []
    for top in ("tessel", "tests"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(module_prefix):
                    found += [(str(path.relative_to(ROOT)), node.lineno, node.module, a.name)
                              for a in node.names]
    return found


@pytest.mark.parametrize("module", ["tessel.observe.secrets", "tessel.observe.notify",
                                    "tessel.observe.report", "tessel.observe.wandb_sink"])
def test_callers_import_public_names_that_exist(module: str) -> None:
    import importlib

    bad = []
    for where, line, mod, name in _imports_from(module):
        target = importlib.import_module(mod)
        if name.startswith("_") or not hasattr(target, name):
            bad.append(f"{where}:{line}: from {mod} import {name}")
    assert bad == []


@pytest.mark.parametrize("key", [
    "webhook_url", "webhook_urls", "smtp_password", "PASSWORD", "passwd", "client_secret",
    "secrets", "api_key", "apikey", "OPENAI_API_KEY", "hf_token", "access_token", "auth_token",
    "token_url", "token",
])
def test_secret_keys_are_the_union_of_the_old_lists(key: str) -> None:
    assert is_secret_key(key)


@pytest.mark.parametrize("key", [
    "tokenizer", "tokenize", "json_key", "smtp_user", "smtp_host", "email_to", "url", "name",
    "dp_comm_hook", "path",
])
def test_other_keys_are_not_secret(key: str) -> None:
    assert not is_secret_key(key)


# -- stand-ins -----------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "shown"), [
    ("https://hooks.example.com/T0/B0", "https://hooks.example.com/***"),
    ("https://hooks.slack.com/services/T0/B0/XYZ?x=1#f", "https://hooks.slack.com/***"),
    ("https://user:pw@example.com:8443/x?y=1", "https://example.com:8443/***"),
    ("http://user@host:8080/x", "http://host:8080/***"),
    ("http://127.0.0.1:9000", "http://127.0.0.1:9000/***"),
    ("http://[::1]:9000/a/b", "http://[::1]:9000/***"),
    ("  https://h.example.org/x  ", "https://h.example.org/***"),
    ("hunter2", "***"),
    ("not a url", "***"),
    ("user:pass", "***"),
    ("http://host:notaport/x", "***"),
    ("", "***"),
    # A reference says where the secret is kept, not what it is.
    ("env:TESSEL_WEBHOOK_URL", "env:TESSEL_WEBHOOK_URL"),
    ("env:not-a-name", "***"),
])
def test_redact_value(value: str, shown: str) -> None:
    assert redact_value(value) == shown


def test_hide_userinfo() -> None:
    assert hide_userinfo("git clone https://bot:PWSECRET@example.org/r.git now") == \
        "git clone https://***@example.org/r.git now"
    assert hide_userinfo("https://ghp_SECRET@github.com/o/r") == "https://***@github.com/o/r"
    assert hide_userinfo("mail tessel@localhost, see https://example.org/a@b") == \
        "mail tessel@localhost, see https://example.org/a@b"


def test_secret_strings_walks_tables_and_arrays() -> None:
    tree = {"notify": {"smtp_password": "PWSECRET", "smtp_user": "bot"},
            "alerts": [{"name": "a", "webhook_url": "https://h/T0SECRET"},
                       {"name": "b", "webhook_url": "env:HOOK"}],
            "webhook": {"urls": ["https://h/LISTSECRET", ""], "n": 3}}
    assert secret_strings(tree) == {"PWSECRET", "https://h/T0SECRET", "https://h/LISTSECRET"}


# -- redact_config -------------------------------------------------------------------------

CONFIG = {
    "model": {"preset": "tiny", "n_layers": 2},
    "data": {"tokenizer": "gpt2.json", "paths": ["a.jsonl", "https://bot:DATASECRET@data.example.org/b"],
             "json_key": "text"},
    "train": {"steps": 100, "lr": 3e-4, "compile": False},
    "alerts": [
        {"name": "plateau", "webhook_url": "https://bot:PWSECRET@hooks.example.com:8443/T0/B0SECRET?token=Q",
         "notify": ["webhook"], "threshold": 2.5},
        {"name": "nan", "notify": ["log"]},
        {"name": "env", "webhook_url": "env:TESSEL_WEBHOOK_URL", "notify": ["webhook"]},
    ],
    "notify": {"smtp_host": "mail.example.com", "smtp_user": "bot", "smtp_password": "SMTPSECRET",
               "email_to": ["ops@example.com"]},
    "hf_token": "hf_SECRET",
    "secrets": {"url": "https://vault.example.com/v1/SECRET", "ids": ["SECRET1", "SECRET2"], "n": 3,
                "nested": [{"key": "SECRET3"}], "pair": ("SECRET4", 5)},
    "webhook_timeout_s": 10,
    "empty_password": "",
}


def test_redact_config_hides_secrets_and_keeps_hosts() -> None:
    out = redact_config(CONFIG)
    assert "SECRET" not in json.dumps(out)
    hook = out["alerts"][0]["webhook_url"]
    assert hook == "https://hooks.example.com:8443/***"  # no user, password, path or token
    assert out["alerts"][2]["webhook_url"] == "env:TESSEL_WEBHOOK_URL"
    assert out["notify"]["smtp_password"] == "***" and out["hf_token"] == "***"
    assert out["secrets"] == {"url": "https://vault.example.com/***", "ids": ["***", "***"], "n": 3,
                              "nested": [{"key": "***"}], "pair": ("***", 5)}
    # A URL under an ordinary key keeps all but its user info.
    assert out["data"]["paths"] == ["a.jsonl", "https://***@data.example.org/b"]


def test_redact_config_changes_nothing_else() -> None:
    before = copy.deepcopy(CONFIG)
    out = redact_config(CONFIG)
    assert CONFIG == before  # the input is not modified
    assert out is not CONFIG and out["model"] is not CONFIG["model"]
    for section in ("model", "train"):
        assert out[section] == CONFIG[section]
    assert out["data"]["tokenizer"] == "gpt2.json" and out["data"]["json_key"] == "text"
    assert out["alerts"][1] == CONFIG["alerts"][1]
    assert {k: v for k, v in out["alerts"][0].items() if k != "webhook_url"} == \
        {k: v for k, v in CONFIG["alerts"][0].items() if k != "webhook_url"}
    assert {k: v for k, v in out["notify"].items() if k != "smtp_password"} == \
        {k: v for k, v in CONFIG["notify"].items() if k != "smtp_password"}
    assert out["webhook_timeout_s"] == 10  # a number under a secret-looking key is no secret
    assert out["empty_password"] == ""
    assert list(out) == list(CONFIG) and list(out["alerts"][0]) == list(CONFIG["alerts"][0])
    assert redact_config(out) == out  # idempotent


def test_a_redacted_config_still_loads() -> None:
    """A checkpoint's state.json holds the redacted copy, and resuming validates it."""
    from tessel.config import Config

    cfg = Config.from_dict({"model": {"preset": "tiny"}, "alerts": [
        {"name": "plateau", "when": "loss.above", "threshold": 9.0, "notify": ["webhook"],
         "webhook_url": "https://bot:PWSECRET@hooks.example.com/T0SECRET"}],
        "notify": {"smtp_host": "mail.example.com", "smtp_user": "bot"}})
    shown = redact_config(cfg.to_dict())
    assert "SECRET" not in json.dumps(shown)
    again = Config.from_dict(shown)
    assert again.alerts[0].webhook_url == "https://hooks.example.com/***"
    assert again.model == cfg.model and again.notify == cfg.notify


# -- Redactor ------------------------------------------------------------------------------


def test_redactor_hides_a_urls_parts_wherever_they_appear() -> None:
    url = "https://bot:PWSECRET@hooks.example.com/T0SECRET/B0 SECRET?token=QSECRET"
    r = Redactor([url, "SMTPSECRET", "", "  "])
    text = (f"posting to {url} failed; request https://hooks.example.com/T0SECRET/B0 SECRET?token=QSECRET, "
            "path /T0SECRET/B0 SECRET?token=QSECRET or /T0SECRET/B0%20SECRET?token=QSECRET, "
            "login bot:PWSECRET, password PWSECRET, smtp SMTPSECRET, other https://a:b@x.org/ok")
    shown = r.text(text)
    assert "SECRET" not in shown, shown
    assert shown.startswith("posting to https://hooks.example.com/*** failed; request "
                            "https://hooks.example.com/***, path *** or ***, login ***, password ***")
    assert shown.endswith("other https://***@x.org/ok")
    assert Redactor().text("nothing to hide") == "nothing to hide"


def test_redactor_for_config_and_its_toml() -> None:
    text = ('[notify]\nsmtp_password = "PWSECRET"\nsmtp_user = "bot"\n'
            'webhook_timeout_s = 10\n[[alerts]]\nwebhook_url = "https://h.example.org/T0SECRET"\n'
            '[[alerts]]\nwebhook_url = "env:HOOK"\n')
    r = Redactor.for_config(None, text)
    shown = r.toml(text)
    assert "SECRET" not in shown
    assert 'smtp_password = "***"' in shown and 'smtp_user = "bot"' in shown
    assert 'webhook_url = "https://h.example.org/***"' in shown and 'webhook_url = "env:HOOK"' in shown
    assert "webhook_timeout_s = 10" in shown
    assert r.text("sent to https://h.example.org/T0SECRET") == "sent to https://h.example.org/***"


# -- tokenizer settings are not secrets ----------------------------------------------------


@pytest.mark.parametrize("key", [
    "eod_token", "pad_token", "bos_token", "eos_token", "unk_token", "mask_token", "eodToken",
    "data.eod_token", "max_new_tokens", "max_gen_tokens", "sample_tokens", "tokens_per_step",
    "special_tokens", "token_id", "token_ids",
])
def test_tokenizer_settings_are_not_secret(key: str) -> None:
    assert not is_secret_key(key)


@pytest.mark.parametrize("key", [
    "HF_TOKEN", "hfToken", "apitoken", "id_token", "refresh_token", "bearer_token", "github_token",
    "x-auth-token", "slack_bot_token", "notify.hf_token", "credentials",
])
def test_credential_tokens_are_secret(key: str) -> None:
    assert is_secret_key(key)


_TOKENIZER_CONFIG = """
[model]
preset = "tiny"
[data]
eod_token = "<|endoftext|>"
[[alerts]]
name = "plateau"
when = "loss.above"
threshold = 9.0
notify = ["webhook"]
webhook_url = "https://bot:PWSECRET@hooks.example.com/T0SECRET"
"""


def test_tessel_config_shows_the_eod_token_and_hides_the_webhook(tmp_path: Path, capsys) -> None:
    from tessel.cli import main

    (tmp_path / "c.toml").write_text(_TOKENIZER_CONFIG)
    assert main(["config", str(tmp_path / "c.toml")]) == 0
    out = capsys.readouterr().out
    assert 'eod_token = "<|endoftext|>"' in out
    assert "SECRET" not in out and 'webhook_url = "https://hooks.example.com/***"' in out


def test_a_checkpoints_state_keeps_the_eod_token(tmp_path: Path, corpus: Path) -> None:
    from conftest import tiny_overrides

    from tessel import Trainer
    from tessel.checkpoint import latest_checkpoint
    from tessel.config import Config

    (tmp_path / "c.toml").write_text(_TOKENIZER_CONFIG)
    over = tiny_overrides(tmp_path / "run", corpus, **{"train.steps": 1, "checkpoint.interval": 1})
    Trainer(Config.load(tmp_path / "c.toml", over), console=False).train()
    state = (latest_checkpoint(tmp_path / "run" / "checkpoints") / "state.json").read_text()
    assert "SECRET" not in state
    config = json.loads(state)["config"]
    assert config["data"]["eod_token"] == "<|endoftext|>"
    assert config["alerts"][0]["webhook_url"] == "https://hooks.example.com/***"
