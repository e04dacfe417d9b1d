"""A run directory written by an earlier tessel (tests/data/run_v0_1, made by
tests/data/make_run_v0_1.py at commit 3fadffb) resumes on today's code with the losses and
weights the earlier code produced."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from tessel.checkpoint import latest_checkpoint, read_full
from tessel.cli import main
from tessel.observe.metrics import read_metrics
from tests.conftest import write_corpus

DATA = Path(__file__).resolve().parents[1] / "data" / "run_v0_1"
# What commit 3fadffb printed when it resumed the same directory to step 5.
OLD_LOSSES = {1: 6.230032920837402, 2: 6.01629638671875, 3: 5.865791320800781,
              4: 5.831308364868164, 5: 5.755513668060303}
OLD_DIGEST = "56d33fa9d71d21fdf5d8792c51ff4cf533590889f2d274c814ea2ae3baeb007f"


def test_an_old_run_directory_resumes_exactly(tmp_path: Path):
    run = tmp_path / "run"
    shutil.copytree(DATA, run, symlinks=True)
    corpus = write_corpus(tmp_path / "corpus", n_docs=4, words_per_doc=200)  # same documents
    code = main(["train", "--resume", str(run), "--train.steps=5", "--quiet",
                 f"--data.paths=['{corpus}']"])
    assert code == 0
    losses = {m["step"]: m["loss"] for m in read_metrics(run / "metrics.jsonl") if "loss" in m}
    assert losses == OLD_LOSSES
    weights = read_full(latest_checkpoint(run / "checkpoints"), "model")
    digest = hashlib.sha256()
    for name in sorted(weights):
        digest.update(name.encode())
        digest.update(weights[name].contiguous().numpy().tobytes())
    assert digest.hexdigest() == OLD_DIGEST
