"""`tessel bench` on the CPU: the same code path as on a GPU, CI-sized."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tessel import Config, TesselError, Trainer
from tessel.cli import main as tessel_main
from tessel.models import flops_per_token

SMALL = ["--model.preset=tiny", "--train.seq_len=64", "--train.micro_batch_size=4",
         "--train.global_batch_size=8"]


def test_bench_times_the_trainer_step_and_writes_json_the_planner_can_calibrate_from(
        tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert tessel_main(["bench", *SMALL, "--warmup", "2", "--steps", "6", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())
    st = r["step_time_s"]
    assert st["min"] <= st["median"] <= st["max"] and r["timed_steps"] == 6
    assert r["tokens_per_s"] == pytest.approx(8 * 64 / st["median"])
    cfg = Config.from_dict(r["config"])
    assert r["flops_per_token"] == flops_per_token(cfg.model, 64)
    assert r["tflops"] == pytest.approx(r["flops_per_token"] * r["tokens_per_s"] / 1e12)
    assert r["mfu"] is None and "MFU               unknown" in printed  # no CPU peak: no guess
    assert 0 < r["mfu_vs_matmul"] and r["matmul"]["dtype"] == "float32"
    assert r["memory_gib"]["mem_rss_peak_gib"] > 0 and r["planner"]["total"] > 0
    assert r["accumulation"] == 2 and r["precision"] == "fp32"
    assert f"wrote {out}" in printed
    # The file calibrates the planner's matmul efficiency (tessel plan --calibrate).
    assert tessel_main(["plan", "--calibrate", str(out), "--gpus", "1", "--model.preset=tiny"]) == 0


def test_bench_refuses_bad_options(capsys):
    assert tessel_main(["bench", "--steps", "x"]) == 2
    assert "--steps takes a whole number" in capsys.readouterr().err
    assert tessel_main(["bench", "--frobnicate"]) == 2


def test_fp8_is_refused_without_fp8_hardware(tiny_config, capsys):
    # unemulated (on a CPU train.fp8 is emulated unless train.fp8_emulate = false)
    cfg = tiny_config(**{"train.fp8": True, "train.device": "cpu", "train.fp8_emulate": False})
    with pytest.raises(TesselError, match="train.fp8 needs an NVIDIA GPU with FP8 tensor cores"):
        Trainer(cfg, console=False)
    assert not Path(cfg.run.dir).exists()
    assert tessel_main(["bench", *SMALL, "--fp8", "--train.device=cpu",
                        "--train.fp8_emulate=false"]) == 2
    assert "FP8 tensor cores" in capsys.readouterr().err
