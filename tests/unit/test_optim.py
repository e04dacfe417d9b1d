import math

import pytest
import torch

from tessel.config import ModelConfig, OptimConfig
from tessel.models import build_model
from tessel.optim.groups import build_optimizer, param_groups
from tessel.optim.lr_schedule import lr_at


def test_no_weight_decay_on_norms_biases_embeddings():
    model = build_model(ModelConfig(preset="tiny"), seed=0)
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert "layers.0.attention.wq.weight" in decayed
    assert not any("norm" in n or n.endswith("bias") or "embeddings" in n for n in decayed)
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    opt = build_optimizer(model, OptimConfig(), torch.device("cpu"))
    assert opt.defaults["foreach"] is True


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant", "wsd"])
def test_schedules(schedule):
    cfg = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1, schedule=schedule,
                      decay_fraction=0.2)
    lrs = [lr_at(s, 100, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)  # linear warm-up
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10]))
    if schedule == "constant":
        assert set(lrs[10:]) == {1.0}
        return
    assert all(b <= a + 1e-12 for a, b in zip(lrs[10:], lrs[11:]))  # never increases after
    assert lrs[-1] == pytest.approx(0.1)  # the last step lands on the floor
    if schedule == "cosine":
        assert lrs[10 + 89 // 2] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 44 / 89)))
    if schedule == "wsd":
        assert lrs[79] == 1.0 and lrs[85] < 1.0


def _steps(opt: torch.optim.Optimizer, model: torch.nn.Module, n: int, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for step in range(n):
        for group in opt.param_groups:
            group["lr"] = 1e-2 * (step + 1)  # the trainer sets lr every step
        model(torch.randint(0, 512, (2, 8), generator=gen)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_host_offloaded_adamw_is_adamw_bit_for_bit_and_checkpoints_alike(tmp_path):
    from tessel.checkpoint import load_optimizer, save_checkpoint
    from tessel.optim.offload import HostAdamW

    cfg = OptimConfig(weight_decay=0.1)
    ref, off = (build_model(ModelConfig(preset="tiny-llama"), seed=0) for _ in range(2))
    ref_opt = build_optimizer(ref, cfg, torch.device("cpu"))
    off_opt = build_optimizer(off, cfg, torch.device("cpu"), offload=True)
    assert isinstance(off_opt, HostAdamW)
    _steps(ref_opt, ref, 3)
    _steps(off_opt, off, 3)
    for a, b in zip(ref.parameters(), off.parameters()):
        assert torch.equal(a, b)

    # Its checkpoint is AdamW's: an offloaded run resumes without offload and vice versa.
    path = save_checkpoint(tmp_path, 3, off, off_opt, {})
    for offload in (False, True):
        model = build_model(ModelConfig(preset="tiny-llama"), seed=0)
        model.load_state_dict(off.state_dict())
        opt = build_optimizer(model, cfg, torch.device("cpu"), offload=offload)
        load_optimizer(path, model, opt)
        want = ref_opt.state_dict()["state"]
        got = opt.state_dict()["state"]
        for k in want:
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(want[k][key], got[k][key]), (offload, k, key)
        _steps(opt, model, 2, seed=1)
        if offload:
            continued = model
        else:
            plain = model
    for a, b in zip(continued.parameters(), plain.parameters()):
        assert torch.equal(a, b)
