"""A save in flight and how a save fails: an asynchronous save's future (DCP's write, then
this rank's checksums), and any write failure turned into one line with the partial save
removed."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from tessel.checkpoint.errors import CheckpointError, short
from tessel.errors import TesselError


def then(future: Future, after: Any) -> Future:
    """A future that completes once `future` has and `after()` has run (in the thread that
    completed it), carrying either's exception."""
    chained: Future = Future()

    def run(done: Future) -> None:
        try:
            done.result()
            after()
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits (DCP's is one)
            chained.set_exception(exc)
        else:
            chained.set_result(None)

    future.add_done_callback(run)
    return chained


@dataclass
class PendingSave:
    """An asynchronous save in flight; `finish()` waits for it and publishes it."""

    future: Future | None
    publish: Any  # () -> Path
    tmp: Path | None = None  # the temporary directory, removed if the save fails
    step: int = 0

    def done(self) -> bool:
        return self.future is None or self.future.done()

    def finish(self, barrier: Any = None) -> Path:
        """Wait for this rank's writing and hashing; after `barrier` (every rank's, when
        several write) rank 0 publishes."""
        with failed_save_is_one_line(self.tmp, self.step):
            if self.future is not None:
                self.future.result()
            if barrier is not None:
                barrier()  # every rank's checksums are written before rank 0 gathers them
            return self.publish()


class CheckpointWriteError(CheckpointError):
    """A save could not be written (disk full, unwritable directory); the checkpoints
    saved before are intact and the temporary directory is removed."""


@contextlib.contextmanager
def failed_save_is_one_line(tmp: Path | None, step: int) -> Iterator[None]:
    """A failed save (disk full, ...) removes its temporary directory and becomes one line;
    a Ctrl-C during it (DCP wraps it in a CheckpointException) stays a KeyboardInterrupt."""
    try:
        yield
    except (Exception, KeyboardInterrupt, CheckpointException) as exc:
        cause = _root_cause(exc)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(cause, KeyboardInterrupt):
            raise KeyboardInterrupt from None
        if isinstance(cause, TesselError):
            raise
        where = tmp.parent if tmp is not None else "the run directory"
        raise CheckpointWriteError(
            f"could not save the checkpoint of step {step} in {where}: {_describe(cause)}; "
            "the checkpoints saved before are intact"
        ) from None


def _root_cause(exc: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's wrapper (recursively)."""
    while isinstance(exc, CheckpointException) and exc.failures:
        exc = next(iter(exc.failures.values()))[0]
    return exc


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror + (f" ({exc.filename})" if exc.filename else "")
    lines = str(exc).strip().splitlines()
    return short(lines[-1] if lines else type(exc).__name__)
