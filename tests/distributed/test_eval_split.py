"""The validation loss when train.eval_iters does not split evenly over the data-parallel
ranks (or into whole pipeline steps): every layout evaluates exactly the single-process run's
first eval_iters micro-batches, so val_loss is the single-process figure (CPU/gloo, one
torchrun job of 2 processes: data parallel, pipeline parallel)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import tiny_overrides, write_corpus
from test_layouts import job_output, torchrun

from tessel.config import Config
from tessel.observe.metrics import read_metrics
from tessel.train import Trainer

pytestmark = pytest.mark.slow
UNEVEN = {"train.steps": 1, "train.eval_iters": 3}
"""3 micro-batches of 4 sequences: 2 + 1 over two data-parallel ranks, 3 of the 2 x 2 a
pipeline of two steps of 2 micro-batches runs."""


def _val_loss(run: Path) -> float:
    return next(r["val_loss"] for r in read_metrics(run / "metrics.jsonl") if "val_loss" in r)


@pytest.mark.budget(60)  # seconds on the reference machine: estimated
def test_an_uneven_split_of_eval_iters_gives_the_single_process_val_loss(tmp_path: Path):
    corpus = write_corpus(tmp_path / "corpus")
    reference = Config.load(None, tiny_overrides(tmp_path / "ref", corpus, **UNEVEN))
    Trainer(reference, console=False).train()
    layouts = {"dp2": {"parallel.zero": 0}, "pp2": {"parallel.pp": 2}}
    spec = {"runs": [{"overrides": tiny_overrides(tmp_path / name, corpus, **UNEVEN, **layout)}
                     for name, layout in layouts.items()]}
    proc = torchrun(2, spec, tmp_path, timeout=600)
    assert proc.returncode == 0, job_output(proc)
    want = _val_loss(tmp_path / "ref")
    for name in layouts:
        assert _val_loss(tmp_path / name) == pytest.approx(want, rel=1e-5), name
