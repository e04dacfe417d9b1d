"""One chat-template rendering's limits, and the meter the metered operations report to.

`tessel.data.template_sandbox` explains the limits; this module holds them (module
constants: tests lower them), the `Meter` of the rendering in progress (a context variable,
so renderings in several threads each have their own), and the operations the generated
code of a template calls instead of Python's own: `add` (`a + b + c`), `concat` (the pieces
of output joined), `made` (a value just built) and `MeteredIterable` (a loop's items).
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import ItemsView, Iterator, KeysView, Mapping, ValuesView
from contextlib import contextmanager
from typing import Any

RENDER_SECONDS = 5.0
"""The most one rendering may take (a real template needs well under 0.1 s)."""
MIN_TEXT = 4 * 2**20
"""The size limit (characters) of a rendering of a short conversation."""
TEXT_FACTOR = 8
"""The size limit of a long conversation's rendering: this many times its characters."""
BUDGET_FACTOR = 16
"""Everything one rendering builds, in all: this many times its size limit."""
LOOP_FACTOR = 2
"""Loop iterations of one rendering, in all: this many times its size limit (each can leave
a piece of output behind; a real template loops over the messages)."""
MAX_INT_BITS = 2**16
"""The largest number a template may compute, in bits (about 20,000 digits)."""
MAX_ITEMS = 100_000
"""Jinja's own `range()` limit, also for `batch`, `slice` and `lipsum` counts."""
_ITEM = 8
"""What one item of a list costs the budget (a pointer)."""


class LimitReached(Exception):
    """Raised inside a rendering at a limit; the message says which. Not a ValueError,
    TypeError or LookupError, which Jinja's filters catch: nothing on the way swallows it."""


class Meter:
    """One rendering's limits and what it has spent (its methods are on every operator,
    call and piece of output of a template: kept to a few attribute reads)."""

    __slots__ = ("budget", "deadline", "limit", "loops", "seconds", "sizer", "spent")

    def __init__(self, seconds: float, sizer: Any = None):
        self.deadline = _now() + seconds
        self.seconds = seconds
        self.limit = MIN_TEXT
        self.budget = BUDGET_FACTOR * MIN_TEXT
        self.loops = LOOP_FACTOR * MIN_TEXT  # iterations left
        self.sizer = sizer  # the conversation's characters, counted when first needed
        self.spent = 0

    def _widen(self) -> bool:
        # The limits of a long conversation, from its size, the first time MIN_TEXT is not
        # enough (most renderings never count the characters); whether they grew.
        if self.sizer is None:
            return False
        chars, self.sizer = self.sizer(), None
        if TEXT_FACTOR * chars <= self.limit:
            return False
        grown = TEXT_FACTOR * chars - self.limit
        self.limit += grown
        self.budget += BUDGET_FACTOR * grown
        self.loops += LOOP_FACTOR * grown
        return True

    def looped(self) -> None:
        """An iteration with none left, or past the deadline."""
        if self.loops < 0 and not (self._widen() and self.loops >= 0):
            raise LimitReached(f"it looped more than {LOOP_FACTOR * self.limit:,} times "
                               "(tessel's limit for one rendering; a loop that does not end?)")
        self.tick()

    def tick(self) -> None:
        if _now() > self.deadline:
            raise LimitReached(f"it took longer than {self.seconds:g} s (tessel's limit for one "
                               "rendering; a loop that does not end?)")

    def check(self, size: int, what: str) -> None:
        if size > self.limit and not (self._widen() and size <= self.limit):
            raise LimitReached(f"{what} would be about {size:,} characters, more than the "
                               f"{self.limit:,} tessel allows one rendering of this conversation")

    def charge(self, size: int) -> None:
        # No clock here: only loops and calls repeat, and they tick.
        self.spent += size
        if self.spent > self.budget and not (self._widen() and self.spent <= self.budget):
            raise LimitReached(f"it built more than {self.budget:,} characters in all while "
                               "rendering one conversation (tessel's limit)")


_now = time.monotonic
_ACTIVE: contextvars.ContextVar[Meter | None] = contextvars.ContextVar("tessel_template_meter",
                                                                        default=None)


def current() -> Meter:
    """The meter of the rendering in progress (the environment used outside `metering`, not
    by tessel, gets fresh limits per call)."""
    return _ACTIVE.get() or Meter(RENDER_SECONDS)


