"""The checkpoint package's error (one line, meant for the user)."""

from __future__ import annotations

from tessel.errors import TesselError


class CheckpointError(TesselError):
    """Unusable checkpoint; the message is one line meant for the user."""


def short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
