"""The test session's own set-up (tests/conftest.py `_write_bytecode`): every process it
starts writes the bytecode of the modules it imports, even where the machine sets
PYTHONDONTWRITEBYTECODE, so that the README's `pip install --no-compile` costs each module one
compile per session, not one per process (~300 processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_processes_the_session_starts_write_bytecode(tmp_path: Path):
    assert "PYTHONDONTWRITEBYTECODE" not in os.environ
    assert sys.dont_write_bytecode is False
    (tmp_path / "probe_module.py").write_text("VALUE = 1\n")
    proc = subprocess.run([sys.executable, "-c", "import probe_module"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert list((tmp_path / "__pycache__").glob("probe_module.*.pyc"))
