"""What a secret is, and how tessel hides one: the one place that knows.

Everything tessel prints or copies that could carry a credential goes through here: the
resolved config (`tessel config`, the copies in checkpoints' state.json and run.json, the
W&B run config), alert delivery's log lines and repr()s, and `tessel report`'s page.

A config value is a secret when its key, or the key of any table or array it sits in,
names a credential (`is_secret_key`: webhook_url, smtp_password, api_key, hf_token, ..., but
not a tokenizer setting such as data.eod_token). Only strings are
hidden: a number under such a key (webhook_timeout_s = 10) is not a credential. A secret's
stand-in keeps what a reader needs to recognise it and nothing that would let them use it:
a URL keeps its scheme, host and port (webhook services put the credential in the path or
query), anything else becomes "***". An `env:NAME` reference is not a secret, it says where
the secret is kept, so it is shown as it is. Outside secret keys, a URL's user info
(https://user:password@host/) is hidden wherever it appears.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# Keys whose string values are credentials: webhook_url, smtp_password, api_key,
# client_secret, ... (and the token keys below).
SECRET_KEY = re.compile(r"password|passwd|secret|webhook|api_?key|credential", re.IGNORECASE)
# A key with the word "token" (hf_token, access_token, authToken, apitoken, token_url, token)
# names a credential, unless the word before it is a special token's role or the word after
# it a property of a vocabulary entry: eod_token, pad_token, bos_token, token_id are tokenizer
# settings, useful to see and copy. "tokens" (max_new_tokens, tokens_per_step), "tokenizer"
# and "tokenize" are other words. Unknown token keys count as credentials: hiding a setting
# costs less than showing a credential.
_TOKEN_ROLES = frozenset({"bos", "eos", "eod", "eot", "pad", "unk", "sep", "cls", "mask",
                          "special", "stop", "start", "end", "begin", "fim"})
_TOKEN_PROPERTIES = frozenset({"id", "ids", "index", "type"})
# The words of a key: split at anything but letters and digits, and before a capital that
# follows a lower-case letter or digit (camelCase).
_KEY_WORD = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")
STAND_IN = "***"
# `env:NAME`: the value is read from the environment variable NAME when it is used.
ENV_REF = re.compile(r"env:([A-Za-z_][A-Za-z0-9_]*)")

# A URL's user info (`user:password@` or a token as user, `TOKEN@`), after its scheme.
_USERINFO = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.\-]*://)[^/\s@\"'<>]+@")
# One `key = value` line of TOML (bare, quoted and dotted keys).
_TOML_KEY_LINE = re.compile(r"^(\s*)((?:[A-Za-z0-9_\-]+|\"[^\"]*\"|'[^']*')"
                            r"(?:\s*\.\s*(?:[A-Za-z0-9_\-]+|\"[^\"]*\"|'[^']*'))*)(\s*=\s*)(.*)$")


def is_secret_key(key: Any) -> bool:
    """Whether values under config key `key` are secrets (a dotted key, `data.eod_token`, is
    judged by its words as a whole)."""
    text = str(key)
    if SECRET_KEY.search(text):
        return True
    words: list[str] = []
    for word in _KEY_WORD.findall(text):
        word = word.lower()
        # one word run together with "token" (apitoken, eodtoken) is two
        words += [word[:-5], "token"] if word.endswith("token") and word != "token" else [word]
    for i, word in enumerate(words):
        before = words[i - 1] if i > 0 else ""
        after = words[i + 1] if i + 1 < len(words) else ""
        if word == "token" and before not in _TOKEN_ROLES and after not in _TOKEN_PROPERTIES:
            return True
    return False


def env_ref(value: Any) -> str | None:
    """NAME when `value` is an `env:NAME` reference, else None."""
    if not isinstance(value, str):
        return None
    m = ENV_REF.fullmatch(value.strip())
    return m.group(1) if m else None


def redact_value(value: str) -> str:
    """A secret's stand-in: "https://hooks.example.com/T0/B0" -> "https://hooks.example.com/***"
    (scheme, host and port kept; user info, path, query and fragment dropped); anything that
    is not such a URL -> "***"; an `env:NAME` reference is returned as it is."""
    if env_ref(value) is not None:
        return value.strip()
    try:
        parts = urlsplit(value.strip())
        host = parts.hostname
        port = parts.port  # raises ValueError on a malformed port
    except ValueError:
        return STAND_IN
    if not parts.scheme or not host:
        return STAND_IN
    if ":" in host:  # an IPv6 literal: urlsplit strips its brackets
        host = f"[{host}]"
    return f"{parts.scheme}://{host if port is None else f'{host}:{port}'}/{STAND_IN}"


def hide_userinfo(text: str) -> str:
    """`text` with every URL's user info replaced: "https://bot:pw@host/x" -> "https://***@host/x"."""
    return _USERINFO.sub(rf"\1{STAND_IN}@", text)


