"""The planner for train.objective = "dpo" (tessel/planner/dpo.py): a DPO step is the
language-model step of twice the rows (a pair is a chosen and a rejected row in one
micro-batch), the reference pass before the first step adds its forward-only time on every
rank and, with dpo.reference_model, its memory; `tessel plan` says so; and the planner's
counts against a DPO run measured on the CPU."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from saved_memory import SavedTensorMeter

from tessel.config import Config
from tessel.models import param_count
from tessel.planner import hardware
from tessel.planner.dpo import ASSUMPTIONS, as_run, reference_pairs
from tessel.planner.layout import Layout
from tessel.planner.memory import GIB, MASTER_BYTES, memory_by_rank, parameter_elements
from tessel.planner.report import ASSUMPTIONS as PRINTED
from tessel.planner.search import evaluate
from tessel.planner.speed import estimate_step
from tessel.planner.stack import on_stack, tessel_stack

ROOT = Path(__file__).resolve().parents[2]
H100 = hardware.BUILTIN["h100-sxm"]
SHAPE = {"model.preset": "tiny-llama", "model.n_layers": 4, "train.seq_len": 256,
         "train.steps": 100, "train.micro_batch_size": 2, "train.global_batch_size": 16,
         "data.split": "80,20"}
DPO = {"train.objective": "dpo", "dpo.paths": ["prefs.jsonl"]}  # (the planner reads no data)


def layout(**kw) -> Layout:
    return Layout(**{**dict(dp_replicate=1, dp_shard=1, tp=1, pp=1, cp=1, zero=0,
                            micro_batch=2), **kw})


# (layout in pairs, the config's own extra settings)
CASES = [
    (layout(dp_shard=8, zero=3), {}),
    (layout(dp_shard=4, tp=2, zero=1), {}),
    (layout(dp_shard=2, pp=2, zero=2, micro_batch=1), {}),
    (layout(dp_shard=2, pp=2, pp_schedule="interleaved-1f1b", pp_virtual_stages=2,
            micro_batch=1), {}),
    (layout(dp_shard=4, cp=2, zero=3, activation_checkpointing="full"), {}),
    (layout(dp_shard=8, zero=0, activation_checkpointing="selective"), {"train.precision": "fp32"}),
    (layout(tp=2, dp_shard=4, zero=3), {"lora.enabled": True, "lora.base_dtype": "bfloat16"}),
    (layout(dp_shard=8, zero=0), {"data.document_mask": True}),  # DPO rows carry no mask
]


def configs(extra: dict) -> tuple[Config, Config]:
    """(the DPO config, the same as a language-model run of twice the rows: the global
    batch doubled, no document mask)."""
    dpo = Config.load(None, {**SHAPE, **DPO, **extra})
    rows = {**SHAPE, **extra, "train.global_batch_size": 2 * SHAPE["train.global_batch_size"],
            "train.micro_batch_size": 2 * SHAPE["train.micro_batch_size"],
            "data.document_mask": False}
    return dpo, Config.load(None, rows)


@pytest.mark.parametrize("pairs, extra", CASES)
def test_a_dpo_step_is_the_language_model_step_of_twice_the_rows(pairs, extra):
    """Memory (activations included), step time, tokens/s and MFU equal, exactly, those of
    the same model with twice the micro-batch and global batch (parallel.loss_chunks as
    set: the automatic count counts both rows); the plan still names the micro-batch in pairs; its
    time to budget is the steps' plus the reference pass's."""
    dpo_cfg, lm_cfg = configs(extra)
    rows = replace(pairs, micro_batch=2 * pairs.micro_batch)
    dpo, lm = evaluate(dpo_cfg, pairs, H100), evaluate(lm_cfg, rows, H100)
    assert dpo.step == lm.step and dpo.memory == lm.memory
    assert dpo.memory.saved == lm.memory.saved > 0
    assert (dpo.tokens_per_s, dpo.mfu, dpo.fits) == (lm.tokens_per_s, lm.mfu, lm.fits)
    assert dpo.layout == pairs and dpo.layout.overrides()["train.micro_batch_size"] == pairs.micro_batch
    assert dpo.reference is not None and lm.reference is None
    assert dpo.time_to_budget_s == lm.time_to_budget_s + dpo.reference.seconds
    # tessel train counts the tokens of a step alike (both rows of each pair)
    assert dpo_cfg.train.tokens_per_step == lm_cfg.train.tokens_per_step
    assert dpo.tokens_per_s == pytest.approx(dpo_cfg.train.tokens_per_step / dpo.step.total)


def test_the_reference_pass_is_a_third_of_the_compute_per_pair_dealt_out_over_dp():
    """The pairs' micro-batches go forward only, dealt out over the data-parallel replicas:
    a third of a training micro-batch's compute without recomputation each, 1/dp of them on
    each replica, over one epoch's pairs (train.steps x global batch, plus data.split's
    validation share)."""
    cfg, _ = configs({})
    t = cfg.train
    assert reference_pairs(cfg) == 2000  # 100 x 16 training pairs, 80:20
    assert reference_pairs(Config.load(None, {**SHAPE, **DPO, "data.split": "100,0"})) == 1600
    one = evaluate(cfg, layout(micro_batch=2), H100)
    eight = evaluate(cfg, layout(dp_shard=8, micro_batch=2), H100)
    assert one.reference and eight.reference
    assert eight.reference.seconds == pytest.approx(one.reference.seconds / 8, rel=1e-12)
    assert eight.step.compute_s == pytest.approx(one.step.compute_s / 8, rel=1e-12)
    # one rank: the step's compute is its micro-batches'; the pass a third of it per pair
    per_pair = one.step.compute_s / t.global_batch_size
    assert one.reference.seconds == pytest.approx(2000 * per_pair / 3, rel=1e-12)
    # checkpointing recomputes nothing in a forward-only pass
    full = evaluate(cfg, layout(micro_batch=2, activation_checkpointing="full"), H100)
    assert full.step.compute_s > one.step.compute_s
    assert full.reference and full.reference.seconds == one.reference.seconds
    # tensor parallelism: the forward's collectives (half the step's) count too; 1,000
    # micro-batches of 2 pairs, a step 8 of them
    run_hw = on_stack(H100, tessel_stack(t.compile))

    def forward(pairs: Layout) -> tuple[float, float]:
        """(one micro-batch's forward seconds, the pipeline's sends of a step)."""
        rows = replace(pairs, micro_batch=2 * pairs.micro_batch)
        step = estimate_step(cfg.model, rows, run_hw, t.seq_len, 2 * t.global_batch_size, "bf16")
        return (step.compute_s / 3 + step.tp_comm_s / 2) / 8, step.pp_comm_s

    tp = evaluate(cfg, layout(tp=2), H100)
    per_micro_batch, _ = forward(layout(tp=2))
    assert tp.step.tp_comm_s > 0
    assert tp.reference and tp.reference.seconds == pytest.approx(1000 * per_micro_batch, rel=1e-12)
    # a pipeline: a step's 8 micro-batches at a time, each group paying the schedule's fill
    # (pp - 1 micro-batches) and its forward sends
    piped = evaluate(cfg, layout(pp=2), H100)
    per_micro_batch, sends = forward(layout(pp=2))
    want = 125 * (8 * per_micro_batch + per_micro_batch + sends / 2)
    assert piped.reference and piped.reference.seconds == pytest.approx(want, rel=1e-12)


def test_a_reference_model_adds_its_weights_beside_the_policys():
    """With dpo.reference_model the pass holds the policy's stored weights (no gradients or
    optimizer state before the first step) beside the reference's: on one fp32 rank, twice
    the model's parameters; a full fine-tuning step holds more, and stays the peak."""
    cfg = Config.load(None, {**SHAPE, **DPO, "train.precision": "fp32",
                             "dpo.reference_model": "ref"})
    plan = evaluate(cfg, layout(), H100)
    ref = plan.reference
    assert ref is not None and ref.memory is not None
    assert ref.memory.parameters == 2 * MASTER_BYTES * param_count(cfg.model)
    assert ref.memory.gradients == ref.memory.optimizer == 0
    assert ref.memory.saved == 0 < ref.memory.activations
    assert not ref.is_peak and plan.memory is ref.training
    # without dpo.reference_model: the policy's own pass, no memory of its own
    alone = evaluate(Config.load(None, {**SHAPE, **DPO, "train.precision": "fp32"}), layout(), H100)
    assert alone.reference and alone.reference.memory is None and alone.memory == plan.memory


