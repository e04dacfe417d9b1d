"""The config reference table (`tessel config --reference`, docs/config-reference.md), generated
from the typed sections and their field docstrings."""

from __future__ import annotations

from typing import Any

from tessel.config.base import table_model
from tessel.config.schema import Config


def reference_markdown() -> str:
    """The config reference table, generated from the typed sections (docs/config-reference.md)."""
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    defaults = Config().to_dict()
    for section, info in Config.model_fields.items():
        model = table_model(info.annotation)
        listed = model is not info.annotation  # [[alerts]]: a list of tables, no defaults
        for name, field in model.model_fields.items():
            tname = _type_name(field.annotation)
            if listed:
                default = None if field.is_required() else field.get_default(call_default_factory=True)
                key = f"[[{section}]] {name}"
            else:
                default = defaults.get(section, {}).get(name)
                key = f"{section}.{name}"
            dtext = ("(required)" if listed and field.is_required() else
                     "(derived)" if default is None else f"`{_toml_value(default)}`")
            desc = " ".join((field.description or "").split())
            lines.append(f"| `{key}` | {tname} | {dtext} | {desc} |")
    return "\n".join(lines) + "\n"


def _type_name(annotation: Any) -> str:
    text = str(annotation).replace("typing.", "")
    if isinstance(annotation, type):
        text = annotation.__name__
    return text.replace("|", "or").replace("Literal", "one of ")


def _toml_value(value: Any) -> str:
    import tomli_w

    if isinstance(value, list):  # on one line (a table cell), however long
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return tomli_w.dumps({"v": value})[4:].strip()
