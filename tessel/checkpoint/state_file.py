"""A checkpoint's `state.json`, read and checked in one place for every reader.

`state.json` is written last by a save (see `store`): its presence marks a complete
checkpoint, and it lists every file's size and checksum, the run's config (secrets redacted),
the step, the data loader's position and the rest of the trainer's state. Like any file tessel
reads it may be damaged or written by someone else, so `read_state` refuses, in one line that
says how to get past it, a file that is not UTF-8 JSON, is nested deeper than tessel ever
writes, does not match its own checksum, or holds a known key of another type than tessel
writes (`files` a list, `loader` a string, `step` "two"): `train --resume`, `generate`,
`checkpoint consolidate`, `convert tessel-to-hf` and `model.init_from` then never fail on it
further in with a traceback.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tessel.checkpoint import checksum
from tessel.checkpoint.errors import CheckpointError

FORMAT_VERSION = 2  # 1 was single-file safetensors (before sharded layouts)
STATE_DIGEST = "state_sha256"
# How to get past a damaged checkpoint (the run resumes from the newest complete one).
MOVE_ASIDE = "move that directory out of checkpoints/ to resume from the one before"
MAX_DEPTH = 32  # tessel's own state.json nests 5 deep (config.data.mixture[i].weight)

_NUMBER, _NULL = (int, float), type(None)
# Every key tessel writes, and the types its value may have (_NULL: JSON null).
_TYPES: dict[str, tuple[type, ...]] = {
    "format": (int,), "step": (int,), "files": (dict,), checksum.DIGEST_KEY: (dict,),
    STATE_DIGEST: (str,), "config": (dict,), "loader": (dict,), "tokens_seen": (int,),
    "elapsed_s": _NUMBER, "val_loss": (*_NUMBER, _NULL), "layout": (str,),
    "batches_drawn": (int,), "world_size": (int,), "lora_base": (str,),
    "recovery": (dict, _NULL), "alerts": (list,), "scaler": (dict, _NULL),
}
_REQUIRED = ("format", "step", "files")  # the config: where one is needed (run_config)
_NAMES = {dict: "an object", list: "a list", str: "text", bool: "a boolean", _NULL: "null",
          int: "a number", float: "a number"}


def damaged(path: Path, what: str) -> CheckpointError:
    """The one-line error for checkpoint `path` whose state.json is damaged (`what`)."""
    return CheckpointError(
        f"checkpoint {str(path)!r} is damaged: its state.json {what}; {MOVE_ASIDE}")


def state_digest(meta: dict[str, Any]) -> str:
    """SHA-256 of state.json's content without its own digest field (canonical JSON)."""
    body = {k: v for k, v in meta.items() if k != STATE_DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _depth(value: Any) -> int:
    """How deep `value` nests (0 for a scalar), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, level = stack.pop()
        deepest = max(deepest, level)
        if deepest > MAX_DEPTH:
            return deepest
        if isinstance(item, dict):
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, level + 1) for v in item)
    return deepest


def _check_types(path: Path, meta: dict[str, Any]) -> None:
    for key in _REQUIRED:
        if key not in meta:
            raise damaged(path, f"lacks {key!r}")
    for key, allowed in _TYPES.items():
        value = meta.get(key)
        if key in meta and (type(value) not in allowed):  # (JSON true is no number)
            raise damaged(path, f"has {key!r} as {_NAMES.get(type(value), '?')} "
                                f"({_shown(value)}), where tessel writes {_NAMES[allowed[0]]}")
    if meta["step"] < 0:
        raise damaged(path, f"has a negative step ({meta['step']})")
    for key, value_type in (("files", int), (checksum.DIGEST_KEY, str)):
        for name, value in meta.get(key, {}).items():
            if type(value) is not value_type or (value_type is int and value < 0):
                raise damaged(path, f"lists {name!r} in {key!r} with {_shown(value)}")


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_state(path: Path) -> dict[str, Any]:
    """The checked content of checkpoint `path`'s state.json, its files not looked at
    (CheckpointError, one line, when it is missing, unreadable or damaged)."""
    try:
        meta = json.loads((path / "state.json").read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(
            f"{str(path)!r} is not a complete checkpoint (no state.json)") from None
    except OSError as exc:
        raise CheckpointError(f"checkpoint {str(path)!r} is unreadable: {exc}") from None
    except UnicodeDecodeError as exc:
        raise damaged(path, f"is not UTF-8 text (byte {exc.start})") from None
    except RecursionError:
        raise damaged(path, f"nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:
        raise damaged(path, f"is not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise damaged(path, f"holds {_NAMES.get(type(meta), '?')}, not a JSON object")
    if _depth(meta) > MAX_DEPTH:
        raise damaged(path, f"nests deeper than {MAX_DEPTH} levels")
    if STATE_DIGEST in meta and meta[STATE_DIGEST] != state_digest(meta):
        raise damaged(path, "does not match its checksum")
    if meta.get("format") != FORMAT_VERSION and isinstance(meta.get("format"), int):
        raise CheckpointError(f"checkpoint {str(path)!r} has format {meta['format']}, this "
                              f"tessel reads format {FORMAT_VERSION}")
    _check_types(path, meta)
    return meta


def read_state(path: Path) -> dict[str, Any]:
    """Checkpoint `path`'s state.json, checked (`parse_state`), with every file it lists
    present at its recorded size."""
    meta = parse_state(path)
    for fname, size in meta["files"].items():
        f = path / fname
        if Path(fname).name != fname or fname in (".", ".."):
            raise damaged(path, f"lists {fname!r}, which is not a file of the checkpoint")
        actual = f.stat().st_size if f.is_file() else None
        if actual != size:
            what = "is missing" if actual is None else f"has {actual} bytes, expected {size}"
            raise CheckpointError(
                f"checkpoint {str(path)!r} is damaged: {fname} {what}; {MOVE_ASIDE}")
    return meta


def digests(path: Path) -> dict[str, str]:
    """The content checksums state.json lists ({} for checkpoints written before them)."""
    return parse_state(path).get(checksum.DIGEST_KEY, {})
