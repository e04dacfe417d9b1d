"""The loss over pieces of the tokens (parallel.loss_chunks) equals the whole loss under tensor
parallelism, on vocabulary-sharded logits, with and without sequence parallelism: loss and
every gradient within 1e-6 (fp32). One 2-process gloo job (chunked_loss_worker.py); whole
runs under tp2 with pieces: tests/distributed/test_layouts.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("chunked_loss_worker.py")


@pytest.mark.budget(40)
def test_the_loss_in_pieces_equals_the_whole_loss_under_tp2(tmp_path: Path):
    out = tmp_path / "errors.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(WORKER), str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = json.loads(out.read_text())
    assert set(errors) == {f"sp={sp}-chunks={c}" for sp in (True, False) for c in (3, 64)}
    for case, err in errors.items():
        assert err["loss"] < 1e-6 and err["grads"] < 1e-6, (case, err)
