"""Tokenizers. Each one serialises to a small JSON spec saved with every run, so generation
always decodes with the tokenizer the data was made with."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eod_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def to_spec(self) -> dict[str, Any]: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, 256 = end of document. Needs no training and no files."""

    name = "bytes"
    vocab_size = 257
    eod_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def to_spec(self) -> dict[str, Any]:
        return {"type": self.name}


def build_tokenizer(name: str) -> Tokenizer:
    if name == "bytes":
        return ByteTokenizer()
    raise ValueError(f"unknown tokenizer {name!r}; use data.tokenizer='bytes'")


def save_tokenizer(tok: Tokenizer, path: Path) -> None:
    path.write_text(json.dumps(tok.to_spec()) + "\n")


def load_tokenizer(path: Path) -> Tokenizer:
    try:
        spec = json.loads(path.read_text())
        return build_tokenizer(spec["type"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot read tokenizer {str(path)!r}: {exc}") from None
