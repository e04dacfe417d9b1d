"""What preparing fine-tuning data may cost in all, and what it says while it runs.

Each rendering has its own limits (`tessel.data.template_meter`); these bound the whole
preparation, so a template that stays inside them conversation after conversation cannot
take hours or the machine's memory either (module constants: tests lower them):

- rendering every conversation may take at most `TOTAL_SECONDS` plus `SECONDS_PER_MESSAGE`
  for each message rendered so far (a real template needs well under a millisecond a
  message, so a large set gets room in proportion, and a slow template stops in a minute);
- the rendered conversations, held in memory until they are packed, may hold at most
  `TOTAL_CHARS` plus `TEXT_FACTOR` times their messages' characters plus `CHARS_PER_MESSAGE`
  for each message.

Past either, preparation stops with one line (`DataError`). Every `PROGRESS_SECONDS` a line
on stderr says how far it got (only once it has run that long: a quick preparation, or one
refused at once, says nothing more), the tokenizer's training included (`train_bpe` trains in
a thread of its own, so a signal stops the command at once then too).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from tessel.errors import DataError

TOTAL_SECONDS = 60.0
"""Rendering time allowed in all, before the allowance per message."""
SECONDS_PER_MESSAGE = 0.01
"""Rendering time allowed for each message rendered."""
TOTAL_CHARS = 64 * 2**20
"""Characters of rendered text allowed in all, before the allowances for the messages."""
TEXT_FACTOR = 8
"""Rendered characters allowed for each character of the messages' text."""
CHARS_PER_MESSAGE = 1024
"""Rendered characters allowed for each message (its template markup)."""
PROGRESS_SECONDS = 10.0
"""How often a progress line is written while preparing."""


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Preparation:
    """The progress and the bounds of one preparation (see the module docstring)."""

    def __init__(self, origin: str, progress: Callable[[str], None] | None = None):
        self.origin = origin  # the template, for the error lines
        self.progress = progress or _stderr
        self.start = self.said = time.monotonic()
        self.conversations = self.messages = self.text = self.rendered = 0
        self.render_seconds = 0.0

    def _mb(self) -> str:
        return f"{self.rendered / 1e6:,.1f} MB"

    def tick(self, doing: str) -> None:
        """A progress line, `doing` what, when the last one is `PROGRESS_SECONDS` old."""
        now = time.monotonic()
        if now - self.said >= PROGRESS_SECONDS:
            self.said = now
            self.progress(f"tessel: preparing fine-tuning data: {doing} "
                          f"({now - self.start:,.0f} s so far)")

    def rendered_one(self, messages: list[dict[str, str]], text: str, seconds: float) -> None:
        """Count one conversation rendered (to `text`, in `seconds`); DataError past a bound."""
        self.conversations += 1
        self.messages += len(messages)
        self.text += sum(len(m["content"]) for m in messages)
        self.rendered += len(text)
        self.render_seconds += seconds
        allowed = TOTAL_SECONDS + SECONDS_PER_MESSAGE * self.messages
        if self.render_seconds > allowed:
            raise DataError(
                f"the chat template ({self.origin}) took {self.render_seconds:,.1f} s to render "
                f"the first {self.conversations:,} conversations ({self.messages:,} messages), "
                f"more than the {allowed:,.1f} s tessel allows them ({TOTAL_SECONDS:g} s + "
                f"{1000 * SECONDS_PER_MESSAGE:g} ms a message; a real template needs well under "
                "1 ms a message); use a faster data.chat_template")
        limit = TOTAL_CHARS + TEXT_FACTOR * self.text + CHARS_PER_MESSAGE * self.messages
        if self.rendered > limit:
            raise DataError(
                f"the chat template ({self.origin}) wrote {self.rendered:,} characters for the "
                f"first {self.conversations:,} conversations, more than the {limit:,} tessel "
                f"allows them ({TOTAL_CHARS // 2**20} Mi + {TEXT_FACTOR} times their text + "
                f"{CHARS_PER_MESSAGE:,} a message), which would all be held in memory; use a "
                "data.chat_template that writes the conversations, not more")
        self.tick(f"{self.conversations:,} conversations rendered ({self._mb()})")