def secret_strings(tree: Any, secret: bool = False) -> set[str]:
    """Every non-empty string in `tree` (a parsed config: dicts, lists, scalars) under a key
    that names a secret; with `secret=True`, every string in it. `env:NAME` references are
    not secrets and are left out."""
    found: set[str] = set()
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            found |= secret_strings(value, secret or is_secret_key(key))
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            found |= secret_strings(value, secret)
    elif isinstance(tree, str) and secret and tree.strip() and env_ref(tree) is None:
        found.add(tree)
    return found


def redact_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `config` (a config as a dict, e.g. `Config.to_dict()`) fit to print or to
    store beside the run: every string under a secret key, through nested tables and arrays,
    replaced by its stand-in (`redact_value`), and user info hidden in every other string.
    Everything else (numbers, booleans, None, other strings, the structure) is unchanged;
    `config` itself is not modified."""
    return {k: _redact_tree(v, is_secret_key(k)) for k, v in config.items()}


def _redact_tree(value: Any, secret: bool) -> Any:
    if isinstance(value, Mapping):
        return {k: _redact_tree(v, secret or is_secret_key(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_redact_tree(v, secret) for v in value)
    if isinstance(value, str):
        return redact_value(value) if secret and value.strip() else hide_userinfo(value)
    return value


def _url_parts(url: str) -> dict[str, str]:
    """The pieces of a secret URL that may turn up in text on their own (an HTTP library's
    error message, a request line), each with its stand-in: the URL with and without its
    user info, its path+query (as written and as urllib quotes it), the user info and the
    password."""
    shown = redact_value(url)
    parts = {url: shown}
    try:
        p = urlsplit(url)
    except ValueError:
        return parts
    if "@" in p.netloc:
        userinfo, hostport = p.netloc.rsplit("@", 1)
        parts[urlunsplit((p.scheme, hostport, p.path, p.query, p.fragment))] = shown
        parts[userinfo] = STAND_IN
        if p.password:
            parts[p.password] = STAND_IN
    tail = urlunsplit(("", "", p.path, p.query, p.fragment))
    if p.scheme and p.hostname and tail not in ("", "/"):
        parts[tail] = STAND_IN
        parts[quote(tail, safe="/?=&")] = STAND_IN
    return parts


class Redactor:
    """Hides known secret values, and every URL's user info, wherever they appear in text."""

    def __init__(self, secrets: Iterable[str] = ()):
        """`secrets`: the secret values (a URL's parts are hidden on their own too)."""
        shown: dict[str, str] = {}
        for s in secrets:
            if s and s.strip():
                shown.update({k: v for k, v in _url_parts(s).items() if k and k not in shown})
        # Longest first, so a secret that contains another is replaced whole.
        ordered = sorted(shown, key=len, reverse=True)
        self._shown = shown
        self._pattern = re.compile("|".join(map(re.escape, ordered))) if ordered else None

    @classmethod
    def for_config(cls, config: Mapping[str, Any] | None, config_text: str | None = None) -> Redactor:
        """A Redactor for the secrets of a config: `config` parsed, and/or `config_text`, the
        TOML whose `key = value` lines are read too, so secrets stay hidden when it does not
        parse."""
        found = secret_strings(config or {})
        for line in (config_text or "").splitlines():
            m = _TOML_KEY_LINE.match(line)
            if m and is_secret_key(m.group(2)):
                try:
                    found |= secret_strings(tomllib.loads(f"v = {m.group(4)}")["v"], secret=True)
                except tomllib.TOMLDecodeError:
                    pass
        return cls(found)

    def text(self, text: str) -> str:
        """Any text: known secret values replaced by their stand-ins, user info in URLs hidden."""
        if self._pattern is not None:
            text = self._pattern.sub(lambda m: self._shown[m.group(0)], text)
        return hide_userinfo(text)

    def toml(self, text: str) -> str:
        """A config's TOML text: as `text`, and every `key = value` line whose key names a
        secret has its string value(s) replaced, also when the file does not parse."""
        lines = []
        for line in self.text(text).splitlines():
            m = _TOML_KEY_LINE.match(line)
            if m and is_secret_key(m.group(2)):
                line = m.group(1) + m.group(2) + m.group(3) + _redact_toml_value(m.group(4))
            lines.append(line)
        return "\n".join(lines) + ("\n" if text.endswith("\n") else "")


def _redact_toml_value(raw: str) -> str:
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        # A multi-line string or something unparsable: hide it unless it is clearly not text.
        return raw if re.fullmatch(r"\s*[-+0-9.eE_]+\s*(#.*)?|\s*(true|false)\s*(#.*)?", raw) \
            else json.dumps(STAND_IN)
    if isinstance(value, str):
        return json.dumps(redact_value(value)) if value.strip() else raw
    if isinstance(value, (list, dict)) and secret_strings(value, secret=True):
        return json.dumps(STAND_IN)
    return raw
