"""MoE in training: the per-step balance bookkeeping (bias update, metrics) and the layouts
refused before launch."""

import math

import pytest
import torch

from tessel.config import Config, ModelConfig
from tessel.models import build_model
from tessel.train.moe_balance import MoEBalance


def test_bias_moves_against_the_load_and_stats_reset():
    cfg = ModelConfig(preset="tiny-moe", moe_bias_update_rate=0.01)
    model = build_model(cfg, seed=0)
    balance = MoEBalance([model], distributed=False, dp=1)
    assert balance.moe_ids == [1, 2, 3] and balance.active
    balance.before_step(2)
    layer = model.layers["1"].feed_forward
    assert layer.grad_scale == 0.5
    for _ in range(2):
        model(torch.randint(0, 512, (2, 16))).sum().backward()
    counts = layer.tokens_per_expert.clone()
    assert counts.sum().item() == 2 * 2 * 16 * 2  # micro-batches x tokens x top_k
    balance.after_step(2, torch.device("cpu"))
    expected = 0.01 * torch.sign(counts.mean() - counts)
    torch.testing.assert_close(layer.expert_bias, expected)
    assert layer.tokens_per_expert.sum().item() == 0  # read and reset
    rec = balance.metrics(with_dropped=False)
    assert rec["moe_load_imbalance_l1"] == pytest.approx((counts.max() / counts.mean()).item())
    assert rec["moe_load_imbalance"] >= 1.0 and 0.5 < rec["moe_aux_loss"] < 2.0
    assert {"moe_aux_loss_l1", "moe_aux_loss_l3", "moe_z_loss"} <= set(rec)
    assert "moe_dropped_frac" not in rec
    # each expert's share of the layer's slots, one list per MoE layer (for the report)
    share = rec["moe_expert_share_l1"]
    assert isinstance(share, list) and len(share) == 8 and sum(share) == pytest.approx(1, abs=1e-3)
    assert share == pytest.approx((counts / counts.sum()).tolist(), rel=1e-3)
    assert {f"moe_expert_share_l{i}" for i in (1, 2, 3)} <= set(rec)
    assert "moe_expert_share_l0" not in rec  # the dense layer


def test_dense_model_has_no_balance_work():
    model = build_model(ModelConfig(preset="tiny"), seed=0)
    assert not MoEBalance([model], distributed=False, dp=1).active


@pytest.mark.parametrize("degree, message", [
    ({"parallel.tp": 2, "parallel.sequence_parallel": False},
     "under tensor parallelism MoE layers run on each rank's part of the sequence; set "
     "parallel.sequence_parallel=true"),
])
def test_tp_without_sp_with_moe_is_refused_before_launch(degree, message):
    from tessel.parallel.dims import ParallelDims, ParallelError

    cfg = Config.load(None, {"model.preset": "tiny-moe", "train.micro_batch_size": 1,
                             "train.global_batch_size": 2, **degree})
    dims = ParallelDims.from_config(cfg.parallel, 4)
    with pytest.raises(ParallelError, match=message.replace("(", r"\(").replace(")", r"\)")):
        dims.validate(cfg)


@pytest.mark.parametrize("degree", [{"parallel.pp": 2, "parallel.zero": 3},
                                    {"parallel.cp": 2, "parallel.ep": 2}])
def test_pp_zero_and_cp_with_moe_pass_the_layout_check(degree):
    from tessel.parallel.dims import ParallelDims

    cfg = Config.load(None, {"model.preset": "tiny-moe", "train.micro_batch_size": 1,
                             "train.global_batch_size": 4, **degree})
    ParallelDims.from_config(cfg.parallel, 4).validate(cfg)


