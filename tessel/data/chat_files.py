"""The chat template a model was fine-tuned with, kept in Hugging Face's tokenizer files.

A fine-tuning run saves the template it rendered its data with, and the `bos_token` and
`eos_token` strings the template saw, as `tokenizer_config.json` beside the run's
`tokenizer.json` (`run_tokenizer_config`). An export (`tessel convert tessel-to-hf`, and the
exports written during training) writes it as transformers >= 4.50 does, `chat_template.jinja`,
and as older versions read it, `chat_template` in `tokenizer_config.json`, with the same
token strings (`export_fields`): transformers' `apply_chat_template` and `tessel generate
--chat` on the export then render what the run trained on.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tessel.data.chat_template import ChatTemplate, model_template, special_tokens

TEMPLATE_FILE = "chat_template.jinja"
"""transformers' file name for a model's (default) chat template."""


def run_tokenizer_config(template: ChatTemplate) -> dict[str, Any]:
    """What a run saves: the template and the token strings it was rendered with (null for
    one it saw as empty, as transformers writes a tokenizer without that token)."""
    return {"chat_template": template.source, "bos_token": template.bos_token or None,
            "eos_token": template.eos_token or None}


def saved_template(directory: Path, eos_fallback: str = "") -> ChatTemplate | None:
    """The template saved beside the tokenizer in `directory` (a run, an export, a
    `hf-to-tessel` output), with its token strings; None when there is none."""
    source = model_template(directory)
    if source is None:
        return None
    bos, eos = special_tokens(directory)
    return ChatTemplate(source, f"the model's own, {directory}", bos,
                        eos or eos_fallback)


def export_fields(template: ChatTemplate, is_token: Callable[[str], bool]) -> dict[str, Any]:
    """tokenizer_config.json fields of an export that carries `template`: the template, and
    `bos_token`/`eos_token` as the template saw them when the tokenizer has each as one token
    (null when it saw none; otherwise the caller's own value stays)."""
    fields: dict[str, Any] = {"chat_template": template.source}
    for key, value in (("bos_token", template.bos_token), ("eos_token", template.eos_token)):
        if not value:
            fields[key] = None
        elif is_token(value):
            fields[key] = value
    return fields
