"""Alert delivery: the run's log, a webhook (JSON POST) and e-mail.

Deciding *whether* an alert fires is the alert rules' job; this module only delivers one.
Delivery to the network happens on a background daemon thread, so a slow or dead webhook or
SMTP server never blocks or breaks a training step: failures are retried with exponential
backoff and finally reported as one log line.

Secrets (the webhook URL's path and query, which on Slack/Teams/Discord *is* the
credential, and the SMTP password) never appear in a log line or a repr: every message that
could carry them passes through `tessel.observe.secrets.Redactor` first.

A webhook URL or SMTP login given as `env:NAME` is read from the environment variable NAME
when the Notifier is built (`resolve_secret`), so config.toml, and every copy of it, need
never hold the credential itself.
"""

from __future__ import annotations

import base64
import json
import math
import os
import queue
import smtplib
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from email.message import EmailMessage
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from tessel.errors import TesselError
from tessel.observe.secrets import Redactor, env_ref, redact_value

CHANNELS = ("log", "webhook", "email")
# Pending deliveries per channel; beyond this an alert storm against a dead endpoint would
# only grow memory, so further alerts are dropped (with a log line) until the queue drains.
_QUEUE_LIMIT = 256


@dataclass
class Alert:
    """One alert that fired."""

    run: str
    """Run directory path as a string."""
    rule: str
    """The rule's name, e.g. "plateau"."""
    when: str
    """The condition, e.g. "val_loss.no_improvement"."""
    step: int
    values: dict[str, float | None]
    """The numbers that triggered it (NaN/Inf allowed; they are sent as strings)."""
    message: str
    """One human-readable line."""
    action: str
    """What the run does next: "continue", "pause" or "stop"."""


@dataclass
class EmailSettings:
    """Where and how to send alert e-mails. `password` is never shown by repr()."""

    host: str
    port: int
    sender: str
    to: list[str]
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    starttls: bool = True

    def __repr__(self) -> str:
        # Hand-written rather than the dataclass one so the password's *presence* stays
        # visible (useful when debugging a login failure) while its value never is.
        pw = None if self.password is None else "***"
        return (
            f"EmailSettings(host={self.host!r}, port={self.port}, sender={self.sender!r}, "
            f"to={self.to!r}, user={self.user!r}, password={pw!r}, starttls={self.starttls})"
        )


def resolve_secret(value: str, what: str = "a secret") -> str:
    """`value` itself, or for an `env:NAME` reference the environment variable NAME's value.
    An unset (or empty) variable is a TesselError naming it; `what` says which setting
    asked for it, e.g. "alert 'plateau' webhook_url"."""
    name = env_ref(value)
    if name is None:
        return value
    resolved = os.environ.get(name, "")
    if not resolved.strip():
        raise TesselError(
            f"{what} = {value.strip()!r} but the environment variable {name} is "
            f"{'empty' if name in os.environ else 'not set'}; export {name} on every node "
            "that runs the job"
        )
    return resolved


def alert_payload(alert: Alert) -> dict[str, Any]:
    """The webhook's JSON body: the alert's fields plus `text`, a one-line summary that Slack
    (and Mattermost, Discord via /slack, ...) display as the message."""
    return {
        "run": alert.run,
        "rule": alert.rule,
        "when": alert.when,
        "step": int(alert.step),
        "values": {str(k): _json_number(v) for k, v in alert.values.items()},
        "message": alert.message,
        "action": alert.action,
        "text": f"[tessel] {alert.rule} at step {alert.step} ({alert.when}) in {alert.run}: "
        f"{alert.message} -> {alert.action}",
    }


def _json_number(v: Any) -> Any:
    # JSON has no NaN/Inf; strings keep the distinction (as metrics.jsonl does) and keep the
    # body valid for strict parsers.
    if v is None or isinstance(v, (bool, str)):
        return v
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    if not math.isfinite(f):
        return str(f)
    return int(v) if isinstance(v, int) else f