def test_a_lora_runs_reference_pass_can_be_its_peak():
    """LoRA trains few weights: the reference model's whole fp32 copy (no adapters) beside
    the bf16 base is more than the training step holds, so it is the plan's memory and
    decides whether the layout fits."""
    shape = {"model.preset": "llama3-8b", "train.seq_len": 2048, "train.steps": 1000,
             "train.micro_batch_size": 1, "train.global_batch_size": 64, **DPO,
             "lora.enabled": True, "lora.base_dtype": "bfloat16"}
    pairs = layout(tp=8, micro_batch=1)
    without = evaluate(Config.load(None, shape), pairs, H100)
    cfg = Config.load(None, {**shape, "dpo.reference_model": "ref"})
    plan = evaluate(cfg, pairs, H100)
    ref = plan.reference
    assert ref is not None and ref.memory is not None and ref.is_peak
    assert plan.memory is ref.memory and ref.training == without.memory
    # the policy's stored weights beside the reference's, with its forward's weight casts
    rows, batch, _ = as_run(cfg, pairs)
    [full] = memory_by_rank(cfg.model, replace(rows, activation_checkpointing="none"),
                            cfg.train.seq_len, batch, "bf16", flex_attention=True)
    assert ref.memory.weights == ref.training.weights + full.weights
    assert ref.memory.parameters == ref.training.weights + full.parameters
    # a GPU between the two: the step fits, the reference pass does not
    gpu = replace(H100, memory_gib=(ref.training.total + ref.memory.total) / 2 / GIB)
    assert evaluate(Config.load(None, shape), pairs, gpu).fits
    short = evaluate(cfg, pairs, gpu)
    assert not short.fits
    assert short.shortfall_gib == pytest.approx((ref.memory.total - ref.training.total) / 2 / GIB)
    # tessel train's check before launch says which phase does not fit
    from tessel.planner.prelaunch import check_memory

    tp8 = Config.load(None, {**shape, "dpo.reference_model": "ref", "parallel.tp": 8})
    _, refusal = check_memory(tp8, 8, gpu)
    assert refusal is not None and "GiB per device in the DPO reference pass" in refusal


