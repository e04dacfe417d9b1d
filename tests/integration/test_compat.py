"""A run directory written by an earlier tessel (tests/data/run_v0_1, made by
tests/data/make_run_v0_1.py at commit 3fadffb) resumes on today's code with the losses and
weights the earlier code produced.

The resume runs in its own process with one intra-op thread and PyTorch's plain (unvectorised)
CPU kernels: the expected figures were taken that way from commit 3fadffb, and another thread
count or instruction set (AVX-512 or AVX2, chosen per machine) changes the summation order
(the last bits of the weights), which is not what this test is about."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import write_corpus

from tessel.checkpoint import latest_checkpoint, read_full
from tessel.observe.metrics import read_metrics

DATA = Path(__file__).resolve().parents[1] / "data" / "run_v0_1"
# What commit 3fadffb wrote when it resumed the same directory to step 5 (OMP_NUM_THREADS=1,
# ATEN_CPU_CAPABILITY=default; taken again on 2026-11-25 because the digest first recorded,
# without the pinned kernels, held only on machines with the same instruction set).
OLD_LOSSES = {1: 6.230032920837402, 2: 6.01629638671875, 3: 5.865791320800781,
              4: 5.831308364868164, 5: 5.755513668060303}
OLD_DIGEST = "20345b7b1484f1d7f047620b7905c0ef168fb59814ae8af74de893db0610293e"
PINNED = {"OMP_NUM_THREADS": "1", "ATEN_CPU_CAPABILITY": "default"}


def test_an_old_run_directory_resumes_exactly(tmp_path: Path):
    run = tmp_path / "run"
    shutil.copytree(DATA, run, symlinks=True)
    corpus = write_corpus(tmp_path / "corpus", n_docs=4, words_per_doc=200)  # same documents
    proc = subprocess.run(
        [sys.executable, "-m", "tessel", "train", "--resume", str(run), "--train.steps=5",
         "--quiet", f"--data.paths=['{corpus}']"],
        env={**os.environ, **PINNED}, cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    losses = {m["step"]: m["loss"] for m in read_metrics(run / "metrics.jsonl") if "loss" in m}
    assert losses == OLD_LOSSES
    weights = read_full(latest_checkpoint(run / "checkpoints"), "model")
    # The tied output projection is now saved once, as the embedding (0.1's held both).
    assert "output.weight" not in weights
    weights["output.weight"] = weights["tok_embeddings.weight"]
    digest = hashlib.sha256()
    for name in sorted(weights):
        digest.update(name.encode())
        digest.update(weights[name].contiguous().numpy().tobytes())
    assert digest.hexdigest() == OLD_DIGEST
