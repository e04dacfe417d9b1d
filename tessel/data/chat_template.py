"""Chat templates: a conversation rendered to the text a model was fine-tuned on.

A template is Jinja2 text, the model's own (`chat_template` in the `tokenizer_config.json` or
`chat_template.jinja` beside its `tokenizer.json`), one of the built-ins below, or a `.jinja`
file. It is rendered exactly as Hugging Face transformers renders it
(`PreTrainedTokenizerBase.apply_chat_template`), in the environment of
`tessel.data.template_sandbox`, with `messages`, `add_generation_prompt`, `bos_token` and
`eos_token` as variables. The sandbox matters: a template comes from whoever published the
model, and rendering it must neither run their code nor take the machine (its limits).
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


@dataclass(frozen=True)
class ChatTemplate:
    """A template's source, where it came from, and the special-token strings it sees."""

    source: str
    """The Jinja2 text."""
    origin: str
    """Where it came from, for messages ("chatml", "tokenizer_config.json", a path)."""
    bos_token: str = ""
    eos_token: str = ""

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """The text of `messages`; DataError (one line) when the template does not parse,
        fails, or goes past the limits of `tessel.data.template_sandbox` (time, size)."""
        variables = {"messages": messages, "add_generation_prompt": add_generation_prompt,
                     "bos_token": self.bos_token, "eos_token": self.eos_token,
                     "tools": None, "documents": None}
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


def special_tokens(directory: Path | None) -> tuple[str, str]:
    """(bos_token, eos_token) strings from `directory`'s tokenizer_config.json, or empty."""
    if directory is None or not (directory / "tokenizer_config.json").is_file():
        return "", ""
    cfg = _read_json(directory / "tokenizer_config.json")
    return _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))


def resolve_template(spec: str, tokenizer_dir: Path | None, eos_fallback: str = "") -> ChatTemplate:
    """The template `data.chat_template` names: "auto" (the model's own, found beside its
    tokenizer, else ChatML, said in the origin), a built-in name, or a `.jinja` file path.
    `eos_fallback`: the tokenizer's end-of-document token, for `eos_token` when no
    tokenizer_config.json names one."""
    bos, eos = special_tokens(tokenizer_dir)
    eos = eos or eos_fallback
    if spec == "auto":
        own = model_template(tokenizer_dir) if tokenizer_dir is not None else None
        if own is not None:
            return ChatTemplate(own, f"the model's own, {tokenizer_dir}", bos, eos)
        return ChatTemplate(BUILTIN_TEMPLATES["chatml"], "chatml (the model has none)", bos, eos)
    if spec in BUILTIN_TEMPLATES:
        return ChatTemplate(BUILTIN_TEMPLATES[spec], spec, bos, eos)
    path = Path(spec)
    if not path.is_file():
        raise DataError(f"data.chat_template={spec!r} is neither a built-in template "
                        f"({', '.join(BUILTIN_TEMPLATES)}), \"auto\", nor a .jinja file")
    return ChatTemplate(read_template_file(path), str(path), bos, eos)
