"""Whole numbers that users type (flags) or that arrive in the environment."""

from __future__ import annotations


def whole_number(text: str) -> int | None:
    """`text` as an int when it is ASCII digits 0-9 only (no sign, space or underscore), else
    None. str.isdigit() also takes '²', which int() refuses (a traceback), and '٣', which
    int() reads as 3."""
    return int(text) if text.isascii() and text.isdigit() else None
