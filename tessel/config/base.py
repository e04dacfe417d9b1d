"""What every config section shares: strict, closed pydantic models, and the one error."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from tessel.errors import TesselError


class ConfigError(TesselError):
    """Bad configuration; the message is one line meant for the user."""


class Section(BaseModel):
    """A [section] of the config."""

    # strict: a string where a number belongs is an error, not a silent conversion;
    # forbid: a misspelt key is an error, not a silently ignored setting;
    # allow_inf_nan=False: no setting is ever infinite or NaN (`optim.lr=inf` trained NaNs).
    model_config = ConfigDict(
        extra="forbid", strict=True, use_attribute_docstrings=True, validate_assignment=True,
        allow_inf_nan=False,
    )


def table_model(annotation: Any) -> type[BaseModel]:
    """The section class of a field of `Config`: `XConfig`, or `AlertConfig` for
    `list[AlertConfig]` (the [[alerts]] tables)."""
    args = getattr(annotation, "__args__", None)
    model = args[0] if args else annotation
    assert isinstance(model, type) and issubclass(model, BaseModel)
    return model
