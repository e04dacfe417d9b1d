import math

import pytest
import torch

from tessel.config import ModelConfig, OptimConfig
from tessel.models import build_model
from tessel.train.optim import build_optimizer, lr_at, param_groups


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
