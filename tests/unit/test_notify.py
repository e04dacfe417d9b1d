"""Alert delivery against real loopback servers: an HTTP server for the webhook and a minimal
SMTP server for e-mail. Every secret in these tests contains "SECRET", and no log line may."""

from __future__ import annotations

import base64
import email
import email.policy
import json
import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tessel.errors import TesselError
from tessel.observe.notify import Alert, EmailSettings, Notifier, resolve_secret

FAST = dict(backoff_s=0.01, timeout_s=2.0)


def make_alert(**kw) -> Alert:
    base = dict(
        run="runs/exp1",
        rule="plateau",
        when="val_loss.no_improvement",
        step=40,
        values={
            "val_loss": 2.5,
            "best": 2.4,
            "nan_val": float("nan"),
            "inf_val": float("inf"),
            "missing": None,
        },
        message="val_loss 2.5000 has not improved on 2.4000 for 3 evaluations",
        action="pause",
    )
    base.update(kw)
    return Alert(**base)


class Logs(list):
    """Collects log lines from any thread."""

    def __call__(self, line: str) -> None:
        self.append(line)

    def text(self) -> str:
        return "\n".join(self)


# -- a loopback webhook server -------------------------------------------------------------


class Hook:
    """A webhook endpoint: answers requests with `statuses` in turn (the last one repeats),
    optionally holding each request until `release` is set."""

    def __init__(self, statuses: list[int], hold: bool = False):
        self.statuses = list(statuses)
        self.requests: list[dict] = []
        self.release = threading.Event()
        if not hold:
            self.release.set()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                hook.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                hook.release.wait(5)
                status = hook.statuses.pop(0) if len(hook.statuses) > 1 else hook.statuses[0]
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"ok")
                except OSError:
                    pass  # the client gave up (the timeout test): nothing to answer

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/T0SECRET/B0SECRET?token=QSECRET"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hook_factory() -> Iterator:
    hooks: list[Hook] = []

    def make(statuses: list[int], hold: bool = False) -> Hook:
        hooks.append(Hook(statuses, hold))
        return hooks[-1]

    yield make
    for h in hooks:
        h.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def strict_json(body: bytes) -> dict:
    def no_constants(name: str):
        raise AssertionError(f"invalid JSON constant {name}")

    return json.loads(body, parse_constant=no_constants)


# -- webhook -------------------------------------------------------------------------------


def test_webhook_posts_alert_json_and_logs_line(hook_factory) -> None:
    hook = hook_factory([200])
    logs = Logs()
    n = Notifier(["log", "webhook"], hook.url, None, logs, **FAST)
    n.send(make_alert())
    assert n.flush(5)
    n.close()

    assert logs == [
        "alert plateau at step 40: val_loss 2.5000 has not improved on 2.4000 for 3 evaluations -> pause"
    ]
    (req,) = hook.requests
    assert req["path"] == "/T0SECRET/B0SECRET?token=QSECRET"
    assert req["headers"]["Content-Type"] == "application/json"
    body = strict_json(req["body"])
    assert set(body) == {"run", "rule", "when", "step", "values", "message", "action", "text"}
    assert body["run"] == "runs/exp1" and body["rule"] == "plateau"
    assert body["when"] == "val_loss.no_improvement" and body["step"] == 40
    assert body["action"] == "pause"
    assert body["values"] == {
        "val_loss": 2.5,
        "best": 2.4,
        "nan_val": "nan",
        "inf_val": "inf",
        "missing": None,
    }
    assert "plateau" in body["text"] and "step 40" in body["text"] and "\n" not in body["text"]


def test_webhook_retries_5xx_then_delivers(hook_factory) -> None:
    hook = hook_factory([503, 503, 200])
    logs = Logs()
    n = Notifier(["webhook"], hook.url, None, logs, retries=4, **FAST)
    n.send(make_alert())
    assert n.flush(5)
    assert len(hook.requests) == 3  # delivered on the third attempt
    assert logs == []  # success is silent; no "log" channel asked for


def test_webhook_retries_429(hook_factory) -> None:
    hook = hook_factory([429, 200])
    logs = Logs()
    n = Notifier(["webhook"], hook.url, None, logs, **FAST)
    n.send(make_alert())
    assert n.flush(5)
    assert len(hook.requests) == 2 and logs == []


def test_webhook_send_returns_at_once_and_failure_is_one_redacted_line(hook_factory) -> None:
    hook = hook_factory([500], hold=True)  # every request waits until released, then 500
    logs = Logs()
    n = Notifier(["webhook"], hook.url, None, logs, retries=2, **FAST)
    n.send(make_alert())  # must not wait for the held request
    assert not n.flush(0.05)  # still pending: the delivery is on the background thread
    hook.release.set()
    assert n.flush(5)
    assert len(hook.requests) == 3
    assert logs == [
        f"alert webhook to http://127.0.0.1:{hook.port}/*** failed after 3 attempts: "
        "HTTP 500 Internal Server Error"
    ]
    assert "SECRET" not in logs.text()


