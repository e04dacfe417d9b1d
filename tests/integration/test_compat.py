"""A run directory written by an earlier tessel (tests/data/run_v0_1, made by
tests/data/make_run_v0_1.py at commit 3fadffb) resumes on today's code with the losses and
weights the earlier code produced.

The resume runs in its own process with one intra-op thread and PyTorch's plain (unvectorised)
CPU kernels, as the expected figures were taken. Even so the last bits of float32 results
differ between processors (an Intel Xeon and an AMD EPYC give the same losses and other last
bits of the weights), so the weights are compared with a tolerance: 1e-5, far below what
one wrong resumed step moves them (the test checks that margin too), far above float32
rounding over two steps (the same code with AVX2 kernels instead of the pinned ones
differs from the stored weights by 2.7e-7 at most). Losses likewise, to 1e-5 relative."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import write_corpus
from safetensors.torch import load_file

from tessel.checkpoint import latest_checkpoint, read_full
from tessel.observe.metrics import read_metrics

DATA = Path(__file__).resolve().parents[1] / "data"
# What commit 3fadffb wrote when it resumed the same directory to step 5 (OMP_NUM_THREADS=1,
# ATEN_CPU_CAPABILITY=default, on an AMD EPYC): its losses, and its step-5 weights in
# run_v0_1_step5.safetensors (their sha256 digest, as make_run_v0_1.py prints it, is
# 20345b7b1484f1d7f047620b7905c0ef168fb59814ae8af74de893db0610293e).
OLD_LOSSES = {1: 6.230032920837402, 2: 6.01629638671875, 3: 5.865791320800781,
              4: 5.831308364868164, 5: 5.755513668060303}
PINNED = {"OMP_NUM_THREADS": "1", "ATEN_CPU_CAPABILITY": "default"}
WEIGHT_ATOL = 1e-5


def test_an_old_run_directory_resumes_exactly(tmp_path: Path):
    run = tmp_path / "run"
    shutil.copytree(DATA / "run_v0_1", run, symlinks=True)
    corpus = write_corpus(tmp_path / "corpus", n_docs=4, words_per_doc=200)  # same documents
    before = read_full(latest_checkpoint(run / "checkpoints"), "model")  # step 3, as shipped
    proc = subprocess.run(
        [sys.executable, "-m", "tessel", "train", "--resume", str(run), "--train.steps=5",
         "--quiet", f"--data.paths=['{corpus}']"],
        env={**os.environ, **PINNED}, cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    losses = {m["step"]: m["loss"] for m in read_metrics(run / "metrics.jsonl") if "loss" in m}
    assert losses.keys() == OLD_LOSSES.keys()
    assert losses == {k: pytest.approx(v, rel=1e-5, abs=0) for k, v in OLD_LOSSES.items()}
    weights = read_full(latest_checkpoint(run / "checkpoints"), "model")
    # The tied output projection is now saved once, as the embedding (0.1's held both).
    assert "output.weight" not in weights
    expected = load_file(DATA / "run_v0_1_step5.safetensors")
    assert weights.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=WEIGHT_ATOL, msg=name)
    # The tolerance tells steps apart: the two resumed steps moved the weights by far more.
    moved = max((expected[n] - before[n]).abs().max().item() for n in expected)
    assert moved > 100 * WEIGHT_ATOL
