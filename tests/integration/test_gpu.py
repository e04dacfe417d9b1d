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
    assert trainer.optimizers[0].defaults["fused"] is True
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


def _fp8_capable() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        return False
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _fp8_capable(), reason="needs an FP8 GPU (sm 8.9+) and torchao")
def test_fp8_loss_curve_follows_bf16(tiny_config):
    # Dimensions divisible by 16 so the linears really run in float8.
    common = {"train.steps": 30, "train.device": "cuda", "train.precision": "bf16",
              "model.d_model": 128, "model.n_heads": 4, "train.seq_len": 64}
    bf16 = tiny_config("bf16", **common)
    fp8 = tiny_config("fp8", **common, **{"train.fp8": True})
    Trainer(bf16, console=False).train()
    trainer = Trainer(fp8, console=False)
    assert any(type(m).__name__ == "Float8Linear" for m in trainer.model.inner[0].modules())
    trainer.train()
    lb, lf = _losses(bf16.run.dir), _losses(fp8.run.dir)
    assert lf[30] < lf[1] - 0.5  # it learns
    assert abs(lf[30] - lb[30]) / lb[30] < 0.05  # and follows bf16's curve


def test_bench_on_cuda_reports_mfu_memory_and_the_planner(tmp_path):
    from tessel.bench import run_bench
    from tessel.config import Config

    cfg = Config.load(None, {"model.preset": "gpt2-124m", "train.seq_len": 512,
                             "train.micro_batch_size": 4, "train.global_batch_size": 4,
                             "train.device": "cuda"})
    r = run_bench(cfg, warmup=3, steps=5)
    assert r["tokens_per_s"] > 0 and r["memory_gib"]["mem_peak_gib"] > 0
    assert 0 < r["mfu_vs_matmul"] < 1.2
    if r["peak_tflops_bf16"] is not None:
        assert 0 < r["mfu"] < 1
    # the planner's allocated-memory prediction is in the same range as the measured peak
    assert 0.5 < r["planner"]["allocated"] / r["memory_gib"]["mem_peak_gib"] < 2


def test_exposed_communication_is_read_from_the_gpu_timeline(tiny_config):
    """The CUDA path of tessel/observe/comm.py: a profile of the GPU alone yields its kernels
    (copies left out), and a one-GPU run's sampled steps read no communication."""
    from torch.profiler import ProfilerActivity, profile

    from tessel.observe.comm import gpu_kernels, split_gpu_step

    x = torch.randn(1024, 1024, device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        (x @ x).cpu()
    kernels = gpu_kernels(prof)
    assert kernels and all(k.kernel and k.end > k.start for k in kernels)
    assert not any(k.name.startswith("Memcpy") for k in kernels)
    assert split_gpu_step(kernels).total_s == 0.0  # no NCCL kernel
    cfg = tiny_config(**{"train.steps": 4, "train.device": "cuda",
                         "metrics.comm_sample_interval": 2})
    Trainer(cfg, console=False).train()
    sampled = [r for r in read_metrics(Path(cfg.run.dir) / "metrics.jsonl")
               if "time_comm_exposed_s" in r]
    assert [r["step"] for r in sampled] == [2, 4]
    assert all(r["time_comm_s"] == r["time_comm_exposed_s"] == 0.0 for r in sampled)