def test_hf_export_of_an_moe_shape_hf_cannot_hold_is_refused_in_one_line():
    """tiny-moe has a shared expert, which neither Mixtral nor Qwen3-MoE has; without it, it
    exports as Mixtral (tests/integration/test_hf_moe.py). Refused by the pre-flight check
    (`check_export`: `tessel.load_config`, the trainer's start), not the config schema."""
    from tessel import load_config
    from tessel.checkpoint.hf_models import HFError, check_export, for_model
    from tessel.config import ConfigError

    refused = {"model.preset": "tiny-moe", "checkpoint.hf_export_interval": 10}
    with pytest.raises(ConfigError, match="checkpoint.hf_export_interval: model: "
                                          "MixtralForCausalLM has softmax routing"):
        check_export(Config.load(None, refused))
    with pytest.raises(ConfigError, match="^invalid config: checkpoint.hf_export_interval: "
                                          "model: MixtralForCausalLM has softmax routing.*; "
                                          "set it to 0$"):
        load_config(None, refused)
    m = ModelConfig(preset="tiny-moe")
    with pytest.raises(HFError, match="no shared experts; this model"):
        for_model(m).hf_config(m)
    m = ModelConfig(preset="tiny-moe", moe_shared_experts=0)
    with pytest.raises(HFError, match="MixtralForCausalLM has every layer MoE"):
        for_model(m).hf_config(m)
    check_export(load_config(None, {"model.preset": "tiny-moe", "model.moe_shared_experts": 0,
                                    "model.qk_norm": True, "checkpoint.hf_export_interval": 10}))


