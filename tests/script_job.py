"""A standalone torchrun job of one worker script, for the tests that check a parallel piece
against one process inside a single gloo job (the worker writes its findings as JSON)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_script_job(script: Path, nproc: int, out: Path, timeout: float = 300) -> dict:
    """Run `script OUT` on `nproc` local processes (one thread each); return the JSON it wrote
    to `out`, or fail with the job's stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={nproc}", str(script), str(out)],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())
