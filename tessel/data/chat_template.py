"""Chat templates: a conversation rendered to the text a model was fine-tuned on.

A template is Jinja2 text, the model's own (`chat_template` in the `tokenizer_config.json` or
`chat_template.jinja` beside its `tokenizer.json`), one of the built-ins below, or a `.jinja`
file. It is rendered exactly as Hugging Face transformers renders it
(`PreTrainedTokenizerBase.apply_chat_template`), in the environment of
`tessel.data.template_sandbox`, with `messages`, `add_generation_prompt` and the special
tokens the tokenizer's `tokenizer_config.json` names (`SPECIAL_TOKENS`: `bos_token`,
`eos_token`, `pad_token`, ...) as variables, as transformers passes them. The sandbox
matters: a template comes from whoever published the model, and rendering it must neither run
their code nor take the machine (its limits).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessel.data import template_sandbox
from tessel.data.template_sandbox import TemplateFailure
from tessel.errors import DataError

BUILTIN_TEMPLATES: dict[str, str] = {
    # ChatML (Qwen, many others): <|im_start|>role\ncontent<|im_end|>\n per message.
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    # Prompt/completion with nothing around it: the prompt text, then the completion ended
    # by the end-of-sequence token (a system message, if any, comes first as plain text).
    "plain": (
        "{% for message in messages %}"
        "{{ message['content'] }}"
        "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
        "{% endfor %}"
    ),
}
"""Templates for models without their own (`data.chat_template = "chatml"` or `"plain"`)."""

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")
"""The special-token variables transformers passes to a chat template (its tokenizer's
`special_tokens_map`: each one its tokenizer_config.json names)."""


@dataclass(frozen=True)
class ChatTemplate:
    """A template's source, where it came from, and the special-token strings it sees."""

    source: str
    """The Jinja2 text."""
    origin: str
    """Where it came from, for messages ("chatml", "tokenizer_config.json", a path)."""
    bos_token: str = ""
    eos_token: str = ""
    others: tuple[tuple[str, str], ...] = ()
    """The other special tokens the tokenizer names (`unk_token`, `pad_token`, ... of
    `SPECIAL_TOKENS`), as (variable, text) pairs."""

    def tokens(self) -> dict[str, str]:
        """Every special-token variable the template sees, by name."""
        return {"bos_token": self.bos_token, "eos_token": self.eos_token, **dict(self.others)}

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """The text of `messages`; DataError (one line) when the template does not parse,
        fails, or goes past the limits of `tessel.data.template_sandbox` (time, size)."""
        variables = {**self.tokens(), "messages": messages, "tools": None, "documents": None,
                     "add_generation_prompt": add_generation_prompt}
        try:
            return template_sandbox.render(self.source, variables)
        except TemplateFailure as exc:
            what = "does not parse" if exc.parse else "failed to render"
            raise DataError(f"chat template ({self.origin}) {what}: {exc}") from None


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # {"content": "</s>", ...}, as tokenizer_config.json may write
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise DataError(f"{path}: cannot be read as JSON ({exc})") from None
    return data if isinstance(data, dict) else {}


