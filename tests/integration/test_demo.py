"""The embedded demo: `tessel train` with no arguments, shortened."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tessel.config import Config
from tessel.data import build_tokenizer
from tessel.data.corpus import load_splits, stdlib_files
from tessel.observe.metrics import read_metrics


def test_stdlib_corpus_is_cached_and_split_by_document(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSEL_CACHE", str(tmp_path))
    cfg = Config().data
    assert len(stdlib_files()) > 100
    splits = load_splits(cfg, build_tokenizer("bytes"), seed=1)
    cached = list(tmp_path.glob("corpus-*/train.npy"))
    assert len(cached) == 1
    again = load_splits(cfg, build_tokenizer("bytes"), seed=2)  # the split ignores the seed
    assert np.array_equal(splits.val, again.val)
    total = len(splits.train) + len(splits.val)
    assert 0.005 < len(splits.val) / total < 0.1
    assert splits.train.dtype == np.uint16 and splits.train.max() <= 256


@pytest.mark.slow
def test_demo_beats_the_unigram_baseline(tmp_path: Path):
    env = {**os.environ, "CI": "true"}
    out = subprocess.run(
        [sys.executable, "-m", "tessel", "train", "--train.steps=150",
         "--train.eval_interval=150", "--checkpoint.interval=0", "--run.sample_tokens=40"],
        cwd=tmp_path, capture_output=True, text=True, env=env, timeout=900,
    )
    assert out.returncode == 0, out.stderr
    run = tmp_path / "runs" / "demo"
    assert "sample:\ndef " in out.stdout
    val = [r for r in read_metrics(run / "metrics.jsonl") if "val_loss" in r]
    baseline = float(out.stdout.split("unigram baseline ")[1].split(")")[0])
    assert val[-1]["step"] == 150
    assert val[-1]["val_loss"] < baseline - 0.5, (val[-1], baseline)