@contextmanager
def metering(sizer: Any) -> Iterator[Meter]:
    """A rendering's meter, active in this context (thread); `sizer()` counts the
    conversation's characters, when a long one needs wider limits."""
    token = _ACTIVE.set(Meter(RENDER_SECONDS, sizer))
    try:
        yield _ACTIVE.get()
    finally:
        _ACTIVE.reset(token)


# ---- sizes and the operations ----------------------------------------------------------


def made(value: Any) -> Any:
    """`value`, just built: a string or list longer than the size limit is refused (at most
    one operation past it: what is checked *before* building is the rest), and what it
    holds is charged to the budget (characters; `_ITEM` per item of a container)."""
    meter = _ACTIVE.get() or current()  # (current() inlined: this runs for every `+` or slice)
    if type(value) is str:
        size = cost = len(value)
    elif isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)):
        size = len(value)
        cost = size if isinstance(value, (str, bytes)) else _ITEM * size
    else:
        return value
    if size > meter.limit:
        meter.check(size, "a value it built")
    meter.spent += cost
    if meter.spent > meter.budget:
        meter.charge(0)  # raises
    return value


def add(terms: tuple) -> Any:
    """terms[0] + terms[1] + ...: strings (most sums in templates) are measured before they
    are joined; anything else is added as Python adds it, each step checked (`made`)."""
    for term in terms:
        if type(term) is not str:  # (a Markup, which escapes what is added to it, too)
            break
    else:
        meter = _ACTIVE.get() or current()
        size = sum(map(len, terms))
        if size > meter.limit:
            meter.check(size, "a concatenation ('+')")
        meter.spent += size
        if meter.spent > meter.budget:
            meter.charge(0)  # raises
        return "".join(terms)
    total = terms[0]
    for term in terms[1:]:
        total = made(total + term)
    return total


def _repr_size(s: str) -> int:
    if s.isprintable():
        return len(s) + 2 + s.count("\\") + s.count("'")
    return (4 if s.isascii() else 10) * len(s) + 2  # '\x00', '\U000e0001'


def text_size(value: Any, meter: Meter) -> int:
    """An upper bound of len(str(value)), counted only up to a little past the size limit (a
    list of a million references to one long string prints as a million copies of it)."""
    if isinstance(value, str):
        return len(value)
    cap, total, stack, steps = meter.limit, 0, [value], 0
    while stack and total <= cap:
        v = stack.pop()
        steps += 1
        if not steps & 0xFFFF:
            meter.tick()
        if isinstance(v, str):
            total += _repr_size(v)
        elif isinstance(v, bytes):
            total += 4 * len(v) + 3
        elif v is None or isinstance(v, (bool, float)):
            total += 24
        elif isinstance(v, int):
            total += v.bit_length() // 3 + 2
        elif isinstance(v, Mapping):
            total += 2 + 4 * len(v)
            if total <= cap:
                stack.extend(v.keys())
                stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset, KeysView, ValuesView, ItemsView)):
            total += 16 + 2 * len(v)
            if total <= cap:
                stack.extend(v)
        else:
            from jinja2.utils import Namespace

            total += 128
            if isinstance(v, Namespace):  # it prints its attributes
                stack.append(v._Namespace__attrs)  # noqa: SLF001 (Jinja's own name for them)
    return total


def strings_size(value: Any) -> int:
    """The characters of the strings in `value` (nested lists and dicts): a conversation's."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, Mapping):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return total


def concat(pieces: Any) -> str:
    """The pieces of output joined, measured first (a loop can write one long string many
    times: the references are cheap, the joined text is not)."""
    meter = current()
    pieces = list(pieces)
    size = sum(map(len, pieces))
    meter.check(size, "the rendered text")
    meter.charge(size)
    return "".join(pieces)


class MeteredIterable:
    """A loop's iterable: each item passes the meter (its length, when it has one, is kept
    for `loop.length`)."""

    def __init__(self, iterable: Any):
        self.iterable = iterable

    def __iter__(self) -> Iterator[Any]:
        meter = current()
        for item in self.iterable:
            meter.loops -= 1
            if meter.loops < 0 or _now() > meter.deadline:
                meter.looped()
            yield item

    def __len__(self) -> int:
        return len(self.iterable)
