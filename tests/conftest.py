"""Shared fixtures: a small learnable text corpus and tiny configs that train in seconds."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from tessel.config import Config

# Two threads: the CI machine has two cores, and results must not depend on the host.
torch.set_num_threads(min(2, os.cpu_count() or 1))

_WORDS = (
    "the model reads tokens and predicts the next token from the past while the optimizer "
    "updates weights with gradients computed by backpropagation through every layer"
).split()


def write_corpus(root: Path, n_docs: int = 12, words_per_doc: int = 400, seed: int = 0) -> Path:
    """Deterministic English-like documents with learnable structure (a small vocabulary
    in mostly fixed phrases), enough for a tiny model to beat the unigram baseline fast."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for d in range(n_docs):
        words = []
        while len(words) < words_per_doc:
            start = rng.randrange(len(_WORDS) - 6)
            words += _WORDS[start : start + rng.randint(3, 6)] + ["."]
        (root / f"doc{d:03d}.txt").write_text(" ".join(words) + "\n")
    return root


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    # One tokenized-corpus cache per test session, never the user's ~/.cache.
    monkeypatch.setenv("TESSEL_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus")


def tiny_overrides(run_dir: Path, corpus_dir: Path, **extra) -> dict:
    """Overrides for a tiny model on `corpus_dir` that trains a step in milliseconds."""
    base = {
        "model.preset": "tiny",
        "data.source": "files",
        "data.paths": [str(corpus_dir)],
        "data.tokenizer": "bytes",
        "data.split": "90,10",
        "train.steps": 8,
        "train.seq_len": 32,
        "train.micro_batch_size": 4,
        "train.global_batch_size": 8,
        "train.eval_interval": 0,
        "train.eval_iters": 2,
        "optim.lr": 3e-3,
        "optim.warmup_steps": 2,
        "checkpoint.interval": 0,
        "metrics.log_interval": 1,
        "metrics.tensorboard": False,
        "run.dir": str(run_dir),
        "run.sample_tokens": 0,
    }
    base.update(extra)
    return base


@pytest.fixture
def tiny_config(tmp_path: Path, corpus: Path):
    def make(run_name: str = "run", **extra) -> Config:
        return Config.load(None, tiny_overrides(tmp_path / run_name, corpus, **extra))

    return make


def forge_state(path: Path) -> None:
    """Make a checkpoint's state.json agree with its files as they are now (sizes and
    checksums), as an attacker who controls the whole directory would."""
    from tessel.checkpoint.checksum import DIGEST_KEY, file_digests

    state = json.loads((path / "state.json").read_text())
    state["files"] = {f: (path / f).stat().st_size for f in state["files"]}
    state[DIGEST_KEY] = file_digests([path / f for f in state["files"]])
    state.pop("state_sha256", None)  # its self-checksum: an attacker drops it too
    (path / "state.json").write_text(json.dumps(state))
