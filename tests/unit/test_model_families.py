"""The decoder's Qwen2 / Qwen3 / OLMo 2 features: their presets' parameter counts against
transformers' own models of the published configs (built on the meta device), the planner's
per-rank parameters and the FLOPs formula against the built model, and the config's checks."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tessel.checkpoint.hf_models import for_model
from tessel.config import Config, ConfigError, ModelConfig
from tessel.models import build_model, flops_per_token, param_count
from tessel.planner.memory import stage_parameters

# preset -> (Hugging Face class its export names, published parameter count)
FAMILY_PRESETS = {"qwen2.5-7b": ("Qwen2ForCausalLM", 7_615_616_512),
                  "qwen3-8b": ("Qwen3ForCausalLM", 8_190_735_360),
                  "olmo-2-7b": ("Olmo2ForCausalLM", 7_298_617_344)}


@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_presets_count_what_transformers_builds_from_their_export(name):
    """The preset's export config (config.json as tessel writes it) built by transformers on
    the meta device: the class and its parameter count are the published model's, and
    tessel's count is the same."""
    m = ModelConfig(preset=name)
    hf_class, published = FAMILY_PRESETS[name]
    config = for_model(m).hf_config(m)
    assert config["architectures"] == [hf_class]
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    assert type(hf).__name__ == hf_class
    assert sum(p.numel() for p in hf.parameters()) == published == param_count(m)


VARIANTS = {
    "qwen2": {"qkv_bias": True},
    "olmo2": {"qk_norm": True, "qk_norm_scope": "projection", "norm_placement": "post"},
    "all": {"qkv_bias": True, "qk_norm": True, "qk_norm_scope": "projection",
            "norm_placement": "post", "head_dim": 24},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_planner_parameters_and_flops_match_the_built_model(variant):
    m = ModelConfig(preset="tiny-llama", **VARIANTS[variant])
    model = build_model(m, device="meta")
    params = dict(model.named_parameters())
    assert sum(p.numel() for p in params.values()) == param_count(m)
    assert stage_parameters(m, m.n_layers, True, True, 1).total == param_count(m)
    # Two tensor-parallel ranks: column-parallel weights and biases, row-parallel weights
    # and projection-wide QK-norm split; norms replicated.
    split = ("wq.", "wk.", "wv.", "wo.weight", "w1.", "w2.weight", "w3.", "q_norm", "k_norm",
             "tok_embeddings", "output")
    per_rank = sum(p.numel() // (2 if any(s in n for s in split) and
                                 (m.qk_norm_scope == "projection" or "_norm" not in n) else 1)
                   for n, p in params.items())
    assert stage_parameters(m, m.n_layers, True, True, 2).total == per_rank
    # FLOPs: 6 x the matmul weights a token uses (the output projection's included) + the
    # attention scores; biases and norms are not matmuls.
    matmul = sum(p.numel() for n, p in params.items() if p.ndim == 2 and n != "tok_embeddings.weight")
    assert flops_per_token(m, 32) == 6 * matmul + 12 * m.n_layers * m.q_dim * 32


def test_a_norm_scope_without_qk_norm_is_refused():
    with pytest.raises(ConfigError, match="qk_norm_scope='projection' has no QK-norm to place"):
        Config.load(None, {"model.preset": "tiny-llama", "model.qk_norm_scope": "projection"})


def test_projection_wide_qk_norm_under_norm_offset_starts_as_a_unit_scale():
    """model.norm_offset (Gemma's (1 + weight)) reaches every RMSNorm: a projection-wide
    QK-norm too, whose zero initial weight is then a unit scale, not a zero output."""
    m = ModelConfig(preset="tiny-llama", qk_norm=True, qk_norm_scope="projection",
                    norm_offset=True)
    norm = build_model(m).layers["0"].attention.q_norm
    assert not norm.weight.any()
    x = torch.randn(2, 5, m.q_dim)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.norm_eps)
    torch.testing.assert_close(norm(x), want)
