"""Low-precision optimizer state (optim.state_dtype): stochastic rounding, AdamW's and
Muon's bfloat16 state against their float32 selves, torchao's 8-bit AdamW, the refusals."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tessel.config import Config, ConfigError, ModelConfig, OptimConfig
from tessel.errors import TesselError
from tessel.models import build_model
from tessel.optim.groups import build_optimizer, param_groups
from tessel.optim.lowbit import StateAdamW, stochastic_round
from tessel.optim.lr_schedule import lr_at

BF16 = OptimConfig(lr=1e-2, weight_decay=0.1, state_dtype="bfloat16")
CPU = torch.device("cpu")


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        model(torch.randint(0, 512, (2, 8), generator=gen)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour():
    x = torch.tensor([1.0 + 2**-10, -3.0 - 2**-9, 1e-20, 0.15625, -7.0])  # last two exact
    down = x.to(torch.bfloat16)  # not always down: compare with the two neighbours
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([stochastic_round(x, gen).float() for _ in range(4000)])
    lo = torch.where(x >= 0, x.bfloat16().float().minimum(x), x.bfloat16().float().minimum(x))
    for i in range(len(x)):
        values = set(draws[:, i].tolist())
        assert len(values) <= 2, (i, values)
        assert all(abs(v - x[i].item()) <= abs(x[i].item()) * 2**-7 for v in values), i
    assert torch.equal(draws[:, 3:], x[3:].expand(4000, 2))  # representable: unchanged
    # the mean converges to x (a bfloat16 step is 2**-7 relative; 4000 draws: ~1.6% of it)
    assert ((draws.mean(0) - x).abs() <= x.abs() * 2**-7 * 0.05).all(), draws.mean(0) - x
    assert down.dtype == torch.bfloat16 and lo.shape == x.shape


def test_float32_state_adamw_is_torch_adamw_bit_for_bit():
    """tessel's AdamW update (what bfloat16 state runs) with float32 state = PyTorch's."""
    a, b = (build_model(ModelConfig(preset="tiny-llama"), seed=0) for _ in range(2))
    ours = StateAdamW(param_groups(a, 0.1), state_dtype="float32", lr=1e-2, betas=(0.9, 0.95),
                      eps=1e-8)
    ref = torch.optim.AdamW(param_groups(b, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                            foreach=False)
    _train(a, ours, 4)
    _train(b, ref, 4)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_bfloat16_state_tracks_float32_state_and_halves_it(name):
    cfg = BF16.model_copy(update={"name": name})
    low, full = (build_model(ModelConfig(preset="tiny-llama"), seed=0) for _ in range(2))
    start = {n: p.detach().clone() for n, p in low.named_parameters()}
    opt_low = build_optimizer(low, cfg, CPU)
    opt_full = build_optimizer(full, cfg.model_copy(update={"state_dtype": "float32"}), CPU)
    _train(low, opt_low, 6)
    _train(full, opt_full, 6)
    states = [t for s in opt_low.state.values() for k, t in s.items() if k != "step"]
    assert states and all(t.dtype == torch.bfloat16 for t in states)
    for (n, p), q in zip(low.named_parameters(), full.parameters()):
        moved = (q - start[n]).norm()
        # within 5% (AdamW) / 10% (Muon: orthogonalisation amplifies) of how far it moved
        assert (p - q).norm() <= (0.05 if name == "adamw" else 0.1) * moved + 1e-6, n


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_bfloat16_state_resumes_bit_for_bit(tmp_path: Path, name):
    """The rounding's random bits come from (step, parameter, shard): a resumed run rounds
    as the uninterrupted one did."""
    from tessel.checkpoint import load_optimizer, save_checkpoint

    cfg = BF16.model_copy(update={"name": name})
    full = build_model(ModelConfig(preset="tiny-llama"), seed=0)
    _train(full, build_optimizer(full, cfg, CPU), 5)
    first = build_model(ModelConfig(preset="tiny-llama"), seed=0)
    opt = build_optimizer(first, cfg, CPU)
    _train(first, opt, 3)
    path = save_checkpoint(tmp_path, 3, first, opt, {})
    resumed = build_model(ModelConfig(preset="tiny-llama"), seed=1)
    resumed.load_state_dict(first.state_dict())
    opt = build_optimizer(resumed, cfg, CPU)
    load_optimizer(path, resumed, opt)
    # loading casts state to the parameters' dtype; it stays bfloat16
    assert all(t.dtype == torch.bfloat16 for s in opt.state.values() for k, t in s.items()
               if k != "step")
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):  # the batches of steps 4 and 5, as _train draws them
        torch.randint(0, 512, (2, 8), generator=gen)
    for _ in range(2):
        resumed(torch.randint(0, 512, (2, 8), generator=gen)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for (n, p), q in zip(full.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), n


# seconds on the reference machine: 17.7-20.4 s at machine factors 0.49-0.51 with an empty
# compile cache, as CI's is (torchao compiles its update once per parameter shape), +~40%
@pytest.mark.budget(58)
def test_int8_state_is_torchaos_adamw8bit():
    pytest.importorskip("torchao.optim")
    from torchao.optim import AdamW8bit

    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, state_dtype="int8")
    a, b = (build_model(ModelConfig(preset="tiny-llama"), seed=0) for _ in range(2))
    ours = build_optimizer(a, cfg, CPU)
    ref = AdamW8bit(param_groups(b, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    _train(a, ours, 3)
    _train(b, ref, 3)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n


@pytest.mark.budget(40)  # seconds on the reference machine: a fresh process imports torchao
def test_int8_state_prints_none_of_torchaos_import_noise():
    """torchao's import logged a "Failed to load .../torchao/_C_mxfp8...so" line for each
    compiled extension this machine cannot load (the 8-bit AdamW needs none), and its first
    step a cache warning: a fresh process, as `tessel train` is, builds and steps it."""
    pytest.importorskip("torchao.optim")
    code = ("import torch\n"
            "from tessel.config import ModelConfig, OptimConfig\n"
            "from tessel.models import build_model\n"
            "from tessel.optim.groups import build_optimizer\n"
            "model = build_model(ModelConfig(preset='tiny-llama'), seed=0)\n"
            "opt = build_optimizer(model, OptimConfig(state_dtype='int8'), torch.device('cpu'))\n"
            "for _ in range(2):\n"
            "    model(torch.randint(0, 512, (2, 8))).float().pow(2).mean().backward()\n"
            "    opt.step()\n"
            "print('trained')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and proc.stdout == "trained\n", proc.stderr
    noise = [line for line in proc.stderr.splitlines()
             if "torchao" in line or "OptimState8bit" in line or "Enum subclass" in line]
    assert noise == [], proc.stderr


def test_int8_state_without_torchao_is_refused_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # import fails as if absent
    model = build_model(ModelConfig(preset="tiny"), seed=0)
    with pytest.raises(TesselError, match=r"torchao is not installed: pip install "
                                          r"'tessel\[lowbit\]'") as err:
        build_optimizer(model, OptimConfig(state_dtype="int8"), CPU)
    assert "\n" not in str(err.value)


def test_low_precision_state_refusals():
    from tessel.parallel.check import check_layout
    from tessel.parallel.dims import ParallelDims, ParallelError

    with pytest.raises(ConfigError, match="'int8' is torchao's 8-bit AdamW, not 'muon'"):
        Config.load(None, {"optim.name": "muon", "optim.state_dtype": "int8"})
    for overrides, world, message in (
        ({"optim.state_dtype": "int8", "parallel.tp": 2}, 2, "not with tensor or expert"),
        ({"optim.state_dtype": "bfloat16", "parallel.offload": "optimizer"}, 1,
         "keeps float32 optimizer state"),
    ):
        cfg = Config.load(None, overrides)
        with pytest.raises(ParallelError, match=message):
            check_layout(cfg, ParallelDims.from_config(cfg.parallel, world), "cpu", "fp32")


@pytest.mark.parametrize(("name", "dtype"), [("muon", "bfloat16"), ("adamw", "int8")])
def test_low_precision_state_trains_through_the_trainer(tiny_config, name, dtype):
    """The trainer sets each step's learning rate on them (torchao keeps it a tensor)."""
    if dtype == "int8":
        pytest.importorskip("torchao.optim")
    from tessel.observe.metrics import read_metrics
    from tessel.train import Trainer

    # tiny-llama: torchao compiles its update once per parameter shape (the `tiny` preset's
    # took 43 s on a cold compile cache); these are the shapes that
    # test_int8_state_is_torchaos_adamw8bit had compiled already in this process
    cfg = tiny_config(**{"model.preset": "tiny-llama", "optim.name": name,
                         "optim.state_dtype": dtype, "train.steps": 4})
    trainer = Trainer(cfg, console=False)
    trainer.train()
    losses = [r["loss"] for r in read_metrics(Path(cfg.run.dir) / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0]
    want = lr_at(3, 4, cfg.optim)  # the last step's
    assert all(float(g["lr"]) == pytest.approx(want) for o in trainer.optimizers
               for g in o.param_groups)
