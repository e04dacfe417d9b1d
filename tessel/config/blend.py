"""`data.paths` blends: which datasets, with which weights."""

from __future__ import annotations

import math
from collections.abc import Sequence


def weighted_paths(paths: Sequence[str]) -> list[tuple[float | None, str]]:
    """`paths` as (weight or None, prefix) pairs. Each entry is "PREFIX", "WEIGHT PREFIX"
    or, as Megatron-LM's --data-path takes it, "W1 PREFIX1 W2 PREFIX2 ..." (also given as
    one list item per word: ["0.3", "a", "0.7", "b"]). ValueError says what is malformed."""
    entries = list(paths)
    if len(entries) > 1 and all(len(e.split()) == 1 for e in entries) \
            and _is_number(entries[0]):
        entries = [" ".join(entries)]  # Megatron's flat list, one word per item
    out: list[tuple[float | None, str]] = []
    for entry in entries:
        parts = entry.split()
        if len(parts) == 1:
            out.append((None, parts[0]))
            continue
        if len(parts) % 2 or not parts:
            raise ValueError(f'paths entry {entry!r} must be "PREFIX" or "WEIGHT PREFIX" '
                             '(or Megatron\'s "W1 PREFIX1 W2 PREFIX2 ...")')
        for weight_text, prefix in zip(parts[0::2], parts[1::2]):
            weight = float(weight_text) if _is_number(weight_text) else -1.0
            if not weight > 0:
                raise ValueError(
                    f"paths entry {entry!r}: the weight must be a positive number, "
                    'e.g. "0.7 data/web"'
                )
            out.append((weight, prefix))
    if len({w is None for w, _ in out}) > 1:
        raise ValueError("paths: give a weight for every dataset or for none")
    return out


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False
