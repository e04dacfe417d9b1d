"""Building a config from its sources, later ones winning: field defaults (which describe
the embedded demo), a TOML file, dotted overrides (`--train.steps=100` on the command line, or
a dict in Python). Everything is validated before anything starts; `ConfigError` carries a
one-line message that names the key and says how to fix it.

The functions take the config class (`schema`, i.e. `tessel.config.Config`) as an argument, so
this module does not import the schema (which imports it for `Config.load`). Reading is split
from validating (`read_merged`, then `Config.from_dict`) so that a caller which also reads the
weights of `model.init_from` (`tessel.checkpoint.init_from.load_config`) can look at the merged
dict in between and pass the fields those weights fix.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from tessel.config.base import ConfigError, table_model
from tessel.config.presets import PRESETS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

Overrides = Mapping[str, Any] | Sequence[str] | None
M = TypeVar("M", bound=BaseModel)

INIT_FIELDS = "init_fields"
"""Key of the validation context holding the model fields of model.init_from's weights."""


SAVED_DEFAULTS: dict[str, dict[str, Any]] = {"model": {"vocab_pad_to": 1}}
"""Keys added to the config after tessel began saving resolved configs (config.toml of a run
directory, a checkpoint's state.json), with the value a saved config lacking them means: the
behaviour of the tessel that wrote it (no vocabulary padding: its checkpoints hold vocab_size
rows), not today's default. New runs write every key, so this applies to older runs only."""


def with_saved_defaults(data: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the saved config `data` (e.g. a checkpoint's state) with the keys it
    predates filled (SAVED_DEFAULTS): `Config.from_dict(with_saved_defaults(data))`."""
    out = _deep_copy(data)
    for section, values in SAVED_DEFAULTS.items():
        node = out.setdefault(section, {})
        if isinstance(node, dict):  # anything else: validation says why
            for key, value in values.items():
                node.setdefault(key, value)
    return out


def read_saved(path: str | Path) -> dict[str, Any]:
    """A config.toml tessel wrote (a run directory's), its missing keys filled as the tessel
    that wrote it behaved: `Config.from_dict(read_saved(path), overrides)`."""
    return with_saved_defaults(read_toml(path))


def read_merged(schema: type[BaseModel], path: str | Path | None,
                overrides: Overrides = None) -> dict[str, Any]:
    """The TOML file at `path` (or nothing) with dotted overrides applied, not yet validated."""
    return merge(schema, read_toml(path) if path is not None else {}, overrides)


def merge(schema: type[BaseModel], data: Mapping[str, Any],
          overrides: Overrides = None) -> dict[str, Any]:
    """A copy of `data` with dotted overrides applied, not yet validated. An override that
    switches the preset drops the shape fields the old preset supplied."""
    merged = _deep_copy(data)
    changes = _normalise_overrides(overrides)
    if "model.preset" in changes:
        _forget_old_preset(table_model(schema.model_fields["model"].annotation), merged,
                           changes["model.preset"])
    for key, value in changes.items():
        _set_dotted(schema, merged, key, value)
    return merged


def validate(schema: type[M], merged: Mapping[str, Any],
             init_fields: Mapping[str, Any] | None = None) -> M:
    """The config `merged` describes; `init_fields` are the model fields the weights of
    model.init_from fix, as read by the caller (never read here)."""
    context = {INIT_FIELDS: dict(init_fields)} if init_fields else None
    try:
        return schema.model_validate(merged, context=context)
    except ValidationError as exc:
        raise ConfigError(one_line(schema, exc)) from None


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config file {str(p)!r} is a directory; pass the path of a .toml file"
                          " (to continue a run directory: tessel train --resume DIR)")
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist; pass the path of a .toml file")
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {exc}") from None
    except RecursionError:  # (tessel.fileio.read_toml's words; config imports only errors)
        raise ConfigError(f"config file {str(p)!r} nests its arrays or tables too deep to "
                          "read; no config needs that") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(p)!r}: {exc.strerror}") from None


def parse_override_value(text: str) -> Any:
    """Interpret a command-line value as a TOML value (6e-4, true, [1, 2], "x"), else a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _normalise_overrides(overrides: Overrides) -> dict[str, Any]:
    if overrides is None:
        return {}
    if isinstance(overrides, Mapping):
        return dict(overrides)
    out: dict[str, Any] = {}
    for item in overrides:
        key, sep, value = item.removeprefix("--").partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like --section.key=value")
        out[key] = parse_override_value(value)
    return out


def _set_dotted(schema: type[BaseModel], data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(
            f"override key {key!r} must be section.key, e.g. train.steps "
            f"(sections: {', '.join(schema.model_fields)})"
        )
    section, field = parts
    node = data.setdefault(section, {})
    if not isinstance(node, dict):
        raise ConfigError(f"{section!r} in the config file must be a [table]")
    node[field] = value


def _forget_old_preset(model: type[BaseModel], data: dict[str, Any], new_preset: Any) -> None:
    """When an override switches the preset, drop the shape fields the old preset supplied
    (a resolved config.toml writes them all out) so the new preset can fill them; fields the
    user changed from the old preset's values stay."""
    section = data.get("model")
    if not isinstance(section, dict):
        return
    old = section.get("preset", model.model_fields["preset"].default)
    if old == new_preset or old not in PRESETS:
        return
    supplied = model(preset=old).model_dump()
    for key in list(section):
        if key != "preset" and key in supplied and section[key] == supplied[key]:
            del section[key]


def one_line(schema: type[BaseModel], exc: ValidationError) -> str:
    """A validation error as one line: each problem with its dotted key and how to fix it."""
    msgs = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        kind = err["type"]
        if kind == "extra_forbidden":
            msgs.append(_unknown_key_message(schema, err["loc"]))
            continue
        text = err["msg"].removeprefix("Value error, ")
        if kind == "value_error":
            msgs.append(f"{loc}: {text}" if loc else text)
        else:
            got = err.get("input")
            msgs.append(f"{loc}: {text[0].lower()}{text[1:]} (got {got!r})")
    return "invalid config: " + "; ".join(msgs)


def _unknown_key_message(schema: type[BaseModel], loc: tuple[Any, ...]) -> str:
    *parents, name = [str(p) for p in loc]
    model = schema
    for p in parents:
        if p.isdigit():  # an index into a list of tables ([[alerts]])
            continue
        model = table_model(model.model_fields[p].annotation)
    where = ".".join(parents) or "the top level"
    close = difflib.get_close_matches(name, model.model_fields, n=1)
    hint = f"did you mean {'.'.join([*parents, close[0]])!r}?" if close else (
        f"known keys: {', '.join(model.model_fields)}"
    )
    return f"unknown key {'.'.join([*parents, name])!r} in {where}; {hint}"


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}
