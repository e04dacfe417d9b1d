"""A standalone torchrun job of one worker script, for the tests that check a parallel piece
against one process inside a single gloo job (the worker writes its findings as JSON)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path


def native_crash(proc: subprocess.CompletedProcess) -> bool:
    """Whether a rank of the job died of a native crash (SIGABRT, SIGSEGV: C++ code aborted)
    rather than exiting with an error of its own."""
    return proc.returncode != 0 and ("Fatal Python error" in proc.stderr
                                     or "(SIGABRT)" in proc.stderr or "(SIGSEGV)" in proc.stderr)


def run_script_job(script: Path, nproc: int, out: Path, timeout: float = 300) -> dict:
    """Run `script OUT` on `nproc` local processes (one thread each); return the JSON it wrote
    to `out`, or fail with the job's stderr. A job one of whose ranks died of a native crash
    runs once more, as test_layouts' jobs do (docs/testing.md: gloo's TCP transport aborts a
    rank about once in a dozen full suites; seen here as "terminate called without an active
    exception" in a tensor-parallel job), with the crash shown as a warning; a second crash
    fails the test."""
    for attempt in (1, 2):
        out.unlink(missing_ok=True)
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc-per-node={nproc}", str(script), str(out)],
            capture_output=True, text=True, timeout=timeout,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        if attempt == 2 or not native_crash(proc):
            break
        warnings.warn(f"torchrun job of {script.name}: a rank crashed natively; running it once "
                      f"more:\n{proc.stderr[-3000:]}", stacklevel=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())
