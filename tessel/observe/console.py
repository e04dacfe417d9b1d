"""What a person sees: a live progress line on a terminal, plain log lines otherwise.

`CI=true` or a stdout that is not a TTY selects plain lines (logs stay readable); rank 0
alone prints.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn


def _interactive() -> bool:
    return sys.stdout.isatty() and os.environ.get("CI", "").lower() not in ("1", "true")


def format_duration(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class ConsoleDisplay:
    def __init__(self, total_steps: int, enabled: bool = True):
        self.enabled = enabled
        self.console = Console(highlight=False)
        self._progress: Progress | None = None
        self._task = None
        if enabled and _interactive():
            self._progress = Progress(
                TextColumn("[bold]step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("{task.fields[status]}"),
                console=self.console,
                transient=True,
            )
            self._task = self._progress.add_task("train", total=total_steps, status="")

    def start(self, step: int) -> None:
        if self._progress is not None:
            self._progress.start()
            self._progress.update(self._task, completed=step)

    def step(self, step: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def log(self, rec: dict[str, Any], total_steps: int, eta_s: float, planned_pct: float) -> None:
        if not self.enabled:
            return
        parts = [f"step {rec['step']}/{total_steps}"]
        if "val_loss" in rec:
            parts.append(f"val_loss {rec['val_loss']:.4f} val_ppl {rec['val_ppl']:.2f}")
        else:
            parts += [
                f"loss {rec['loss']:.4f}",
                f"lr {rec['lr']:.2e}",
                f"gnorm {rec['grad_norm']:.2f}",
                f"{rec['tokens_per_s']:,.0f} tok/s",
            ]
            # MFU needs the device's dense BF16 peak; an unknown device says so.
            mfu = rec.get("mfu")
            parts.append(f"MFU {100 * mfu:.1f}%" if mfu is not None else "MFU unknown")
            parts.append(f"ETA {format_duration(eta_s)}")
            parts.append(f"{planned_pct:.0f}% of tokens")
            if self._progress is not None:
                self._progress.update(self._task, status=" | ".join(parts[1:]))
        self.print(" | ".join(parts))

    def print(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, markup=False, soft_wrap=True)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