def test_tessel_plan_of_the_dpo_recipe_counts_pairs_as_rows_and_the_reference_pass(capsys):
    from tessel.cli import main

    recipe = str(ROOT / "configs/dpo-tiny.toml")
    assert main(["plan", recipe, "--gpus", "1", "--top", "2"]) == 0
    text = capsys.readouterr().out
    assert "global batch 16 DPO pairs (32 rows, 2,048 tokens/step)" in text
    # 60 steps x 16 pairs, data.split 80,20
    assert "DPO reference pass before step 1: 1,200 pairs" in text
    assert "the policy's own pass, below a training step's" in text
    assert ASSUMPTIONS[0] in PRINTED and f"  - {ASSUMPTIONS[0]}" in text
    launch = next(line for line in text.splitlines() if line.startswith("run the best:"))
    assert int(launch.split("--train.micro_batch_size=")[1].split()[0]) in (1, 2, 4, 8, 16)
    assert main(["plan", recipe, "--gpus", "1", "--parallel.zero=0", "--json",
                 "--dpo.reference_model=elsewhere"]) == 0
    [row] = json.loads(capsys.readouterr().out)["layouts"]
    assert row["micro_batch"] == 8  # pairs, as configured
    assert row["reference_pass"]["pairs"] == 1200 and row["reference_pass"]["seconds"] > 0
    assert row["reference_pass"]["memory_gib"]["total"] > 0


def _records(n: int) -> str:
    words = ["red", "green", "blue", "cyan", "black", "white", "pink", "gold"]
    return "".join(json.dumps({"prompt": f"name colour {i}: {words[i % 8]} or {words[(i + 3) % 8]}?",
                               "chosen": f"{words[i % 8]} " * (1 + i % 5),
                               "rejected": f"not {words[(i + 3) % 8]}" * (1 + i % 3)}) + "\n"
                   for i in range(n))


def test_the_planner_counts_what_a_dpo_run_keeps(tmp_path: Path, monkeypatch):
    """A DPO run of the recipe's tiny model on the CPU, its second step metered as
    tests/distributed/test_layouts.py meters other runs: the bytes autograd saves for
    backward within 10% of the planner's (twice the rows), parameter and AdamW-state
    elements exactly."""
    from tessel.checkpoint.init_from import load_config
    from tessel.train.trainer import Trainer

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(_records(16))
    cfg = load_config(str(ROOT / "configs/dpo-tiny.toml"), {
        "dpo.paths": [str(pairs)], "data.split": "100,0", "train.steps": 2,
        "train.micro_batch_size": 4, "train.global_batch_size": 8, "train.eval_interval": 0,
        "checkpoint.interval": 0, "train.device": "cpu", "metrics.log_interval": 1,
        "run.dir": str(tmp_path / "run"), "data.cache_dir": str(tmp_path / "cache")})
    measured: dict[str, int] = {}
    original = Trainer.run_step

    def metered(self: Trainer):  # noqa: ANN202
        if self.step != 1:  # the second step (as the distributed worker's meter)
            return original(self)
        meter = SavedTensorMeter.for_modules(self.model.inner)
        with meter.measuring():
            result = original(self)
        measured["saved"] = meter.peak
        return result

    monkeypatch.setattr(Trainer, "run_step", metered)
    trainer = Trainer(cfg, console=False)
    trainer.train()
    params = sum(p.numel() for p in trainer.model.parameters())
    exp_avg = sum(s["exp_avg"].numel() for o in trainer.optimizers for s in o.state.values())
    pairs_layout = Layout.from_config(trainer.cfg, 1)
    rows, batch, mask = as_run(trainer.cfg, pairs_layout)
    assert (rows.micro_batch, batch, mask) == (8, 16, False)
    [predicted] = memory_by_rank(cfg.model, rows, cfg.train.seq_len, batch, "fp32", mask)
    print(f"saved for backward: measured {measured['saved']:,} bytes, planner "
          f"{predicted.saved:,.0f}")  # (pytest -s) measured 5,550,692 / 5,550,080
    assert abs(measured["saved"] / predicted.saved - 1) < 0.10
    assert params == exp_avg == parameter_elements(cfg.model, pairs_layout)
    # the same step of half the rows keeps about half: the pairs' rows are counted
    [half] = memory_by_rank(cfg.model, pairs_layout, cfg.train.seq_len, batch // 2, "fp32")
    assert math.isclose(predicted.saved / half.saved, 2, rel_tol=0.05)
