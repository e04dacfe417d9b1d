"""Qwen2, Qwen3 (dense) and OLMo 2 against `transformers` itself: each built small and random
in the test (no hub), imported, compared logit by logit in fp32 and token by token in greedy
decoding, exported and reloaded by transformers, round-tripped bit for bit; what tessel
cannot compute refused in one line, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_cli import assert_one_line_error, tessel
from test_hf import (
    VOCAB,
    assert_greedy_and_direct_weights,
    assert_round_trip,
    save_hf,
    tessel_model,
)
from test_hf_moe import _edit_config
from transformers import (
    AutoModelForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tessel.cli import main
from tessel.config import Config

RTOL = 1e-5  # fp32: max |difference| over max |logit|

_SHAPE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 160,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 256, "tie_word_embeddings": False}


def hf_qwen2(**kw) -> Qwen2ForCausalLM:
    """q/k/v biases (save_hf makes them nonzero), GQA, untied."""
    return Qwen2ForCausalLM(Qwen2Config(**{**_SHAPE, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
                                           **kw}))


def hf_qwen3(**kw) -> Qwen3ForCausalLM:
    """QK-norm per head, heads of 24 on d_model 64 (q_proj 64 -> 96), tied embeddings."""
    return Qwen3ForCausalLM(Qwen3Config(**{**_SHAPE, "head_dim": 24, "rope_theta": 1e6,
                                           "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                                           **kw}))


def hf_olmo2(**kw) -> Olmo2ForCausalLM:
    """QK-norm over each projection, norms after attention and MLP, GQA."""
    return Olmo2ForCausalLM(Olmo2Config(**{**_SHAPE, "rope_theta": 500000.0,
                                           "rms_norm_eps": 1e-6, "pad_token_id": 0,
                                           "eos_token_id": 1, **kw}))


FAMILIES = {"qwen2": hf_qwen2, "qwen3": hf_qwen3, "olmo2": hf_olmo2}
# What each family turns on in tessel's model.
FIELDS = {"qwen2": {"qkv_bias": True}, "qwen3": {"qk_norm": True, "qk_norm_scope": "head"},
          "olmo2": {"qk_norm": True, "qk_norm_scope": "projection", "norm_placement": "post"}}


def relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours[..., :VOCAB] - theirs).abs().max() / theirs.abs().max()).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_import_generate_export_match_transformers(family, tmp_path: Path, capsys):
    hf = FAMILIES[family]().eval()
    src = save_hf(hf, tmp_path / "hf")
    assert main(["convert", "hf-to-tessel", str(src), str(tmp_path / "tessel")]) == 0
    m = Config.load(tmp_path / "tessel/config.toml").model
    assert {k: getattr(m, k) for k in FIELDS[family]} == FIELDS[family]
    model = tessel_model(tmp_path / "tessel")
    x = torch.randint(0, VOCAB, (3, 60))
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
    imported = relative(ours, theirs)
    assert imported <= RTOL
    assert_greedy_and_direct_weights(model, hf, src, x[0, :10].tolist())
    # Export: the same tensors bit for bit; transformers reloads them to the same logits.
    capsys.readouterr()
    assert_round_trip(src, tmp_path / "tessel", tmp_path / "back")
    assert hf.__class__.__name__ in capsys.readouterr().out
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert again.__class__ is hf.__class__
    with torch.no_grad():
        exported = relative(ours, again(x).logits)
    print(f"{family}: relative logit difference HF -> tessel {imported:.1e}, "
          f"tessel -> HF {exported:.1e}")
    assert exported <= RTOL


def test_what_tessel_cannot_compute_is_refused_in_one_line(tmp_path: Path, capsys):
    srcs = {f: save_hf(make(), tmp_path / f) for f, make in FAMILIES.items()}
    cases = [
        ("qwen2", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                       "rope_theta": 1e6}}, "rope scaling 'yarn' is not supported"),
        ("qwen3", {"vision_config": {"depth": 2}}, "vision_config: a vision tower is not supported"),
        ("qwen3", {"attention_bias": True}, "attention_bias=true is not supported"),
        ("olmo2", {"attention_bias": True}, "attention_bias=true is not supported"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1,
                   "layer_types": None}, "sliding-window attention in layers [1]"),
        ("qwen3", {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8},
         "sliding-window attention in layers [1]"),
    ]
    for i, (family, changes, needle) in enumerate(cases):
        bad = _edit_config(srcs[family], tmp_path / f"bad{i}", **changes)
        capsys.readouterr()
        assert main(["convert", "hf-to-tessel", str(bad), str(tmp_path / f"out{i}")]) == 2, needle
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], (needle, err)
        assert not (tmp_path / f"out{i}").exists()
    # The command itself: exit 2, one line (and model.init_from refuses the same).
    assert_one_line_error(tessel("convert", "hf-to-tessel", str(tmp_path / "bad2"),
                                 str(tmp_path / "o")), "attention_bias=true is not supported")
    assert main(["train", f"--model.init_from={tmp_path / 'bad1'}", "--data.source=synthetic",
                 f"--run.dir={tmp_path / 'r'}"]) == 2
    assert "vision_config" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("changes, needle", [
    ({"qkv_bias": True, "qk_norm": True},
     "Qwen3ForCausalLM is dense with qkv_bias=False, QK-norm head"),
    ({"norm_placement": "post"}, "Olmo2ForCausalLM is dense with qkv_bias=False, QK-norm "
                                 "projection and norm_placement='post'"),
    ({"qkv_bias": True, "moe_experts": 4, "moe_ffn_hidden": 32},
     "MixtralForCausalLM has no q/k/v biases"),
])
def test_exports_refuse_what_the_family_cannot_hold(changes, needle, tmp_path: Path, capsys):
    from tessel.checkpoint.hf_arch import HFError
    from tessel.checkpoint.hf_models import for_model
    from tessel.config import ModelConfig

    m = ModelConfig(preset="tiny-llama", **changes)
    with pytest.raises(HFError) as exc:
        for_model(m).hf_config(m)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.budget(30)  # seconds on the reference machine: measured 22, +~40%
@pytest.mark.parametrize("family", FAMILIES)
def test_lora_adapters_load_in_peft_and_merge_as_transformers_computes(family, tmp_path: Path,
                                                                       corpus: Path):
    """A LoRA run on every projection of the family's model, its peft adapters written
    during training (lora.export = "peft") under the family's module names: peft on the
    transformers base computes tessel's logits, and so does the merged export."""
    from peft import PeftModel
    from test_lora import lora_overrides, tessel_lora_model

    from tessel.checkpoint import latest_checkpoint
    from tessel.checkpoint.init_from import load_config
    from tessel.train import Trainer

    hf = FAMILIES[family]().eval()
    src = save_hf(hf, tmp_path / "hf", corpus)
    run = tmp_path / "run"
    overrides = lora_overrides(src, run, corpus, **{
        "train.steps": 2, "checkpoint.hf_export_interval": 2, "lora.export": "peft",
        "data.cache_dir": str(tmp_path / "cache")})
    Trainer(load_config(None, overrides), console=False).train()
    cfg = Config.load(run / "config.toml")
    ours = tessel_lora_model(src, latest_checkpoint(run / "checkpoints"), cfg)
    adapters = run / "checkpoints/step_00000002/hf"
    written = json.loads((adapters / "adapter_config.json").read_text())
    assert sorted(written["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    x = torch.randint(0, VOCAB, (2, 40))
    base = type(hf).from_pretrained(src).eval()
    with torch.no_grad():
        plain = base(x).logits
        theirs = PeftModel.from_pretrained(base, adapters).eval()(x).logits
        mine = ours(x)
    assert relative(mine, theirs) <= RTOL
    assert (plain - theirs).abs().max() > 1e-2  # the adapters matter
    assert main(["convert", "tessel-to-hf", str(run), str(tmp_path / "merged")]) == 0
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(x).logits
    assert relative(mine, merged) <= 1e-4
