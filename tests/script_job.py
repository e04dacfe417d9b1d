"""A standalone torchrun job of one worker script, for the tests that check a parallel piece
against one process inside a single gloo job (the worker writes its findings as JSON)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path


def native_crash(proc: subprocess.CompletedProcess) -> bool:
    """Whether a rank of the job died of a native crash (SIGABRT, SIGSEGV: C++ code aborted)
    rather than exiting with an error of its own."""
    return proc.returncode != 0 and ("Fatal Python error" in proc.stderr
                                     or "(SIGABRT)" in proc.stderr or "(SIGSEGV)" in proc.stderr)


def torchrun_job(nproc: int, args: list[str], timeout: float,
                 start_over: Callable[[], None] | None,
                 describe: Callable[[subprocess.CompletedProcess], str] = lambda p: p.stderr[-3000:],
                 ) -> subprocess.CompletedProcess:
    """Run `args` (a script and its arguments) under torchrun on `nproc` local processes, one
    thread each. A job one of whose ranks died of a native crash runs once more after
    `start_over()` has removed what it wrote (None: a job that cannot start over is not
    rerun): gloo's TCP transport on a loaded 2-core machine aborts a rank about once in a
    dozen full suites (SIGABRT in a C++ thread mid tensor-parallel backward, or "terminate
    called without an active exception") and never did when rerun (20 runs of that layout
    under a CPU load). The crash is shown as a warning (`describe` of the job), so it stays
    visible; a second one is the job's result, and fails its test."""
    for attempt in (1, 2):
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc-per-node={nproc}", *args],
            capture_output=True, text=True, timeout=timeout,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        if attempt == 2 or start_over is None or not native_crash(proc):
            break
        warnings.warn(f"torchrun job {' '.join(args)}: a rank crashed natively; running it once "
                      f"more from scratch:\n{describe(proc)}", stacklevel=3)
        start_over()
    return proc


def run_script_job(script: Path, nproc: int, out: Path, timeout: float = 300) -> dict:
    """Run `script OUT` on `nproc` local processes (`torchrun_job`: once more after a native
    crash); return the JSON it wrote to `out`, or fail with the job's stderr."""
    proc = torchrun_job(nproc, [str(script), str(out)], timeout,
                        start_over=lambda: out.unlink(missing_ok=True))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())
