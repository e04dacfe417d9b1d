"""The CUDA paths of the same code (skipped cleanly on machines without a GPU)."""

from pathlib import Path

import pytest
import torch

from tessel import Trainer
from tessel.observe.metrics import read_metrics

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _losses(run: str) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(Path(run) / "metrics.jsonl") if "loss" in r}


def test_cuda_bf16_step_matches_cpu_fp32(tiny_config):
    common = {"train.steps": 3, "model.preset": "tiny-llama", "data.document_mask": True}
    cpu = tiny_config("cpu", **common, **{"train.device": "cpu", "train.precision": "fp32"})
    gpu = tiny_config("gpu", **common, **{"train.device": "cuda", "train.precision": "auto"})
    Trainer(cpu, console=False).train()
    trainer = Trainer(gpu, console=False)
    assert trainer.precision.name == "bf16"  # auto picks bf16 on GPUs that have it
    assert trainer.optimizer.defaults["fused"] is True
    trainer.train()
    lc, lg = _losses(cpu.run.dir), _losses(gpu.run.dir)
    for step in lc:
        assert lg[step] == pytest.approx(lc[step], rel=2e-2)


def test_cuda_fp16_with_loss_scaling_and_compile(tiny_config):
    cfg = tiny_config(**{"train.steps": 4, "train.device": "cuda", "train.precision": "fp16",
                         "train.compile": True})
    result = Trainer(cfg, console=False).train()
    recs = [r for r in read_metrics(Path(cfg.run.dir) / "metrics.jsonl") if "loss" in r]
    assert result.loss == pytest.approx(recs[-1]["loss"]) and recs[-1]["loss_scale"] > 0
    assert recs[-1]["mem_gib"] > 0
