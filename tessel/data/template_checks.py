"""What an operation of a chat template would build, measured before it is built.

The sandbox (`tessel.data.template_sandbox`) calls these where a template can grow text or
numbers past the limits of `tessel.data.template_meter` in one step: operators (`*`, `%`,
`**`), the filters (`metered_filter`) and methods (`check_call`) that can, and str.format's
fields. Each raises `LimitReached` with what it refused.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from typing import Any

from tessel.data.template_meter import (
    MAX_INT_BITS,
    MAX_ITEMS,
    LimitReached,
    Meter,
    current,
    made,
    text_size,
)


def _number(value: Any) -> int:
    return value if isinstance(value, int) else 0


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0 +\-]*(\*|\d+)?(?:\.(\*|\d+))?")
_DIGITS = re.compile(r"\d+")


def digits_total(spec: str) -> int:
    """The sum of the numbers written in a format spec (its widths and precisions)."""
    return sum(int(d) if len(d) < 16 else 10**16 for d in _DIGITS.findall(spec))


def percent_size(meter: Meter, fmt: str, args: Any) -> int:
    """An upper bound of len(fmt % args)."""
    size = len(fmt) + text_size(args, meter)
    for width, precision in _PERCENT_SPEC.findall(fmt):
        size += digits_total(width + " " + precision)
        if "*" in (width, precision):  # the width comes from the arguments
            values = args if isinstance(args, tuple) else (args,)
            size += sum(abs(_number(v)) for v in values)
    return size


def check_multiply(meter: Meter, left: Any, right: Any) -> None:
    """`left * right`: a repetition of text or a list, or a product of numbers."""
    seq, n = (left, right) if isinstance(right, int) else (right, left)
    if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int):
        meter.check(len(seq) * max(n, 0), "a repetition ('*')")
    elif isinstance(left, int) and isinstance(right, int):
        _check_bits(left.bit_length() + right.bit_length())


def check_power(left: Any, right: Any) -> None:
    """`left ** right` of whole numbers."""
    if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        _check_bits(math.log2(abs(left)) * min(right, 10**18))  # (a float: right may be huge)


def _check_bits(bits: float) -> None:
    if bits > MAX_INT_BITS:
        raise LimitReached(f"it computes a number of about {bits:,.0f} bits, more than the "
                           f"{MAX_INT_BITS:,} tessel allows")


def check_count(n: Any, what: str) -> None:
    """A count of items to make (`batch`, `slice`, `lipsum`)."""
    if isinstance(n, int) and n > MAX_ITEMS:
        raise LimitReached(f"{what} {n:,} is more than the {MAX_ITEMS:,} tessel allows")


def _arg(rest: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    return rest[index] if len(rest) > index else kwargs.get(name, default)


def _replace_size(meter: Meter, s: Any, old: Any, new: Any, count: Any) -> int:
    n = text_size(s, meter)
    if isinstance(s, (str, bytes)) and isinstance(old, type(s)) and old:
        hits = s.count(old)
    else:
        hits = n + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return n + hits * text_size(new, meter)


def _joined(meter: Meter, sep: Any, items: list) -> int:
    return (text_size(sep, meter) * max(len(items) - 1, 0)
            + sum(text_size(x, meter) for x in items))


# Filters that take a list or a mapping without printing it.
_CONTAINER_FILTERS = frozenset({
    "abs", "attr", "batch", "count", "d", "default", "dictsort", "first", "float", "groupby",
    "int", "items", "join", "last", "length", "list", "map", "max", "min", "random", "reject",
    "rejectattr", "reverse", "round", "select", "selectattr", "slice", "sort", "sum",
    "tojson", "unique"})


def _check_filter(meter: Meter, name: str, value: Any, rest: tuple,
                  kwargs: dict) -> tuple[Any, tuple]:
    """Refuse a filter call whose result would be past the limits; returns (value, rest),
    an iterable argument turned into the list it was."""
    if name not in _CONTAINER_FILTERS and not isinstance(value, str):
        meter.check(text_size(value, meter), f"the text the {name} filter reads")
    if name == "center":
        meter.check(_number(_arg(rest, kwargs, 0, "width", 80)), "centered text")
    elif name == "indent":
        width = _arg(rest, kwargs, 0, "width", 4)
        width = width if isinstance(width, int) else text_size(width, meter)
        lines = value.count("\n") + 1 if isinstance(value, str) else 1
        meter.check(text_size(value, meter) + lines * width, "indented text")
    elif name == "replace":
        meter.check(_replace_size(meter, value, _arg(rest, kwargs, 0, "old", ""),
                                  _arg(rest, kwargs, 1, "new", ""),
                                  _arg(rest, kwargs, 2, "count", None)), "replaced text")
    elif name == "format":
        meter.check(percent_size(meter, str(value), kwargs or rest), "formatted text")
    elif name == "batch":
        check_count(_arg(rest, kwargs, 0, "linecount", 0), "a batch of")
    elif name == "slice":
        check_count(_arg(rest, kwargs, 0, "slices", 0), "slices:")
    elif name == "wordwrap":
        wrap = _arg(rest, kwargs, 2, "wrapstring", None) or "\n"
        n = text_size(value, meter)
        breaks = n // max(_number(_arg(rest, kwargs, 0, "width", 79)), 1) + n // 2 + 1
        meter.check(n + breaks * text_size(wrap, meter), "wrapped text")
    elif name in ("join", "sum"):
        value = list(value)
        if name == "join":
            meter.check(_joined(meter, _arg(rest, kwargs, 0, "d", ""), value), "joined text")
        else:
            start = _arg(rest, kwargs, 1, "start", 0)
            if isinstance(start, (list, tuple)):
                meter.check(len(start) + sum(len(x) if isinstance(x, (list, tuple))
                                             else text_size(x, meter) for x in value),
                            "a sum of lists")
    return value, rest


_SPECIAL_FILTERS = frozenset({"center", "indent", "replace", "format", "batch", "slice",
                              "wordwrap", "join", "sum"})


def metered_filter(name: str, f: Any) -> Any:
    """Jinja's filter `f`, called as `name`, checked before (`_check_filter`: every filter
    that prints a value that is not text yet, and those that can grow text) and its result
    charged to the meter."""
    # Filters that get the context or environment first take their value second.
    offset = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0
    special = name in _SPECIAL_FILTERS

    @functools.wraps(f)  # keeps jinja_pass_arg: Jinja still passes what the filter takes
    def metered(*args: Any, **kwargs: Any) -> Any:
        if len(args) > offset and (special or type(args[offset]) is not str):
            meter = current()
            meter.tick()
            value, rest = _check_filter(meter, name, args[offset], args[offset + 1:], kwargs)
            args = (*args[:offset], value, *rest)
        return made(f(*args, **kwargs))

    return metered


def check_call(meter: Meter, obj: Any, args: tuple, kwargs: dict) -> tuple:
    """Refuse a method call whose result would be past the limits (the str methods that
    can grow text); returns the arguments, an iterable given to join turned into a list."""
    owner = getattr(obj, "__self__", None)
    name = getattr(obj, "__name__", "")
    if isinstance(owner, (str, bytes)):
        if name in ("center", "ljust", "rjust", "zfill"):
            meter.check(_number(_arg(args, kwargs, 0, "width", 0)), f"the {name}() result")
        elif name == "expandtabs":
            tab = "\t" if isinstance(owner, str) else b"\t"
            size = len(owner) + owner.count(tab) * _number(_arg(args, kwargs, 0, "tabsize", 8))
            meter.check(size, "the expandtabs() result")
        elif name == "replace":
            meter.check(_replace_size(meter, owner, _arg(args, kwargs, 0, "old", ""),
                                      _arg(args, kwargs, 1, "new", ""),
                                      _arg(args, kwargs, 2, "count", -1)), "the replace() result")
        elif name == "join" and args:
            items = list(args[0])
            meter.check(_joined(meter, owner, items), "the join() result")
            args = (items, *args[1:])
        elif name == "translate" and args and isinstance(args[0], Mapping):
            longest = max((text_size(v, meter) for v in args[0].values()), default=1)
            meter.check(len(owner) * max(longest, 1), "the translate() result")
    elif isinstance(owner, int) and name == "to_bytes":
        meter.check(_number(_arg(args, kwargs, 0, "length", 1)), "the to_bytes() result")
    return args