def test_webhook_4xx_is_not_retried(hook_factory) -> None:
    hook = hook_factory([404])
    logs = Logs()
    n = Notifier(["webhook"], hook.url, None, logs, retries=4, **FAST)
    n.send(make_alert())
    assert n.flush(5)
    assert len(hook.requests) == 1
    assert logs == [
        f"alert webhook to http://127.0.0.1:{hook.port}/*** failed after 1 attempt: HTTP 404 Not Found"
    ]


def test_webhook_closed_port_never_raises_and_hides_secret() -> None:
    port = free_port()
    logs = Logs()
    n = Notifier(
        ["log", "webhook"], f"http://127.0.0.1:{port}/T0SECRET/B0SECRET", None, logs, retries=1, **FAST
    )
    n.send(make_alert())
    n.send(make_alert(step=41))
    assert n.flush(5)
    n.close()
    failures = [line for line in logs if "failed" in line]
    assert len(failures) == 2
    assert failures[0].startswith(f"alert webhook to http://127.0.0.1:{port}/*** failed after 2 attempts: ")
    assert "refused" in failures[0].lower()
    assert "SECRET" not in logs.text()


def test_webhook_timeout_is_retried(hook_factory) -> None:
    hook = hook_factory([200], hold=True)  # never answers within the timeout
    logs = Logs()
    n = Notifier(["webhook"], hook.url, None, logs, retries=1, backoff_s=0.01, timeout_s=0.2)
    n.send(make_alert())
    assert n.flush(5)
    assert len(hook.requests) == 2
    assert len(logs) == 1 and "failed after 2 attempts: timed out" in logs[0]
    assert "SECRET" not in logs.text()


def test_webhook_userinfo_becomes_basic_auth_and_is_never_shown(hook_factory) -> None:
    hook = hook_factory([200])
    url = f"http://bot:PWSECRET@127.0.0.1:{hook.port}/T0SECRET"
    logs = Logs()
    n = Notifier(["webhook"], url, None, logs, **FAST)
    n.send(make_alert())
    assert n.flush(5)
    (req,) = hook.requests
    assert req["headers"]["Authorization"] == "Basic " + base64.b64encode(b"bot:PWSECRET").decode()
    assert "SECRET" not in repr(n)
    assert f"http://127.0.0.1:{hook.port}/***" in repr(n)


def test_log_only_needs_no_thread() -> None:
    logs = Logs()
    n = Notifier(["log"], None, None, logs)
    n.send(make_alert(action="stop", rule="nan", step=7, message="loss is NaN"))
    assert logs == ["alert nan at step 7: loss is NaN -> stop"]
    assert n.flush(0)
    n.close()
    n.close()  # idempotent


def test_send_after_close_reaches_log_only(hook_factory) -> None:
    hook = hook_factory([200])
    logs = Logs()
    n = Notifier(["log", "webhook"], hook.url, None, logs, **FAST)
    n.close()
    n.send(make_alert())
    assert n.flush(1)
    assert hook.requests == []
    assert logs[0].startswith("alert plateau at step 40")
    assert "notifier closed" in logs[1]


@pytest.mark.parametrize(
    ("channels", "url", "mail", "needle"),
    [
        (["log", "pager"], None, None, "unknown alert channel"),
        (["webhook"], None, None, "TESSEL_WEBHOOK_URL"),
        (["email"], None, None, "smtp_host"),
        (["email"], None, EmailSettings("smtp", 25, "a@b", [], None, None, False), "email_to"),
        (["webhook"], "ftp://h/T0SECRET", None, "must start with http"),
    ],
)
def test_config_errors_are_one_line(channels, url, mail, needle) -> None:
    with pytest.raises(TesselError) as e:
        Notifier(channels, url, mail, print)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert "SECRET" not in str(e.value)


# -- e-mail --------------------------------------------------------------------------------


