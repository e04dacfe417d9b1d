"""The chat template a model was fine-tuned with, kept in Hugging Face's tokenizer files.

A fine-tuning run saves the template it rendered its data with, and the special-token strings
the template saw (`bos_token`, `eos_token`, `pad_token`, ...), as `tokenizer_config.json`
beside the run's `tokenizer.json` (`run_tokenizer_config`). An export (`tessel convert
tessel-to-hf`, and the exports written during training) writes it as transformers >= 4.50
does, `chat_template.jinja`, and as older versions read it, `chat_template` in
`tokenizer_config.json`, with the same token strings (`export_template`): transformers'
`apply_chat_template` and `tessel generate --chat` on the export then render what the run
trained on.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tessel.data.chat_template import ChatTemplate, model_template, special_tokens, with_tokens

TEMPLATE_FILE = "chat_template.jinja"
"""transformers' file name for a model's (default) chat template."""


def run_tokenizer_config(template: ChatTemplate) -> dict[str, Any]:
    """What a run saves: the template and the special-token strings it was rendered with
    (null for a bos/eos it saw as empty, as transformers writes a tokenizer without that
    token)."""
    return {"chat_template": template.source,
            **{key: value or None for key, value in template.tokens().items()}}


def saved_template(directory: Path, eos_fallback: str = "") -> ChatTemplate | None:
    """The template saved beside the tokenizer in `directory` (a run, an export, a
    `hf-to-tessel` output), with its token strings; None when there is none."""
    source = model_template(directory)
    if source is None:
        return None
    return with_tokens(source, f"the model's own, {directory}", special_tokens(directory),
                       eos_fallback)


def export_template(template: ChatTemplate,
                    is_token: Callable[[str], bool]) -> tuple[str, dict[str, Any]]:
    """(the template text an export writes, its tokenizer_config.json fields) for a model
    fine-tuned with `template`, so that transformers renders what training did. Each
    special-token string the template saw is written as that token when the tokenizer has it
    as one token (bos/eos null when it saw none). One that is not a token of the tokenizer
    (an `eos_token` "</s>" a BPE without it reads as pieces) cannot be written so:
    transformers would add it as a new token, one id past the model's vocabulary, and encode
    the text otherwise than training did; the exported template sets it itself instead
    (`{% set eos_token = "</s>" %}` first), and the tokenizer's own value stays."""
    fields: dict[str, Any] = {}
    pinned = ""
    for key, value in template.tokens().items():
        if not value:
            if key in ("bos_token", "eos_token"):
                fields[key] = None
        elif is_token(value):
            fields[key] = value
        elif key in template.source:
            pinned += f"{{% set {key} = {_jinja_string(value)} +%}}"
    source = pinned + template.source
    fields["chat_template"] = source
    return source, fields


def _jinja_string(text: str) -> str:
    """`text` as a Jinja2 string literal (the lexer reads these escapes back; other
    characters, any Unicode included, stand for themselves)."""
    escaped = (text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
               .replace("\r", "\\r"))
    return f'"{escaped}"'
