"""MoE in training: the per-step balance bookkeeping (bias update, metrics) and the layouts
refused before launch."""

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


def test_dense_model_has_no_balance_work():
    model = build_model(ModelConfig(preset="tiny"), seed=0)
    assert not MoEBalance([model], distributed=False, dp=1).active


@pytest.mark.parametrize("degree, message", [
    ({"parallel.tp": 2}, "tensor parallelism of MoE layers is not supported yet; set "
                         "parallel.tp=1 (expert parallelism: issue 18)"),
    ({"parallel.cp": 2}, "context parallelism with MoE layers is not supported yet"),
])
def test_tp_and_cp_with_moe_are_refused_before_launch(degree, message):
    from tessel.parallel.dims import ParallelDims, ParallelError

    cfg = Config.load(None, {"model.preset": "tiny-moe", "train.micro_batch_size": 1,
                             "train.global_batch_size": 2, **degree})
    dims = ParallelDims.from_config(cfg.parallel, 4)
    with pytest.raises(ParallelError, match=message.replace("(", r"\(").replace(")", r"\)")):
        dims.validate(cfg)


def test_pp_and_zero_with_moe_pass_the_layout_check():
    from tessel.parallel.dims import ParallelDims

    cfg = Config.load(None, {"model.preset": "tiny-moe", "train.micro_batch_size": 1,
                             "train.global_batch_size": 4, "parallel.pp": 2, "parallel.zero": 3})
    ParallelDims.from_config(cfg.parallel, 4).validate(cfg)


def test_hf_export_of_moe_is_refused_in_one_line():
    from tessel.checkpoint.hf_arch import HFError, for_model
    from tessel.config import ConfigError

    with pytest.raises(ConfigError, match="MoE models have no Hugging Face export yet"):
        Config.load(None, {"model.preset": "tiny-moe", "checkpoint.hf_export_interval": 10})
    with pytest.raises(HFError, match="Mixture-of-Experts models have no Hugging Face export"):
        for_model(ModelConfig(preset="tiny-moe"))


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
    # parallel.auto picks only what the trainer runs today (it refuses ep > 1 until wired).
    chosen, best = choose_layout(cfg, 8, BUILTIN["h100-sxm"])
    assert trainer_refusal(chosen, best.layout) is None and chosen.parallel.auto