"""Hugging Face copies written during training (`checkpoint.hf_export_interval`).

Rank 0 exports a checkpoint once it is published, in a separate process (`python -m tessel
convert tessel-to-hf CKPT CKPT/hf`) that reads it from disk, so training never waits for the
export and no collective times out behind it. One export runs at a time: the next save waits
for the previous export first, so pruning never removes a checkpoint being exported. The
export itself is atomic (written aside, then renamed to CKPT/hf); its output goes to
RUN_DIR/hf-export.log, and a failure is reported, not fatal.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path


class HFExporter:
    def __init__(self, interval: int, log: Path, say: Callable[[str], None],
                 peft: bool = False, drop_expert_bias: bool = False):
        """`peft`: export a LoRA run's adapters as a peft directory (lora.export);
        `drop_expert_bias`: checkpoint.hf_export_drop_expert_bias."""
        self.interval = interval
        self.peft = peft
        self.options = (["--peft"] if peft else
                        ["--drop-expert-bias"] if drop_expert_bias else [])
        self.log = log
        self.say = say
        self._running: tuple[subprocess.Popen, Path] | None = None

    def after_publish(self, ckpt: Path, step: int) -> None:
        """Start the export of checkpoint `ckpt` (of `step`) if the interval asks for it."""
        if not self.due(step):
            return
        self.wait()
        with open(self.log, "a") as log:
            proc = subprocess.Popen(self.command(ckpt), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        self._running = (proc, ckpt)

    def due(self, step: int) -> bool:
        """Whether the checkpoint of optimizer step `step` is exported (every `interval`)."""
        return bool(self.interval and step % self.interval == 0)

    def command(self, ckpt: Path) -> list[str]:
        """The export of checkpoint `ckpt`: `tessel convert tessel-to-hf` (into CKPT/hf) as
        a user would run it, with the run's export options."""
        return [sys.executable, "-m", "tessel", "convert", "tessel-to-hf", str(ckpt),
                str(ckpt / "hf"), *self.options]

    def wait(self) -> None:
        """Let a running export finish (before the next save, and at the end of training)."""
        if self._running is None:
            return
        proc, ckpt = self._running
        self._running = None
        if proc.wait() != 0:
            self.say(f"tessel: warning: the Hugging Face export of {ckpt} failed (exit code "
                     f"{proc.returncode}); see {self.log}")
