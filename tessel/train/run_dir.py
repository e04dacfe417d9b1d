"""RunDir: the one owner of a run directory's file names and layout.

    RUN/
      config.toml  run.json  tokenizer.json  tokenizer_config.json (fine-tuning: the chat
      template)  metrics.jsonl  events.jsonl
      HALTED.json  skipped_batches.json  hf-export.log  watchdog/
      checkpoints/step_XXXXXXXX/ ... latest -> step_XXXXXXXX

Everything in tessel that needs one of these paths asks a RunDir for it, so the names are
written once.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from tessel.checkpoint.store import CHECKPOINTS_DIR, latest_checkpoint
from tessel.errors import TesselError
from tessel.fileio import write_text_atomic


class RunDirBusy(TesselError):
    """Another process holds the run directory's lock."""


class RunDir:
    """A run directory (it need not exist yet)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock_fd: int | None = None

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    # ---- names --------------------------------------------------------------------------

    @property
    def config(self) -> Path:
        """The fully resolved config (every preset field written out)."""
        return self.path / "config.toml"

    @property
    def run_info(self) -> Path:
        """Where the run (or its latest resumption) ran: world size, device, layout."""
        return self.path / "run.json"

    @property
    def tokenizer(self) -> Path:
        return self.path / "tokenizer.json"

    @property
    def tokenizer_config(self) -> Path:
        """A fine-tuning run's chat template and its token strings, in Hugging Face's shape
        beside tokenizer.json (`tessel.data.chat_files`): what exports write."""
        return self.path / "tokenizer_config.json"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def events(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def halted_marker(self) -> Path:
        """Present while a run is paused or stopped on purpose (an alert's action)."""
        return self.path / "HALTED.json"

    @property
    def skipped_batches(self) -> Path:
        return self.path / "skipped_batches.json"

    @property
    def hf_export_log(self) -> Path:
        return self.path / "hf-export.log"

    @property
    def watchdog(self) -> Path:
        return self.path / "watchdog"

    @property
    def lock_file(self) -> Path:
        """Locked (flock) by the one process that writes the run: a second `tessel train`
        or `--resume` of it is refused. The kernel releases it when that process ends,
        however it ends."""
        return self.path / ".lock"

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS_DIR

    @property
    def latest_link(self) -> Path:
        return self.checkpoints / "latest"

    # ---- state --------------------------------------------------------------------------

    def lock(self) -> None:
        """Take the run directory's lock for the rest of this process (creating the
        directory); RunDirBusy, naming the holder, if another process has it."""
        if self._lock_fd is not None:
            return
        import fcntl

        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 4096).decode(errors="replace").strip() or "unknown process"
            os.close(fd)
            raise RunDirBusy(
                f"{str(self.path)!r} is in use by another tessel process ({holder}); wait for "
                "it to finish or stop it, then try again"
            ) from None
        self._lock_fd = fd

    def _stamp_lock(self) -> None:
        """Name this process in the lock file (for the message another process gets); only
        once the run really starts, so a refused start leaves the directory as it was."""
        import socket

        if self._lock_fd is None:
            return
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                                 f"{time.strftime('%Y-%m-%d %H:%M:%S')}".encode(), 0)

    def __del__(self) -> None:
        self.unlock()

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    def holds_run(self) -> bool:
        """Whether a run was started here (a new run must not reuse the directory)."""
        return self.config.exists() or self.checkpoints.exists()

    def latest_checkpoint(self) -> Path | None:
        return latest_checkpoint(self.checkpoints)

    def halted(self) -> dict[str, Any] | None:
        """The marker of a run that paused or stopped on purpose, or None."""
        if not self.halted_marker.is_file():
            return None
        try:
            return json.loads(self.halted_marker.read_text())
        except (OSError, json.JSONDecodeError):
            return {"message": "was halted"}

    def write_halted(self, code: int, message: str, step: int) -> None:
        write_text_atomic(self.halted_marker, json.dumps(
            {"message": message, "exit_code": code, "step": step, "time": time.time()}))

    def write_start(self, config_toml: str, run_info: dict[str, Any], save_tokenizer: Any,
                    tokenizer_config: dict[str, Any] | None = None) -> None:
        """What a starting (or resuming) run writes before its first step; an explicit
        resume clears a halted marker. `save_tokenizer(path)` writes the tokenizer;
        `tokenizer_config`: a fine-tuning run's chat template (`run_tokenizer_config`)."""
        self.path.mkdir(parents=True, exist_ok=True)
        self._stamp_lock()
        write_text_atomic(self.config, config_toml)
        write_text_atomic(self.run_info, json.dumps(run_info, indent=1))
        save_tokenizer(self.tokenizer)
        if tokenizer_config is not None:
            write_text_atomic(self.tokenizer_config, json.dumps(tokenizer_config, indent=1))
        self.halted_marker.unlink(missing_ok=True)
