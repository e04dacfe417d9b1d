"""The planner's optimizer terms (planner/optimizer.py) against the real optimizers: state
bytes counted from their state after a step, Newton-Schulz FLOPs counted by PyTorch's
FLOP counter, and how Muon's step time moves with the layout."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tessel.config import Config
from tessel.models import build_model
from tessel.optim.groups import build_optimizer, muon_groups
from tessel.optim.muon import newton_schulz
from tessel.planner.hardware import GpuProfile
from tessel.planner.layout import Layout
from tessel.planner.memory import estimate_memory, parameter_elements
from tessel.planner.optimizer import OptimizerSpec, muon_matrices, ns_flops
from tessel.planner.speed import estimate_step

H100 = GpuProfile("h100-sxm", 989e12, 1979e12, 80.0, 450.0, 50.0, 8, hbm_gbps=3350)


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's per-parameter tensors (not its scalar step counters)."""
    return sum(t.numel() * t.element_size() for s in opt.state.values()
               for k, t in s.items() if k != "step")


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-moe"])
@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_state_bytes_are_what_the_optimizer_holds(preset, name):
    cfg = Config.load(None, {"model.preset": preset, "optim.name": name})
    model = build_model(cfg.model, seed=0)
    opt = build_optimizer(model, cfg.optim, torch.device("cpu"))
    model(torch.randint(0, 512, (1, 8))).float().mean().backward()
    opt.step()
    layout = Layout(1, 1, 1, 1, 1, 0, 1)
    predicted = estimate_memory(cfg.model, layout, 8, 1, "fp32",
                                optimizer=OptimizerSpec.from_config(cfg.optim))
    assert predicted.optimizer == _state_bytes(opt)
    if name == "muon":  # Muon's matrices are what muon_groups hands it
        muon = sum(p.numel() for g in muon_groups(model, cfg.optim) if g.get("muon")
                   for p in g["params"])
        assert parameter_elements(cfg.model, layout, muon=True) == muon
        assert predicted.optimizer < 8 * sum(p.numel() for p in model.parameters())


def test_newton_schulz_flops_are_what_pytorch_counts():
    for rows, cols in ((32, 48), (48, 32), (64, 64)):
        g = torch.randn(rows, cols)
        with FlopCounterMode(display=False) as counter:
            newton_schulz(g, 5, torch.float32)
        assert counter.get_total_flops() == ns_flops(rows, cols, 5), (rows, cols)


def test_muon_matrices_are_the_models():
    cfg = Config.load(None, {"model.preset": "tiny-moe"}).model
    model = build_model(cfg, seed=0)
    groups = muon_groups(model, Config.load(None, {"optim.name": "muon"}).optim)
    real = sorted(tuple(p.shape[-2:]) for g in groups if g.get("muon") for p in g["params"]
                  for _ in range(p.shape[0] if p.ndim == 3 else 1))
    moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    planned = sorted((a, b) for a, b, n in muon_matrices(cfg, cfg.n_layers, moe)
                     for _ in range(n))
    # the planner names (rows, cols) as nn.Linear does; experts are stored (in, out)
    assert sorted(tuple(sorted(s)) for s in real) == sorted(tuple(sorted(s)) for s in planned)


def test_muon_step_time_counts_newton_schulz_spread_over_the_ranks():
    cfg = Config.load(None, {"model.preset": "llama3-8b"}).model
    adamw, muon = OptimizerSpec(), OptimizerSpec("muon")
    one = Layout(1, 1, 1, 1, 1, 0, 1)
    t_adamw = estimate_step(cfg, one, H100, 4096, 1, "bf16", optimizer=adamw).optimizer_s
    t_muon = estimate_step(cfg, one, H100, 4096, 1, "bf16", optimizer=muon).optimizer_s
    ns = sum(ns_flops(a, b, 5) * n for a, b, n in muon_matrices(cfg, cfg.n_layers, 0))
    assert t_muon - t_adamw == pytest.approx(ns / (H100.bf16_flops * H100.matmul_efficiency),
                                             rel=0.05)
    # ZeRO-3 over 8 ranks: an eighth of the Newton-Schulz work, plus gathering the matrices
    dp8 = Layout(1, 8, 1, 1, 1, 3, 1)
    t8 = estimate_step(cfg, dp8, H100, 4096, 8, "bf16", optimizer=muon).optimizer_s
    t8_adamw = estimate_step(cfg, dp8, H100, 4096, 8, "bf16", optimizer=adamw).optimizer_s
    assert t8 < t_muon / 2 and t8 - t8_adamw > ns / 8 / (H100.bf16_flops * H100.matmul_efficiency)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_bfloat16_state_bytes_are_what_the_optimizer_holds(name):
    cfg = Config.load(None, {"model.preset": "tiny-moe", "optim.name": name,
                             "optim.state_dtype": "bfloat16"})
    model = build_model(cfg.model, seed=0)
    opt = build_optimizer(model, cfg.optim, torch.device("cpu"))
    model(torch.randint(0, 512, (1, 8))).float().mean().backward()
    opt.step()
    layout = Layout(1, 1, 1, 1, 1, 0, 1)
    spec = OptimizerSpec.from_config(cfg.optim)
    assert estimate_memory(cfg.model, layout, 8, 1, "fp32", optimizer=spec).optimizer == (
        _state_bytes(opt))
