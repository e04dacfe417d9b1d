"""`tessel plan` and the planner inside `tessel train`, as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

from test_cli import ROOT, assert_one_line_error, tessel_here, train_args

from tessel.planner.hardware import load_profiles

LLAMA_70B = ["--model.preset=llama3-70b", "--train.seq_len=8192", "--train.global_batch_size=1024"]


def test_search_prints_ranked_layouts_with_breakdown_rejections_and_a_launch_line():
    # A vocabulary of 128,255 rows, which no tp > 1 divides: those layouts are rejected.
    out = tessel_here("plan", *LLAMA_70B, "--model.vocab_size=128255", "--model.vocab_pad_to=1",
                 "--gpus", "256", "--gpu", "h100-sxm", "--top", "5")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.startswith("tessel plan: llama3-70b model (70.55B parameters), 256 x h100-sxm")
    rows = [line for line in text.splitlines()
            if line[:4].strip().isdigit() and line[4:6] == "  "]  # (not a rejection count)
    assert len(rows) == 5
    assert "memory GiB/GPU" in text and "parameters" in text and "optimizer" in text
    assert "margin" in text and "step s: compute" in text
    assert "closest layouts that do not fit (short by):" in text and "GiB short" in text
    assert "rejected before evaluation" in text and "is not divisible by tp=2" in text
    assert "run the best: tessel train --nproc 256 " in text
    assert "assumptions:" in text


def test_json_for_one_layout_with_the_documented_fields():
    out = tessel_here("plan", str(ROOT / "configs/llama3-8b.toml"), "--gpus", "8", "--gpu", "a100-80gb",
                 "--parallel.tp=2", "--parallel.pp=2", "--parallel.zero=1", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    [row] = data["layouts"]
    assert (row["tp"], row["pp"], row["dp"], row["cp"], row["zero"]) == (2, 2, 2, 1, 1)
    for key in ("micro_batch", "activation_checkpointing", "step_time_s", "tokens_per_s", "mfu",
                "fits"):
        assert key in row
    assert row["memory_gib"]["total"] > 0 and data["gpu"] == "a100-80gb"


def test_a_layout_that_does_not_fit_names_the_nearest_that_do():
    out = tessel_here("plan", *LLAMA_70B, "--gpus", "8", "--parallel.tp=8", "--parallel.zero=0",
                 "--train.micro_batch_size=1")
    assert out.returncode == 0, out.stderr
    assert "does NOT fit" in out.stdout and "nearest layouts that fit:" in out.stdout


def test_gpu_list_and_a_hardware_file(tmp_path: Path):
    out = tessel_here("plan", "--gpu", "list")
    for name in ("a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "b200", "mi300x"):
        assert name in out.stdout
    hw = tmp_path / "hw.toml"
    hw.write_text("[gpu.lab]\nbf16_tflops = 500\nmemory_gib = 48\nintra_node_gbps = 100\n"
                  "inter_node_gbps = 25\ngpus_per_node = 4\n")
    out = tessel_here("plan", "--gpus", "4", "--gpu", "lab", "--hardware", str(hw), "--json",
                 "--model.preset=gpt2-124m")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["gpu"] == "lab"


def test_bad_plan_input_is_one_line():
    assert_one_line_error(tessel_here("plan", "--model.preset=tiny"), "needs --gpus N")
    assert_one_line_error(tessel_here("plan", "--gpus", "8", "--gpu", "tpu-v9"), "unknown GPU 'tpu-v9'")
    assert_one_line_error(tessel_here("plan", "--gpus", "3", "--parallel.tp=3", "--model.preset=tiny"),
                          "is not divisible by tp=3")
    # Context parallelism: a sequence that does not cut into 2 x cp chunks; Ulysses with
    # more ranks than key/value heads.
    assert_one_line_error(tessel_here("plan", "--gpus", "4", "--parallel.cp=2", "--train.seq_len=30",
                                 "--model.preset=tiny-llama"),
                          "context parallelism cuts train.seq_len=30 into 2*cp = 4 equal chunks")
    assert_one_line_error(tessel_here("plan", "--gpus", "4", "--parallel.cp=4",
                                 "--parallel.cp_mode=ulysses", "--model.preset=tiny-llama"),
                          "splits the 2 key/value heads (model.n_kv_heads) over cp=4")
    assert_one_line_error(tessel_here("plan", "--gpus", "8", "--hardware", "/nonexistent.toml"),
                          "does not exist")
    # Expert parallelism: a degree that does not divide the experts; a dense model.
    assert_one_line_error(tessel_here("plan", "--gpus", "6", "--parallel.ep=3", "--parallel.dp_shard=6",
                                 "--model.preset=tiny-moe", "--train.global_batch_size=96"),
                          "parallel.ep=3 does not divide model.moe_experts=8")
    assert_one_line_error(tessel_here("plan", "--gpus", "2", "--parallel.ep=2", "--parallel.dp_shard=2",
                                 "--model.preset=tiny"), "this model has none")


def test_calibrating_from_a_measured_run(tmp_path: Path, corpus: Path):
    run = tmp_path / "run"
    trained = tessel_here(*train_args(run, corpus, "--train.steps=8", "--metrics.log_interval=1"))
    assert trained.returncode == 0, trained.stderr
    assert json.loads((run / "run.json").read_text())["world_size"] == 1
    saved = tmp_path / "calibrated.toml"
    out = tessel_here("plan", str(run / "config.toml"), "--gpus", "1", "--gpu", "h100-sxm",
                 "--calibrate", str(run), "--save-hardware", str(saved), "--json")
    assert out.returncode == 0, out.stderr
    assert "calibrated h100-sxm: matmul efficiency 0.625 ->" in out.stderr
    # A CPU is far slower than an H100: the fitted efficiency drops to the floor.
    assert load_profiles(saved)["h100-sxm"].matmul_efficiency < 0.1
    assert_one_line_error(tessel_here("plan", "--gpus", "1", "--calibrate", str(tmp_path)),
                          "not a tessel run directory")


def test_auto_layout_in_one_process_says_what_it_chose(tmp_path: Path, corpus: Path):
    out = tessel_here(*train_args(tmp_path / "auto", corpus, "--train.steps=2", "--parallel.auto=true"))
    assert out.returncode == 0, out.stderr
    assert "tessel: parallel.auto chose dp=1 tp=1 pp=1" in out.stdout
    assert "the fastest of the layouts predicted to fit" in out.stdout


def test_train_accepts_force():
    assert "--force" in tessel_here("train", "--help").stdout
