"""parallel.async_tp on GPUs: micro-pipelined tensor parallelism trains as plain tensor
parallelism does (same losses to bf16 tolerance). Needs two GPUs (a tensor-parallel group);
skipped cleanly with fewer. The refusals are tested on CPU (tests/unit/test_async_tp.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import tiny_overrides

from tessel.cli import main
from tessel.observe.metrics import read_metrics

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2,
                       reason="async TP needs 2 GPUs (a tensor-parallel group of two)"),
]


def _argument(key: str, value: object) -> str:
    if isinstance(value, bool):
        return f"--{key}={'true' if value else 'false'}"
    if isinstance(value, list):
        return f"--{key}=[" + ", ".join(f"'{v}'" for v in value) + "]"
    if isinstance(value, str):
        return f"--{key}='{value}'"
    return f"--{key}={value}"


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r}


def test_async_tp_trains_as_plain_tensor_parallelism(tmp_path, corpus):
    # dimensions that split into multiples of 16 over two ranks
    common = {"train.device": "cuda", "train.precision": "bf16", "train.compile": True,
              "parallel.tp": 2, "model.d_model": 128, "train.seq_len": 64, "train.steps": 10}
    for name, async_tp in (("plain", False), ("async", True)):
        overrides = tiny_overrides(tmp_path / name, corpus, **common,
                                   **{"parallel.async_tp": async_tp})
        argv = [_argument(k, v) for k, v in overrides.items()]
        assert main(["train", "--nproc", "2", "--quiet", *argv]) == 0
    plain, pipelined = _losses(tmp_path / "plain"), _losses(tmp_path / "async")
    assert set(plain) == set(pipelined) and len(plain) == 10
    for step, loss in plain.items():
        assert pipelined[step] == pytest.approx(loss, rel=2e-2), step