def read_template_file(path: Path) -> str:
    """A `.jinja` file's text; DataError (one line) when it cannot be read or is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: a chat template must be UTF-8 text, and byte {exc.start} is "
                        f"not ({exc.reason}); save it as UTF-8") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot be read ({exc.strerror or exc})") from None


def model_template(directory: Path) -> str | None:
    """The model's own template from the tokenizer files in `directory`, or None.

    `chat_template.jinja` (transformers >= 4.50 writes it) wins over tokenizer_config.json's
    `chat_template`, read as transformers reads it: text, or named templates (a list of
    {"name", "template"} objects, or an object of name -> template) of which "default" is
    taken. Any other value is malformed, a DataError (transformers fails on it too).
    """
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return read_template_file(jinja_file)
    cfg_file = directory / "tokenizer_config.json"
    if not cfg_file.is_file():
        return None
    value = _read_json(cfg_file).get("chat_template")
    if value is None or value == "":
        return None
    return _configured_template(value, cfg_file)


def _configured_template(value: Any, where: Path) -> str:
    """tokenizer_config.json's `chat_template` value as transformers reads it (see
    `model_template`)."""
    if isinstance(value, str):
        return value
    fix = "fix the file, or name a template with data.chat_template (--chat-template)"
    named = None
    if isinstance(value, list) and all(isinstance(t, dict) and "name" in t and "template" in t
                                       for t in value):
        # later entries win, as in transformers' {t["name"]: t["template"] for t in value}
        named = {t["name"]: t["template"] for t in value if isinstance(t["name"], str)}
    elif isinstance(value, dict):
        named = value
    if named is None:
        shown = json.dumps(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise DataError(f"{where}: chat_template is malformed: {shown} is neither text nor a "
                        "list of {\"name\": ..., \"template\": ...} objects; " + fix)
    if "default" not in named:
        names = ", ".join(repr(n) for n in sorted(map(str, named))[:8])
        held = f"templates named {names} but none" if named else "an empty list of templates, no"
        raise DataError(f"{where}: chat_template is malformed: {held} \"default\", the one "
                        "transformers and tessel use; " + fix)
    template = named["default"]
    if not isinstance(template, str):
        raise DataError(f"{where}: chat_template is malformed: its \"default\" template is a "
                        f"{type(template).__name__}, not text; " + fix)
    return template


def special_tokens(directory: Path | None) -> dict[str, str]:
    """The special-token strings (`SPECIAL_TOKENS`) `directory`'s tokenizer_config.json names,
    by variable ({} without one)."""
    if directory is None or not (directory / "tokenizer_config.json").is_file():
        return {}
    cfg = _read_json(directory / "tokenizer_config.json")
    found = {key: _token_text(cfg.get(key)) for key in SPECIAL_TOKENS}
    return {key: text for key, text in found.items() if text}


def with_tokens(source: str, origin: str, tokens: dict[str, str],
                eos_fallback: str = "") -> ChatTemplate:
    """The template `source` seeing the special-token strings `tokens` (`special_tokens`);
    `eos_fallback` for `eos_token` when they name none."""
    others = tuple((key, tokens[key]) for key in SPECIAL_TOKENS
                   if key not in ("bos_token", "eos_token") and tokens.get(key))
    return ChatTemplate(source, origin, tokens.get("bos_token", ""),
                        tokens.get("eos_token", "") or eos_fallback, others)


def resolve_template(spec: str, tokenizer_dir: Path | None, eos_fallback: str = "") -> ChatTemplate:
    """The template `data.chat_template` names: "auto" (the model's own, found beside its
    tokenizer, else ChatML, said in the origin), a built-in name, or a `.jinja` file path.
    `eos_fallback`: the tokenizer's end-of-document token, for `eos_token` when no
    tokenizer_config.json names one."""
    tokens = special_tokens(tokenizer_dir)
    if spec == "auto":
        own = model_template(tokenizer_dir) if tokenizer_dir is not None else None
        if own is not None:
            return with_tokens(own, f"the model's own, {tokenizer_dir}", tokens, eos_fallback)
        return with_tokens(BUILTIN_TEMPLATES["chatml"], "chatml (the model has none)", tokens,
                           eos_fallback)
    if spec in BUILTIN_TEMPLATES:
        return with_tokens(BUILTIN_TEMPLATES[spec], spec, tokens, eos_fallback)
    path = Path(spec)
    if not path.is_file():
        raise DataError(f"data.chat_template={spec!r} is neither a built-in template "
                        f"({', '.join(BUILTIN_TEMPLATES)}), \"auto\", nor a .jinja file")
    return with_tokens(read_template_file(path), str(path), tokens, eos_fallback)
