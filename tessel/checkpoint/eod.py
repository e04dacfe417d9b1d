"""Which token ends documents for a model that comes from elsewhere (`data.eod_token`).

tessel ends documents with the first of the well-known end-of-text tokens its tokenizer has
(`EOD_ALTERNATIVES`). A tokenizer with none of them used to get `<|endoftext|>` added, one id
past its vocabulary, which an imported model's embedding may not have. For such a model the
token is the one its own files name: `eos_token_id` in config.json or generation_config.json,
`eos_token` in tokenizer_config.json, else its pad token.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

AUTO = "auto"


def _json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, or {} when it is absent or unreadable (these files only
    refine the choice; the weights' own config.json was already checked)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _token(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "</s>", ...}, as tokenizer_config.json may write
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def hf_eod(root: Path) -> tuple[str, str]:
    """(`data.eod_token` value, where it came from) for the Hugging Face model in `root`."""
    from tokenizers import Tokenizer as HFTokenizer

    from tessel.data.tokenizer import EOD_ALTERNATIVES

    try:
        tok = HFTokenizer.from_file(str(root / "tokenizer.json"))
    except Exception:  # absent or unreadable: the caller's tokenizer loading says so
        return AUTO, "no tokenizer"
    if any(tok.token_to_id(t) is not None for t in EOD_ALTERNATIVES):
        return AUTO, "its own end-of-text token"
    config, generation = _json(root / "config.json"), _json(root / "generation_config.json")
    tok_config = _json(root / "tokenizer_config.json")
    candidates = [
        (_first_id(config.get("eos_token_id")), "config.json eos_token_id"),
        (_first_id(generation.get("eos_token_id")), "generation_config.json eos_token_id"),
        (tok.token_to_id(_token(tok_config.get("eos_token")) or "\0"),
         "tokenizer_config.json eos_token"),
        (_first_id(config.get("pad_token_id")), "config.json pad_token_id"),
        (tok.token_to_id(_token(tok_config.get("pad_token")) or "\0"),
         "tokenizer_config.json pad_token"),
    ]
    for token_id, where in candidates:
        name = tok.id_to_token(token_id) if token_id is not None else None
        if name is not None:
            return name, where
    return AUTO, "none named"


def run_eod(directory: Path) -> str:
    """`data.eod_token` of the tessel run (or `hf-to-tessel` output) whose config.toml is in
    `directory`; "auto" when there is none."""
    try:
        with open(directory / "config.toml", "rb") as f:
            value = tomllib.load(f).get("data", {}).get("eod_token", AUTO)
    except (OSError, tomllib.TOMLDecodeError):
        return AUTO
    return value if isinstance(value, str) else AUTO