class FakeSMTP:
    """The smallest SMTP server smtplib will talk to. `greetings` are the first reply of each
    connection in turn (the last repeats); `auth_reply` answers AUTH."""

    def __init__(self, greetings: list[str] | None = None, auth_reply: str = "235 ok"):
        self.greetings = list(greetings or ["220 fake ESMTP"])
        self.auth_reply = auth_reply
        self.messages: list[bytes] = []
        self.auth: list[str] = []
        self.connections = 0
        fake = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                fake.connections += 1
                greeting = fake.greetings.pop(0) if len(fake.greetings) > 1 else fake.greetings[0]
                self.reply(greeting)
                if not greeting.startswith("220"):
                    return
                while line := self.rfile.readline():
                    cmd = line.decode().strip()
                    verb = cmd.split(" ", 1)[0].upper()
                    if verb in ("EHLO", "HELO"):
                        self.reply("250-fake\r\n250 AUTH PLAIN")
                    elif verb == "AUTH":
                        fake.auth.append(cmd)
                        self.reply(fake.auth_reply)
                    elif verb in ("MAIL", "RCPT", "RSET", "NOOP"):
                        self.reply("250 ok")
                    elif verb == "DATA":
                        self.reply("354 go on")
                        data = b""
                        while not data.endswith(b"\r\n.\r\n"):
                            data += self.rfile.readline()
                        fake.messages.append(data[: -len(b".\r\n")])
                        self.reply("250 queued")
                    elif verb == "QUIT":
                        self.reply("221 bye")
                        return
                    else:
                        self.reply("502 not implemented")

            def reply(self, text: str) -> None:
                self.wfile.write(text.encode() + b"\r\n")

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def settings(self, **kw) -> EmailSettings:
        base = dict(
            host="127.0.0.1",
            port=self.port,
            sender="tessel@example.com",
            to=["a@example.com", "b@example.com"],
            user="bot",
            password="PWSECRET",
            starttls=False,
        )
        base.update(kw)
        return EmailSettings(**base)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def smtp_factory() -> Iterator:
    servers: list[FakeSMTP] = []

    def make(**kw) -> FakeSMTP:
        servers.append(FakeSMTP(**kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def test_email_is_delivered_with_subject_and_body(smtp_factory) -> None:
    smtp = smtp_factory()
    logs = Logs()
    n = Notifier(["email"], None, smtp.settings(), logs, **FAST)
    n.send(make_alert())
    assert n.flush(5)
    assert logs == []
    (raw,) = smtp.messages
    msg = email.message_from_bytes(raw, policy=email.policy.default)
    assert msg["Subject"] == "[tessel] plateau at step 40: runs/exp1"
    assert msg["From"] == "tessel@example.com"
    assert msg["To"] == "a@example.com, b@example.com"
    body = msg.get_content()
    assert "has not improved" in body and "pause" in body and "val_loss: 2.5" in body
    # AUTH PLAIN carried the password to the server, which is the only place it may go.
    (auth,) = smtp.auth
    assert base64.b64decode(auth.split()[2]) == b"\0bot\0PWSECRET"


def test_email_retries_a_busy_server(smtp_factory) -> None:
    smtp = smtp_factory(greetings=["421 busy, try later", "220 fake ESMTP"])
    logs = Logs()
    n = Notifier(["email"], None, smtp.settings(), logs, **FAST)
    n.send(make_alert())
    assert n.flush(5)
    assert smtp.connections == 2 and len(smtp.messages) == 1 and logs == []


def test_email_auth_failure_is_not_retried_and_password_never_logged(smtp_factory) -> None:
    # A server that (unwisely) echoes the password in its error must not leak it via our log.
    smtp = smtp_factory(auth_reply="535 5.7.8 bad credentials for bot:PWSECRET")
    logs = Logs()
    settings = smtp.settings()
    n = Notifier(["log", "email"], None, settings, logs, retries=3, **FAST)
    n.send(make_alert())
    assert n.flush(5)
    assert smtp.connections == 1
    assert logs[1].startswith(f"alert email to 127.0.0.1:{smtp.port} failed after 1 attempt: SMTP 535")
    assert "SECRET" not in logs.text()
    assert "SECRET" not in repr(settings) and "password='***'" in repr(settings)
    assert "SECRET" not in repr(n)


def test_email_starttls_unsupported_is_reported(smtp_factory) -> None:
    smtp = smtp_factory()
    logs = Logs()
    n = Notifier(["email"], None, smtp.settings(starttls=True), logs, retries=3, **FAST)
    n.send(make_alert())
    assert n.flush(5)
    assert len(logs) == 1 and "failed after 1 attempt: SMTPNotSupportedError" in logs[0]
    assert smtp.messages == []


def test_email_closed_port_fails_after_retries() -> None:
    port = free_port()
    logs = Logs()
    settings = EmailSettings("127.0.0.1", port, "t@x", ["a@x"], "bot", "PWSECRET", False)
    n = Notifier(["email"], None, settings, logs, retries=2, **FAST)
    t0 = time.monotonic()
    n.send(make_alert())
    assert time.monotonic() - t0 < 0.5  # the caller never waits for SMTP
    assert n.flush(5)
    assert len(logs) == 1 and f"127.0.0.1:{port} failed after 3 attempts" in logs[0]
    assert "SECRET" not in logs.text()


# -- env: references ------------------------------------------------------------------------


def test_resolve_secret_reads_env_references(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSEL_TEST_HOOK", "https://hooks.example.com/T0SECRET")
    assert resolve_secret("env:TESSEL_TEST_HOOK") == "https://hooks.example.com/T0SECRET"
    assert resolve_secret(" env:TESSEL_TEST_HOOK ") == "https://hooks.example.com/T0SECRET"
    # Anything that is not exactly env:NAME is the value itself.
    for value in ("https://h/x", "env:", "env:1BAD", "ENV:TESSEL_TEST_HOOK", "xenv:A"):
        assert resolve_secret(value) == value


@pytest.mark.parametrize("value", [None, "", "  "])
def test_resolve_secret_unset_variable_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch,
                                                             value: str | None) -> None:
    if value is None:
        monkeypatch.delenv("TESSEL_TEST_HOOK", raising=False)
    else:
        monkeypatch.setenv("TESSEL_TEST_HOOK", value)
    with pytest.raises(TesselError) as e:
        resolve_secret("env:TESSEL_TEST_HOOK", "alert 'plateau' webhook_url")
    msg = str(e.value)
    assert msg.startswith("alert 'plateau' webhook_url = 'env:TESSEL_TEST_HOOK' but the environment "
                          "variable TESSEL_TEST_HOOK is ")
    assert ("not set" if value is None else "empty") in msg
    assert "export TESSEL_TEST_HOOK" in msg and "\n" not in msg


def test_notifier_delivers_to_an_env_webhook_and_never_shows_it(hook_factory, monkeypatch) -> None:
    hook = hook_factory([500])
    monkeypatch.setenv("TESSEL_TEST_HOOK", hook.url)
    logs = Logs()
    n = Notifier(["webhook"], "env:TESSEL_TEST_HOOK", None, logs, retries=0, **FAST)
    n.send(make_alert())
    assert n.flush(5)
    (req,) = hook.requests  # the URL from the environment was used
    assert req["path"] == "/T0SECRET/B0SECRET?token=QSECRET"
    assert logs == [f"alert webhook to http://127.0.0.1:{hook.port}/*** failed after 1 attempt: "
                    "HTTP 500 Internal Server Error"]
    assert "SECRET" not in repr(n)


def test_notifier_refuses_an_unset_env_webhook_but_only_when_used(monkeypatch) -> None:
    monkeypatch.delenv("TESSEL_TEST_HOOK", raising=False)
    with pytest.raises(TesselError, match="TESSEL_TEST_HOOK is not set"):
        Notifier(["webhook"], "env:TESSEL_TEST_HOOK", None, print)
    mail = EmailSettings("smtp", 25, "a@b", ["c@d"], "env:TESSEL_TEST_USER", "env:TESSEL_TEST_PW", False)
    with pytest.raises(TesselError, match="notify.smtp_user = 'env:TESSEL_TEST_USER'"):
        Notifier(["email"], None, mail, print)
    # A rule that only logs needs neither variable.
    Notifier(["log"], "env:TESSEL_TEST_HOOK", mail, print).close()


def test_email_login_from_env_references(smtp_factory, monkeypatch) -> None:
    smtp = smtp_factory()
    monkeypatch.setenv("TESSEL_TEST_USER", "bot")
    monkeypatch.setenv("TESSEL_TEST_PW", "PWSECRET")
    settings = smtp.settings(user="env:TESSEL_TEST_USER", password="env:TESSEL_TEST_PW")
    logs = Logs()
    n = Notifier(["email"], None, settings, logs, **FAST)
    n.send(make_alert())
    assert n.flush(5)
    assert logs == [] and len(smtp.messages) == 1
    (auth,) = smtp.auth  # the values from the environment reached the server
    assert base64.b64decode(auth.split()[2]) == b"\0bot\0PWSECRET"
    assert "user='bot'" in repr(n) and "SECRET" not in repr(n)


def test_check_alerts_refuses_an_unset_env_reference_before_the_run(monkeypatch) -> None:
    from tessel.config import AlertConfig, NotifyConfig
    from tessel.observe.alerts import check_alerts

    monkeypatch.delenv("TESSEL_TEST_HOOK", raising=False)
    rule = AlertConfig(name="plateau", when="nan", notify=["webhook"], webhook_url="env:TESSEL_TEST_HOOK")
    with pytest.raises(TesselError) as e:
        check_alerts([rule], NotifyConfig())
    assert str(e.value).startswith("alert 'plateau' webhook_url = 'env:TESSEL_TEST_HOOK' but the "
                                   "environment variable TESSEL_TEST_HOOK is not set")
    monkeypatch.setenv("TESSEL_TEST_HOOK", "https://hooks.example.com/T0SECRET")
    check_alerts([rule], NotifyConfig())
