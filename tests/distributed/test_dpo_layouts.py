"""DPO (train.objective = "dpo") on two gloo processes against the single-process DPO run:
ZeRO-3 over dp 2 (gradient accumulation 2 -> 1), tp 2 (the vocabulary-parallel log-probs),
cp 2 (each rank's part of a reply's log-probability summed over the cp group), pp 2 (the
schedule's loss per micro-batch, the reference pass and evaluation through the schedule),
LoRA over dp 2 (plain DDP), tp 2 and pp 2, another model as the reference (dpo.reference_model) under
pp 2, the loss over pieces of the logits (parallel.loss_chunks: each row's sum from
vocabulary-parallel pieces under tp 2, through the schedule under pp 2), and a resume of the
ZeRO-3 run's checkpoint under DDP, and a ZeRO-3 run whose reference log-probabilities come
from the data cache (rank 0 reads them, rank 1 receives them). Every step's loss and the
rewards/* metrics, the held-out loss and eval_rewards/*, and the final weights equal the
reference's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_layouts import final_weights, job_output, torchrun, train_metrics

from tessel.checkpoint.init_from import load_config
from tessel.train import Trainer

STEPS = 4
LORA = {"lora.enabled": True, "lora.rank": 4, "lora.alpha": 8.0,
        "lora.targets": ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]}
METRICS = ("rewards/chosen", "rewards/margins", "rewards/accuracies", "logps/rejected")


IN_MEMORY = {"tp2", "cp2", "pp2", "other_pp2", "tp2_chunked", "pp2_chunked", "zero3_cached"}
"""Runs whose saves keep the full weights in memory instead of checkpoints (worker.py's
`weights_in_memory`): not ZeRO-3 (resumed), nor the LoRA runs (adapter checkpoints)."""


def write_pairs(path: Path, n: int = 40) -> Path:
    """Text pairs (the byte tokenizer reads them as bytes): a right and a wrong sum."""
    rows = []
    for i in range(n):
        a, b = i % 7, (i * 3) % 5
        rows.append({"prompt": f"{a}+{b}=", "chosen": f" {a + b}",
                     "rejected": f" {a + b + 1 + i % 3} maybe" * (1 + i % 2)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def dpo_base(run_dir: Path, pairs: Path, **extra) -> dict:
    cfg = {"model.preset": "tiny-llama", "model.n_layers": 2, "model.dropout": 0.0,
           "train.objective": "dpo", "dpo.paths": [str(pairs)], "dpo.beta": 0.5,
           "dpo.sft_weight": 0.3, "data.tokenizer": "bytes", "data.split": "80,20",
           "train.steps": STEPS, "train.seq_len": 32, "train.micro_batch_size": 2,
           "train.global_batch_size": 4, "train.eval_interval": STEPS, "train.eval_iters": 4,
           "optim.lr": 3e-3, "optim.warmup_steps": 1, "optim.schedule": "constant",
           "checkpoint.interval": 2, "metrics.log_interval": 1, "metrics.tensorboard": False,
           "run.dir": str(run_dir), "run.sample_tokens": 0}
    cfg.update(extra)
    return cfg


def _single(overrides: dict) -> Path:
    Trainer(load_config(None, overrides), console=False).train()
    return Path(overrides["run.dir"])


def assert_same_dpo_run(run: Path, ref: Path, first_step: int = 1) -> None:
    got, got_vals = train_metrics(run)
    want, want_vals = train_metrics(ref)
    assert sorted(got) == list(range(first_step, STEPS + 1)), (run.name, sorted(got))
    for step in got:
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-5), (run.name, step)
        for key in METRICS:
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-4, abs=1e-6), \
                (run.name, step, key)
    assert got_vals[STEPS] == pytest.approx(want_vals[STEPS], rel=1e-5), run.name
    evals = {r["step"]: r for r in
             (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())
             if "val_loss" in r}
    want_evals = {r["step"]: r for r in
                  (json.loads(line) for line in (ref / "metrics.jsonl").read_text().splitlines())
                  if "val_loss" in r}
    for key in ("eval_rewards/margins", "eval_logps/chosen"):
        assert evals[STEPS][key] == pytest.approx(want_evals[STEPS][key], rel=1e-4), key
    w_got, w_want = final_weights(run), final_weights(ref)
    assert w_got.keys() == w_want.keys()
    for name in w_want:
        diff = (w_got[name] - w_want[name]).abs().max()
        assert diff < 1e-4, f"{run.name}: weight {name} differs by {diff:.2e}"


@pytest.mark.budget(90)  # 2 single-process runs, 2 two-process jobs (22-45 s measured)
def test_dpo_layouts_match_the_single_process_run(tmp_path: Path):
    pairs = write_pairs(tmp_path / "pairs.jsonl")
    ref = _single(dpo_base(tmp_path / "ref", pairs))
    lora_ref = _single(dpo_base(tmp_path / "lora_ref", pairs, **LORA,
                                **{"model.init_from": str(ref)}))
    # another model as the reference (dpo.reference_model): the reference run's weights
    other = {"dpo.reference_model": str(ref)}
    other_ref = _single(dpo_base(tmp_path / "other_ref", pairs, **other))
    resumed = tmp_path / "zero3_then_ddp"
    runs = [{"overrides": dpo_base(tmp_path / "zero3", pairs, **{"parallel.zero": 3})},
            {"overrides": dpo_base(tmp_path / "lora_ddp", pairs, **LORA, **{
                "model.init_from": str(ref), "parallel.zero": 0})},
            {"overrides": dpo_base(resumed, pairs, **{"parallel.zero": 0}), "resume": True},
            {"overrides": dpo_base(tmp_path / "tp2", pairs, **{"parallel.tp": 2})},
            {"overrides": dpo_base(tmp_path / "cp2", pairs, **{"parallel.cp": 2})},
            # an evaluation mid-run too: the schedule switches to eval and back to training
            {"overrides": dpo_base(tmp_path / "pp2", pairs, **{"parallel.pp": 2,
                                                               "train.eval_interval": 2})},
            {"overrides": dpo_base(tmp_path / "other_pp2", pairs, **other, **{"parallel.pp": 2})},
            {"overrides": dpo_base(tmp_path / "tp2_chunked", pairs, **{
                "parallel.tp": 2, "parallel.loss_chunks": 3})},
            {"overrides": dpo_base(tmp_path / "pp2_chunked", pairs, **{
                "parallel.pp": 2, "parallel.loss_chunks": 2})},
            {"overrides": dpo_base(tmp_path / "lora_tp2", pairs, **LORA, **{
                "model.init_from": str(ref), "parallel.tp": 2})},
            {"overrides": dpo_base(tmp_path / "lora_pp2", pairs, **LORA, **{
                "model.init_from": str(ref), "parallel.pp": 2})},
            # the ZeRO-3 run again, but for a setting the reference pass does not read: its
            # log-probabilities come from the data cache, read by rank 0 and sent to rank 1
            {"overrides": dpo_base(tmp_path / "zero3_cached", pairs, **{
                "parallel.zero": 3, "checkpoint.keep_last": 7})}]
    for run in runs:  # nothing resumes from these: their weights kept in memory (worker.py)
        run["weights_in_memory"] = Path(run["overrides"]["run.dir"]).name in IN_MEMORY
    proc = torchrun(2, {"runs": [runs[i] for i in (0, 1, 3, 4, 5, 6, 7, 8, 9, 10, 11)]},
                    tmp_path)
    assert proc.returncode == 0, job_output(proc)
    origin = lambda run: json.loads((tmp_path / run / "reference_logps.npy.json").read_text())["origin"]  # noqa: E731
    assert origin("zero3_cached").startswith("the data cache ")
    assert [run for run in ("zero3", "tp2", "cp2", "pp2", "tp2_chunked", "pp2_chunked")
            if origin(run) != "one pass of the initial model"] == []  # each layout's own pass
    # the ZeRO-3 run as it was after step 2, with the reference log-probabilities it keeps
    (resumed / "checkpoints").mkdir(parents=True)
    for name in ("config.toml", "tokenizer.json", "reference_logps.npy",
                 "reference_logps.npy.json"):
        shutil.copy(tmp_path / "zero3" / name, resumed / name)
    shutil.copytree(tmp_path / "zero3" / "checkpoints" / "step_00000002",
                    resumed / "checkpoints" / "step_00000002")
    proc = torchrun(2, {"runs": [runs[2]]}, tmp_path)
    assert proc.returncode == 0, job_output(proc)
    assert_same_dpo_run(tmp_path / "zero3", ref)
    assert_same_dpo_run(tmp_path / "zero3_cached", ref)
    assert_same_dpo_run(tmp_path / "lora_ddp", lora_ref)
    assert_same_dpo_run(resumed, ref, first_step=3)
    assert_same_dpo_run(tmp_path / "tp2", ref)
    assert_same_dpo_run(tmp_path / "cp2", ref)
    assert_same_dpo_run(tmp_path / "pp2", ref)
    assert_same_dpo_run(tmp_path / "other_pp2", other_ref)
    assert_same_dpo_run(tmp_path / "tp2_chunked", ref)
    assert_same_dpo_run(tmp_path / "pp2_chunked", ref)
    assert_same_dpo_run(tmp_path / "lora_tp2", lora_ref)
    assert_same_dpo_run(tmp_path / "lora_pp2", lora_ref)
    assert train_metrics(other_ref)[0][1]["loss"] != train_metrics(ref)[0][1]["loss"]
