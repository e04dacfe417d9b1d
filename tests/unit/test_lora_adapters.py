"""tessel/models/lora.py on its own: target names, peft's initialisation, what is frozen,
the adapters' term, and the [lora] section's checks."""

from __future__ import annotations

import math

import pytest
import torch
from saved_memory import SavedTensorMeter

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


def _saved_bytes(base_dtype: torch.dtype | None, autocast: bool) -> tuple[int, torch.dtype]:
    """Bytes autograd keeps after a forward of the tiny model with adapters on every
    projection (base held in `base_dtype`), and the dtype of wq's output."""
    model = _model()
    add_lora(model, ["wq", "wk", "wv", "wo", "w1", "w2", "w3"], rank=4, alpha=8.0)
    if base_dtype is not None:
        cast_base(model, base_dtype)
    wq = model.layers["0"].attention.wq
    out = []
    wq.register_forward_hook(lambda _m, _a, y: out.append(y.dtype))
    meter = SavedTensorMeter.for_modules([model])
    with meter.measuring(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        model(torch.randint(0, 500, (2, 32)))
    return meter.peak, out[0]


def test_a_bf16_base_saves_no_more_than_a_float32_one():
    """Without autocast the adapters take the projection's input as it came, not its bf16
    cast: adapters of one input (wq/wk/wv, w1/w3) share it rather than each keeping its own
    float32 copy (this model kept 1.20x the float32 base's bytes, now 1.0x); under autocast
    the projection returns what a float32 base's does (bf16), not a float32 copy that the
    next operators keep (0.95x, now 0.73x)."""
    fp32_base, dtype = _saved_bytes(None, autocast=False)
    bf16_base, bf16_dtype = _saved_bytes(torch.bfloat16, autocast=False)
    assert bf16_base <= fp32_base and dtype == bf16_dtype == torch.float32
    fp32_base, dtype = _saved_bytes(None, autocast=True)
    bf16_base, bf16_dtype = _saved_bytes(torch.bfloat16, autocast=True)
    assert bf16_base < fp32_base and dtype == bf16_dtype == torch.bfloat16


def test_the_adapters_of_a_bf16_base_see_its_unrounded_input():
    model = _model()
    add_lora(model, ["wq"], rank=4, alpha=8.0)
    cast_base(model, torch.bfloat16)
    wq = model.layers["0"].attention.wq
    with torch.no_grad():
        wq.lora_B.weight.normal_()
    h = torch.randn(3, 64)
    base = (h.bfloat16() @ wq.weight.T).float()
    want = base + 2.0 * h @ wq.lora_A.weight.T @ wq.lora_B.weight.T  # peft: x cast to A's dtype
    assert torch.allclose(wq(h), want, rtol=1e-5, atol=1e-5)  # bf16 rounding: ~1e-3


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
