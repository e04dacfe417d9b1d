"""tessel/models/lora.py on its own: target names, peft's initialisation, what is frozen,
the adapters' term, and the [lora] section's checks."""

from __future__ import annotations

import math

import pytest
import torch

from tessel.config import Config, ConfigError
from tessel.models.lora import (
    LoraError,
    adapted_modules,
    add_lora,
    cast_base,
    initial_value,
    resolve_targets,
)
from tessel.models.transformer import build_model


def test_targets_accept_tessel_and_hf_names():
    # tessel's order, each once
    assert resolve_targets(["q_proj", "wv", "attention.wo", "down_proj", "w2"]) == [
        "wq", "wv", "wo", "w2"]
    with pytest.raises(LoraError, match="no projection named 'qkv'"):
        resolve_targets(["qkv"])
    with pytest.raises(LoraError, match="no projection named 'feed_forward.wq'"):
        resolve_targets(["feed_forward.wq"])


def test_init_is_peft_s_and_the_model_starts_as_the_base():
    a = initial_value("layers.0.attention.wq.lora_A.weight", (8, 400), seed=1)
    bound = 1 / math.sqrt(400)  # kaiming_uniform_(a=sqrt(5)) on (8, 400)
    assert a.abs().max() <= bound and a.abs().max() > 0.95 * bound
    assert a.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.05)
    assert torch.equal(a, initial_value("layers.0.attention.wq.lora_A.weight", (8, 400), 1))
    assert not torch.equal(a, initial_value("layers.1.attention.wq.lora_A.weight", (8, 400), 1))
    assert not initial_value("layers.0.attention.wq.lora_B.weight", (400, 8), 1).any()


def _model():
    cfg = Config.load(None, {"model.preset": "tiny-llama", "model.dropout": 0.0})
    return build_model(cfg.model, seed=3)


def test_only_adapters_train_and_their_term_is_scaled_b_a_x():
    model = _model()
    x = torch.randint(0, 500, (2, 16))
    before = model(x)
    names = add_lora(model, ["q_proj", "down_proj"], rank=4, alpha=8.0)
    assert names == ["layers.0.attention.wq", "layers.0.feed_forward.w2",
                     "layers.1.attention.wq", "layers.1.feed_forward.w2"]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == [f"{m}.{k}.weight" for m in names for k in ("lora_A", "lora_B")]
    assert torch.equal(model(x), before)  # B is zero
    wq = adapted_modules(model)["layers.0.attention.wq"]
    with torch.no_grad():
        wq.lora_B.weight.normal_()
    h = torch.randn(3, 64)
    want = h @ wq.weight.T + 2.0 * h @ wq.lora_A.weight.T @ wq.lora_B.weight.T
    assert torch.allclose(wq(h), want, atol=1e-5)


def test_a_bf16_base_keeps_fp32_adapters_and_output():
    model = _model()
    add_lora(model, ["wq"], rank=4, alpha=4.0)
    cast_base(model, torch.bfloat16)
    wq = model.layers["0"].attention.wq
    assert wq.weight.dtype == torch.bfloat16 and wq.lora_A.weight.dtype == torch.float32
    assert model(torch.randint(0, 500, (1, 8))).dtype == torch.float32


def test_projections_the_model_lacks_are_refused():
    cfg = Config.load(None, {"model.preset": "tiny"})  # GELU MLP: no w3
    model = build_model(cfg.model, seed=0)
    with pytest.raises(LoraError, match=r"layers.0.feed_forward.w3 does not exist"):
        add_lora(model, ["up_proj"], rank=2, alpha=2.0)


def test_the_lora_section_checks_its_targets():
    with pytest.raises(ConfigError, match="no projection named 'c_attn'"):
        Config.load(None, {"lora.enabled": True, "lora.targets": ["c_attn"]})
    with pytest.raises(ConfigError, match="lora.targets is empty"):
        Config.load(None, {"lora.enabled": True, "lora.targets": []})
    with pytest.raises(ConfigError, match="train.fp8"):
        Config.load(None, {"lora.enabled": True, "train.fp8": True})