def test_tessel_train_refuses_an_hf_export_it_cannot_write_before_writing_anything(tmp_path):
    """The refusal left the config schema for the pre-flight checks: `tessel train` (a new
    run, a resumed one) and a Trainer built from `Config.load` still refuse it in one line,
    exit code 2, before the run directory exists."""
    import subprocess
    import sys

    from tessel.config import ConfigError
    from tessel.train import Trainer

    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "tessel", "train", "--model.preset=tiny-moe",
                           "--checkpoint.hf_export_interval=10", f"--run.dir={run}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "tessel: error: invalid config: checkpoint.hf_export_interval: model: "
        "MixtralForCausalLM has softmax routing to SwiGLU experts and no shared experts; this "
        "model (moe_shared_experts=1, moe_router='softmax', mlp='swiglu') has no Hugging Face "
        "export; set it to 0"]
    assert not run.exists()
    cfg = Config.load(None, {"model.preset": "tiny-moe", "run.dir": str(run)})
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "config.toml").write_text(cfg.with_overrides(
        {"run.dir": str(tmp_path / "saved")}).to_toml())
    proc = subprocess.run([sys.executable, "-m", "tessel", "train", "--resume",
                           str(tmp_path / "saved"), "--checkpoint.hf_export_interval=10"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "set it to 0" in proc.stderr, proc.stderr
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == ["config.toml"]
    with pytest.raises(ConfigError, match="MixtralForCausalLM has softmax routing"):
        Trainer(cfg.with_overrides({"checkpoint.hf_export_interval": 10}), console=False)
    assert not run.exists()


def test_a_pipeline_metadata_forward_is_left_out_of_the_statistics():
    model = build_model(ModelConfig(preset="tiny-moe"), seed=0)
    balance = MoEBalance([model], distributed=False, dp=1)
    balance.skip_first_forward()
    tokens = torch.randint(0, 512, (2, 16))
    model(tokens)  # the schedule's metadata inference
    model(tokens)  # the micro-batch
    assert model.layers["1"].feed_forward.tokens_per_expert.sum().item() == 2 * 16 * 2


def test_the_planner_plans_moe_models_and_checks_them_before_launch():
    import subprocess
    import sys

    from tessel.planner.hardware import BUILTIN
    from tessel.planner.prelaunch import check_memory, choose_layout
    from tessel.planner.search import trainer_refusal

    proc = subprocess.run([sys.executable, "-m", "tessel", "plan", "--model.preset=tiny-moe",
                           "--gpus", "8", "--gpu", "h100-sxm", "--parallel.ep=4",
                           "--parallel.dp_shard=8", "--train.micro_batch_size=4"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "ep=4" in proc.stdout and "fits" in proc.stdout
    cfg = Config.load(None, {"model.preset": "tiny-moe"})
    plan, refusal = check_memory(cfg, 8, BUILTIN["h100-sxm"])  # what tessel train asks first
    assert refusal is None and plan.fits
    # parallel.auto picks a layout the trainer runs.
    chosen, best = choose_layout(cfg, 8, BUILTIN["h100-sxm"])
    assert trainer_refusal(chosen, best.layout) is None and chosen.parallel.auto


def test_a_step_the_fp16_scaler_skips_leaves_the_bias_and_resets_the_counts():
    from tessel.data import Batch
    from tessel.optim.groups import build_optimizer
    from tessel.parallel.apply import build_parallel_model
    from tessel.parallel.dims import ParallelDims
    from tessel.train.precision import resolve_precision
    from tessel.train.step import TrainStep

    cpu = torch.device("cpu")
    cfg = Config.load(None, {"model.preset": "tiny-moe", "model.moe_bias_update_rate": 0.01,
                             "train.seq_len": 16, "train.micro_batch_size": 2,
                             "train.global_batch_size": 2})
    dims = ParallelDims.from_config(cfg.parallel, 1)
    model = build_parallel_model(cfg, dims, None, cpu, None)
    opts = [build_optimizer(m, cfg.optim, cpu) for m in model.inner]
    step = TrainStep(model, opts, dims, None, cpu, resolve_precision("fp16", cpu), accum=1,
                     grad_clip=1.0, parallel_cfg=cfg.parallel, distributed=False)
    scaler = step.precision.scaler
    assert scaler is not None
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    batches = [Batch(tokens[:, :-1], tokens[:, 1:], None)]
    layer = model.inner[0].layers["1"].feed_forward
    weights = {k: v.clone() for k, v in model.inner[0].state_dict().items()}

    step.loss_factor = math.inf  # every gradient inf/nan: GradScaler skips the optimizer step
    scale = scaler.get_scale()
    step(batches)
    assert scaler.get_scale() < scale  # the scaler saw the overflow and backed off
    for k, v in model.inner[0].state_dict().items():
        assert torch.equal(v, weights[k]), k  # no weight moved, the balancing bias included
    assert layer.tokens_per_expert.sum().item() == 0  # the step's counts were still read
    assert step.moe.summary is not None  # and reported

    step.loss_factor = 1.0  # a finite step moves the bias again
    step(batches)
    assert layer.expert_bias.abs().sum() > 0


def test_hf_exports_during_training_of_a_balancing_bias_are_refused_unless_dropped():
    """Mixtral and Qwen3-MoE route without the balancing bias: checkpoint.hf_export_interval
    with model.moe_bias_update_rate > 0 is refused when the config loads (not in every export
    of the run), unless checkpoint.hf_export_drop_expert_bias says to export without it."""
    from tessel import load_config
    from tessel.checkpoint.hf_models import check_export
    from tessel.config import ConfigError

    qwen3 = {"model.preset": "tiny-moe", "model.moe_shared_experts": 0, "model.qk_norm": True,
             "checkpoint.hf_export_interval": 10, "model.moe_bias_update_rate": 0.001}
    with pytest.raises(ConfigError, match="model.moe_bias_update_rate=0.001 trains a balancing "
                                          "bias that Qwen3MoeForCausalLM has no place for") as exc:
        load_config(None, qwen3)
    assert "checkpoint.hf_export_drop_expert_bias = true" in str(exc.value)
    with pytest.raises(ConfigError, match="Qwen3MoeForCausalLM has no place for"):
        check_export(Config.load(None, qwen3))
    check_export(load_config(None, {**qwen3, "checkpoint.hf_export_drop_expert_bias": True}))
    check_export(load_config(None, {**qwen3, "model.moe_bias_update_rate": 0.0}))
