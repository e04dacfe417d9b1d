"""The loss over pieces of the tokens (parallel.loss_chunks) equals the whole loss under tensor
parallelism, on vocabulary-sharded logits, with and without sequence parallelism: loss and
every gradient within 1e-6 (fp32). One 2-process gloo job (chunked_loss_worker.py); whole
runs under tp2 with pieces: tests/distributed/test_layouts.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from script_job import run_script_job

WORKER = Path(__file__).with_name("chunked_loss_worker.py")


@pytest.mark.budget(40)
def test_the_loss_in_pieces_equals_the_whole_loss_under_tp2(tmp_path: Path):
    out = tmp_path / "errors.json"
    errors = run_script_job(WORKER, 2, out)
    assert set(errors) == {f"sp={sp}-chunks={c}" for sp in (True, False) for c in (3, 64)}
    for case, err in errors.items():
        assert err["loss"] < 1e-6 and err["grads"] < 1e-6, (case, err)