def log_line(alert: Alert) -> str:
    """The alert as one log line: `alert plateau at step 40: <message> -> pause`."""
    return f"alert {alert.rule} at step {alert.step}: {alert.message} -> {alert.action}"


class _Permanent(Exception):
    """A delivery failure that retrying cannot fix (HTTP 4xx, SMTP 5xx, bad certificate)."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    # urllib turns a redirected POST into a GET without the body, which would "succeed"
    # without delivering anything; a redirect is reported as a failure instead.
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


class Notifier:
    """Delivers alerts to the configured channels.

    `channels` is a subset of {"log", "webhook", "email"}. "log" is synchronous (`log(line)`
    inside `send`); "webhook" and "email" go on one background daemon thread per channel, so
    `send` returns at once and a failing endpoint cannot block training. Each delivery makes
    up to `1 + retries` attempts, sleeping `backoff_s * 2**i` between them; connection errors,
    timeouts, HTTP 5xx/429 and SMTP 4xx are retried, other failures are not. A delivery that
    finally fails is reported as one `log` line; nothing is ever raised into the caller.
    """

    def __init__(
        self,
        channels: list[str],
        webhook_url: str | None,
        email: EmailSettings | None,
        log: Callable[[str], None],
        retries: int = 4,
        backoff_s: float = 0.5,
        timeout_s: float = 5.0,
    ):
        unknown = sorted(set(channels) - set(CHANNELS))
        if unknown:
            raise TesselError(f"unknown alert channel(s) {unknown}; choose from {list(CHANNELS)}")
        # `env:NAME` values are read now: a missing variable fails before training starts,
        # not at the first alert. Only for channels in use (one [notify] serves every rule).
        if "webhook" in channels and webhook_url:
            webhook_url = resolve_secret(webhook_url, "webhook_url")
        if "email" in channels and email is not None:
            user, password = email.user, email.password
            email = replace(email, user=user and resolve_secret(user, "notify.smtp_user"),
                            password=password and resolve_secret(password, "the SMTP password"))
        if "webhook" in channels and not webhook_url:
            raise TesselError(
                "alert channel 'webhook' needs a URL: set webhook_url in the [[alerts]] rule "
                "or the TESSEL_WEBHOOK_URL environment variable"
            )
        if webhook_url and env_ref(webhook_url) is None and _scheme(webhook_url) not in ("http", "https"):
            raise TesselError(f"webhook URL {redact_value(webhook_url)} must start with http:// or https://")
        if "email" in channels and (email is None or not email.host or not email.to):
            raise TesselError(
                "alert channel 'email' needs [notify] smtp_host and email_to (at least one recipient)"
            )
        self.channels = list(dict.fromkeys(channels))
        self._log = log
        self._retries = max(int(retries), 0)
        self._backoff_s = backoff_s
        self._timeout_s = timeout_s
        self._email = email
        self._webhook_url = webhook_url
        secrets: list[str] = []
        if webhook_url:
            self._webhook_shown = redact_value(webhook_url)
            self._webhook_request_url, self._webhook_auth = _split_userinfo(webhook_url)
            secrets.append(webhook_url)  # the Redactor hides its path, user info, password too
        if email is not None and email.password:
            secrets.append(email.password)
        self._redact = Redactor(secrets)

        # Outstanding deliveries (queued or in progress), for flush().
        self._pending = 0
        self._cond = threading.Condition()
        self._closed = False
        self._queues: dict[str, queue.Queue[Alert | None]] = {}
        self._threads: list[threading.Thread] = []
        for ch in ("webhook", "email"):
            if ch in self.channels:
                q: queue.Queue[Alert | None] = queue.Queue(maxsize=_QUEUE_LIMIT)
                # Daemon: a hung endpoint must not keep a finished (or crashed) run's process
                # alive. flush() is how a caller waits for deliveries that matter.
                t = threading.Thread(
                    target=self._worker, args=(ch, q), name=f"tessel-notify-{ch}", daemon=True
                )
                t.start()
                self._queues[ch] = q
                self._threads.append(t)

    def __repr__(self) -> str:
        url = self._webhook_shown if self._webhook_url else None
        return f"Notifier(channels={self.channels!r}, webhook_url={url!r}, email={self._email!r})"

    # -- caller side -------------------------------------------------------------------------

    def send(self, alert: Alert) -> None:
        """Deliver `alert` to every channel. Writes the log line now; queues network
        deliveries and returns without waiting for them."""
        if "log" in self.channels:
            self._log(log_line(alert))
        for ch, q in self._queues.items():
            problem = None
            with self._cond:
                if self._closed:
                    problem = "notifier closed"
                else:
                    try:
                        q.put_nowait(alert)
                        self._pending += 1
                    except queue.Full:
                        problem = f"{_QUEUE_LIMIT} deliveries already pending"
            if problem:  # logged outside the lock: the callback may be slow
                self._safe_log(f"alert {ch} for {alert.rule} at step {alert.step} not sent: {problem}")

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait up to `timeout_s` for every queued delivery to finish (delivered or given up).
        True if none is left; call before a pause/stop exit so the alert is not lost with the
        daemon thread."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        """Wait up to `timeout_s` for pending deliveries (as `flush`), then stop the worker
        threads. Alerts sent afterwards reach only the log channel. Idempotent."""
        self.flush(timeout_s)
        with self._cond:
            if self._closed:
                return
            self._closed = True
        for q in self._queues.values():
            try:
                q.put_nowait(None)  # sentinel; a full queue means the worker is stuck anyway
            except queue.Full:
                pass
        for t in self._threads:
            t.join(timeout=0.1)

    # -- worker side -------------------------------------------------------------------------

    def _worker(self, channel: str, q: queue.Queue[Alert | None]) -> None:
        deliver = self._post_webhook if channel == "webhook" else self._send_email
        target = self._webhook_shown if channel == "webhook" else self._email_shown()
        while True:
            alert = q.get()
            if alert is None:
                return
            try:
                self._with_retries(channel, target, deliver, alert)
            except BaseException as e:  # the worker must survive anything
                self._safe_log(f"alert {channel} to {target} failed: {self._describe(e)}")
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    def _with_retries(
        self, channel: str, target: str, deliver: Callable[[Alert], None], alert: Alert
    ) -> None:
        attempts = 1 + self._retries
        for i in range(attempts):
            try:
                deliver(alert)
                return
            except _Permanent as e:
                self._give_up(channel, target, i + 1, str(e))
                return
            except Exception as e:  # transient (connection, timeout, 5xx): try again
                if i + 1 == attempts:
                    self._give_up(channel, target, attempts, self._describe(e))
                    return
            time.sleep(self._backoff_s * 2**i)

    def _give_up(self, channel: str, target: str, n: int, reason: str) -> None:
        plural = "" if n == 1 else "s"
        self._safe_log(
            f"alert {channel} to {target} failed after {n} attempt{plural}: {self._redact.text(reason)}"
        )

    def _safe_log(self, line: str) -> None:
        # Runs on the worker thread: a raising log callback must not kill delivery.
        try:
            self._log(self._redact.text(line))
        except Exception:
            pass

    def _describe(self, e: BaseException) -> str:
        """A one-line reason for `e` with secrets removed. Built from the exception's parts
        rather than its repr: urllib errors may carry the full URL."""
        if isinstance(e, urllib.error.HTTPError):
            text = f"HTTP {e.code} {e.reason}"
        elif isinstance(e, urllib.error.URLError):
            text = str(e.reason)
        elif isinstance(e, (socket.timeout, TimeoutError)):
            text = f"timed out after {self._timeout_s:g} s"
        else:
            text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return self._redact.text(" ".join(text.split()))

    # -- webhook -----------------------------------------------------------------------------

    def _post_webhook(self, alert: Alert) -> None:
        body = json.dumps(alert_payload(alert), allow_nan=False).encode()
        headers = {"Content-Type": "application/json", "User-Agent": "tessel"}
        if self._webhook_auth:
            headers["Authorization"] = self._webhook_auth
        req = urllib.request.Request(self._webhook_request_url, data=body, headers=headers, method="POST")
        opener = urllib.request.build_opener(_NoRedirect)
        try:
            with opener.open(req, timeout=self._timeout_s) as resp:
                resp.read()
        except urllib.error.HTTPError as e:
            e.close()
            if e.code >= 500 or e.code == 429:
                raise  # transient: retried
            raise _Permanent(f"HTTP {e.code} {e.reason}") from None
        except ValueError as e:
            # A malformed URL (http.client.InvalidURL is a ValueError): retrying cannot help.
            # Anything else (URLError, timeouts, a dropped connection) is retried.
            raise _Permanent(self._describe(e)) from None

    # -- email -------------------------------------------------------------------------------

    def _email_shown(self) -> str:
        assert self._email is not None
        return f"{self._email.host}:{self._email.port}"

    def _send_email(self, alert: Alert) -> None:
        s = self._email
        assert s is not None
        msg = email_message(alert, s)
        try:
            smtp = smtplib.SMTP(s.host, s.port, timeout=self._timeout_s)
            try:
                if s.starttls:
                    smtp.starttls(context=ssl.create_default_context())
                if s.user:
                    smtp.login(s.user, s.password or "")
                smtp.send_message(msg)
            finally:
                # Not `with SMTP(...)`: its __exit__ raises when QUIT gets an odd reply, and a
                # retry after an accepted message would send the e-mail twice.
                try:
                    smtp.quit()
                except (smtplib.SMTPException, OSError):
                    smtp.close()
        except smtplib.SMTPServerDisconnected:
            raise  # transient
        except smtplib.SMTPResponseException as e:
            text = f"SMTP {e.smtp_code} {_decode(e.smtp_error)}"
            if 400 <= e.smtp_code < 500:
                raise ConnectionError(text) from None  # 4xx: try again later
            raise _Permanent(text) from None
        except (smtplib.SMTPRecipientsRefused, smtplib.SMTPNotSupportedError) as e:
            raise _Permanent(f"{type(e).__name__}: {e}") from None
        except ssl.SSLCertVerificationError as e:
            raise _Permanent(f"TLS certificate: {e.verify_message}") from None


def email_message(alert: Alert, s: EmailSettings) -> EmailMessage:
    """The alert as an e-mail: subject `[tessel] <rule> at step <step>: <run>`, and a plain
    text body with the message, action, condition and values."""
    msg = EmailMessage()
    subject = f"[tessel] {alert.rule} at step {alert.step}: {alert.run}"
    msg["Subject"] = " ".join(subject.split())  # a header cannot hold a newline
    msg["From"] = s.sender
    msg["To"] = ", ".join(s.to)
    lines = [
        alert.message,
        "",
        f"run:       {alert.run}",
        f"rule:      {alert.rule} ({alert.when})",
        f"step:      {alert.step}",
        f"action:    {alert.action}",
    ]
    lines += [f"{k}: {_json_number(v)}" for k, v in alert.values.items()]
    msg.set_content("\n".join(lines) + "\n")
    return msg


def _decode(b: bytes | str) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else str(b)


def _split_userinfo(url: str) -> tuple[str, str | None]:
    """(url without user info, Basic Authorization header or None): urllib cannot send
    `https://user:pw@host/...` itself, and would put the password in its error message."""
    try:
        p = urlsplit(url)
    except ValueError:
        return url, None
    if "@" not in p.netloc:
        return url, None
    userinfo, hostport = p.netloc.rsplit("@", 1)
    user, _, pw = userinfo.partition(":")
    token = base64.b64encode(f"{unquote(user)}:{unquote(pw)}".encode()).decode()
    return urlunsplit((p.scheme, hostport, p.path, p.query, p.fragment)), f"Basic {token}"


def _scheme(url: str) -> str:
    try:
        return urlsplit(url).scheme
    except ValueError:  # e.g. an unbalanced "[" in the host
        return ""
