"""Muon (optim.name = "muon"): against PyTorch's own torch.optim.Muon step for step, which
parameters it trains, its refusals, and its checkpoints (one process; the layouts are
tests/distributed/test_layouts.py's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessel.config import Config, ModelConfig, OptimConfig
from tessel.errors import TesselError
from tessel.models import build_model
from tessel.optim.groups import build_optimizer, muon_groups
from tessel.optim.muon import Muon, newton_schulz

MUON = OptimConfig(name="muon", lr=1e-2, weight_decay=0.1, muon_ns_dtype="bfloat16")
"""As torch.optim.Muon (on CPU "auto" means float32: see test_newton_schulz_precision)."""


def _batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (2, 8), generator=gen) for _ in range(n)]


def _step(model: torch.nn.Module, x: torch.Tensor, *opts: torch.optim.Optimizer) -> None:
    model(x).float().pow(2).mean().backward()
    for opt in opts:
        opt.step()
        opt.zero_grad(set_to_none=True)


def _names(model: torch.nn.Module, params: list[torch.Tensor]) -> set[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)] for p in params}


def test_muon_equals_torch_muon_with_adamw_beside_it_step_for_step():
    """PyTorch's Muon with Moonlight's scaling (match_rms_adamw), Nesterov momentum 0.95,
    5 Newton-Schulz steps on the hidden matrices, PyTorch's AdamW on the rest: tessel's
    single optimizer does exactly that, to the bit, over 4 steps of changing lr."""
    ours, ref = (build_model(ModelConfig(preset="tiny-llama"), seed=0) for _ in range(2))
    opt = build_optimizer(ours, MUON, torch.device("cpu"))
    assert isinstance(opt, Muon)
    groups = muon_groups(ref, MUON)
    matrices = [p for g in groups if g.get("muon") for p in g["params"]]
    ref_muon = torch.optim.Muon(matrices, lr=MUON.lr, weight_decay=MUON.weight_decay, momentum=0.95,
                                nesterov=True, ns_steps=5, adjust_lr_fn="match_rms_adamw")
    ref_adamw = torch.optim.AdamW([g for g in groups if not g.get("muon")], lr=MUON.lr,
                                  betas=(MUON.beta1, MUON.beta2), eps=MUON.eps, foreach=True)
    for step, x in enumerate(_batches(4)):
        for o in (opt, ref_muon, ref_adamw):
            for group in o.param_groups:
                group["lr"] = MUON.lr * (step + 1) / 4
        _step(ours, x, opt)
        _step(ref, x, ref_muon, ref_adamw)
        for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
            assert torch.equal(a, b), (step, name)
    moved = {n for n, p in ours.named_parameters()
             if not torch.equal(p, build_model(ModelConfig(preset="tiny-llama"), seed=0)
                                .get_parameter(n))}
    assert "layers.0.attention.wq.weight" in moved and "tok_embeddings.weight" in moved


def test_an_expert_stack_is_each_expert_orthogonalised_alone():
    """An MoE expert stack (E, A, B) under tessel's Muon = E separate matrices under
    torch.optim.Muon, momentum and all."""
    gen = torch.Generator().manual_seed(0)
    stack = torch.nn.Parameter(torch.randn(3, 16, 24, generator=gen))
    singles = [torch.nn.Parameter(m.detach().clone()) for m in stack]
    opt = Muon([{"params": [stack], "muon": True, "weight_decay": 0.1}], lr=0.02,
               betas=(0.9, 0.95), eps=1e-8, momentum=0.95, ns_steps=5, foreach=True)
    ref = torch.optim.Muon(singles, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        grad = torch.randn(3, 16, 24, generator=gen)
        stack.grad = grad.clone()
        for i, p in enumerate(singles):
            p.grad = grad[i].clone()
        opt.step()
        ref.step()
        for i, p in enumerate(singles):
            assert torch.equal(stack[i], p), i


def test_newton_schulz_orthogonalises():
    g = torch.randn(32, 48, generator=torch.Generator().manual_seed(1))
    for dtype in (torch.bfloat16, torch.float32):
        o = newton_schulz(g, 5, dtype).float()
        s = torch.linalg.svdvals(o)
        assert s.min() > 0.5 and s.max() < 1.3, dtype  # the quintic lands near 1, not on it
        assert newton_schulz(g.T, 5, dtype).float().T.sub(o).abs().max() < 1e-2  # transposes


def test_newton_schulz_precision():
    """"auto": float32 on CPU (layouts agree to float32 tolerance), bfloat16 on CUDA."""
    model = build_model(ModelConfig(preset="tiny"), seed=0)
    auto = MUON.model_copy(update={"muon_ns_dtype": "auto"})
    assert build_optimizer(model, auto, torch.device("cpu")).ns_dtype == torch.float32
    assert build_optimizer(model, MUON, torch.device("cpu")).ns_dtype == torch.bfloat16


def test_muon_trains_hidden_matrices_and_adamw_the_rest():
    model = build_model(ModelConfig(preset="tiny-moe"), seed=0)
    groups = muon_groups(model, MUON)
    muon = _names(model, [p for g in groups if g.get("muon") for p in g["params"]])
    adamw = _names(model, [p for g in groups if not g.get("muon") for p in g["params"]])
    assert muon | adamw == {n for n, _ in model.named_parameters()} and not muon & adamw
    assert {"layers.0.attention.wq.weight", "layers.0.feed_forward.w2.weight",
            "layers.1.feed_forward.experts.w1", "layers.1.feed_forward.shared.w3.weight"} <= muon
    assert all(n.startswith(("tok_embeddings.", "output.")) or "norm" in n or "router" in n
               for n in adamw), adamw
    assert {"tok_embeddings.weight", "output.weight",
            "layers.1.feed_forward.router.weight"} <= adamw
    # Muon's groups are decayed; AdamW's as with optim.name = "adamw"
    assert all(g["weight_decay"] == 0.1 for g in groups if g.get("muon"))
    # configurable: the output layer forced onto Muon, the first layer's attention kept off
    cfg = MUON.model_copy(update={"muon_force": ["output.weight"],
                                  "muon_adamw": [*MUON.muon_adamw, "layers.0.attention.*"]})
    groups = muon_groups(model, cfg)
    muon = _names(model, [p for g in groups if g.get("muon") for p in g["params"]])
    assert "output.weight" in muon and "layers.0.attention.wq.weight" not in muon


def test_forcing_muon_on_a_vector_is_refused_in_one_line():
    model = build_model(ModelConfig(preset="tiny-llama"), seed=0)
    cfg = MUON.model_copy(update={"muon_force": ["*norm*"]})
    with pytest.raises(TesselError, match=r"optim.muon_force names layers.0.attention_norm.weight "
                                          r"of shape \(64,\): Muon trains matrices only") as err:
        build_optimizer(model, cfg, torch.device("cpu"))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"optim.name": "sgd"}, "optim.name: input should be 'adamw' or 'muon'"),
    ({"optim.muon_force": ["output.weight"]}, "optim.muon_force is set but optim.name='adamw'"),
    ({"optim.name": "muon", "lora.enabled": True}, "lora.enabled trains its adapters with AdamW"),
])
def test_bad_optimizer_settings_are_refused(overrides, message):
    from tessel.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        Config.load(None, overrides)


def test_muon_refuses_offloaded_optimizer_state():
    from tessel.parallel.check import check_layout
    from tessel.parallel.dims import ParallelDims, ParallelError

    cfg = Config.load(None, {"optim.name": "muon", "parallel.offload": "optimizer"})
    with pytest.raises(ParallelError, match="runs AdamW only, not optim.name = 'muon'"):
        check_layout(cfg, ParallelDims.from_config(cfg.parallel, 1), "cpu", "fp32")


def test_muon_checkpoint_holds_its_momentum_and_resumes_exactly(tmp_path: Path):
    from tessel.checkpoint import load_optimizer, save_checkpoint

    batches = _batches(5)
    full = build_model(ModelConfig(preset="tiny-llama"), seed=0)
    full_opt = build_optimizer(full, MUON, torch.device("cpu"))
    for x in batches:
        _step(full, x, full_opt)
    first = build_model(ModelConfig(preset="tiny-llama"), seed=0)
    opt = build_optimizer(first, MUON, torch.device("cpu"))
    for x in batches[:3]:
        _step(first, x, opt)
    path = save_checkpoint(tmp_path, 3, first, opt, {})
    resumed = build_model(ModelConfig(preset="tiny-llama"), seed=1)
    resumed.load_state_dict(first.state_dict())
    opt = build_optimizer(resumed, MUON, torch.device("cpu"))
    load_optimizer(path, resumed, opt)
    buffers = [s for s in opt.state.values() if "momentum_buffer" in s]
    assert len(buffers) == 14 and all(s["momentum_buffer"].abs().sum() > 0 for s in buffers)
    for x in batches[3:]:
        _step(resumed, x, opt)
    for (name, a), b in zip(full.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


def test_a_muon_run_trains_and_resumes_only_with_muon(tiny_config):
    """The trainer runs Muon (loss falls); resuming its checkpoint with AdamW, or with other
    Muon patterns, is refused in one line, without touching the run."""
    from tessel.checkpoint import CheckpointError
    from tessel.observe.metrics import read_metrics
    from tessel.train import Trainer

    cfg = tiny_config(**{"optim.name": "muon", "train.steps": 4, "checkpoint.interval": 4})
    Trainer(cfg, console=False).train()
    run = Path(cfg.run.dir)
    losses = [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0]
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for change, message in (({"optim.name": "adamw"}, "optim.name was 'muon' in the run, now "
                                                      "'adamw'; resume without changing it or "
                                                      "start a new run \\(from its weights"),
                            ({"optim.muon_adamw": ["output.*"]}, "optim.muon_adamw was")):
        with pytest.raises(CheckpointError, match=message) as err:
            Trainer(Config.load(run / "config.toml", change), resume=True, console=False)
        assert "\n" not in str(err.value)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


UNTIED = {"model.tie_embeddings": False}  # the tiny preset's output layer is its embedding


@pytest.mark.parametrize(("force", "model", "needle"), [
    (["ouptut.weight"], UNTIED, "pattern 'ouptut.weight' names no parameter of this model (did "
                                "you mean output.weight"),
    (["output.weight", "layers.*.attn.*"], UNTIED, "'layers.*.attn.*' names no parameter"),
    (["output.weight"], {}, "(model.tie_embeddings: the output layer is tok_embeddings.weight)"),
])
def test_a_muon_force_pattern_that_names_no_parameter_is_refused_before_the_run(
        tiny_config, force, model, needle):
    """A typo once trained exactly as without the pattern; now it is one line, before the run
    directory exists (also from `tessel train --nproc`, before torchrun), and the fixed
    config trains."""
    from tessel.cli.train import check_before_launch
    from tessel.train import Trainer

    cfg = tiny_config(**{"optim.name": "muon", "optim.muon_force": force, "train.steps": 2,
                         "checkpoint.interval": 0, **model})
    for check in (lambda: Trainer(cfg, console=False), lambda: check_before_launch(cfg, 2)):
        with pytest.raises(TesselError) as err:
            check()
        assert needle in str(err.value) and "\n" not in str(err.value)
        assert not Path(cfg.run.dir).exists()
    fixed = cfg.with_overrides({"optim.muon_force": ["output.weight"], **UNTIED})
    assert Trainer(fixed, console=False).train().exit_code == 0
