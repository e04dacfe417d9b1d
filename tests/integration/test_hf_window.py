"""Mistral and Gemma 3 (the sliding-window architectures) against `transformers` itself:
tiny random models built in the test (no hub), prompts longer than the window, logits and
greedy tokens compared, export reloaded, the round trip bit-exact in the weights, and the
variants tessel cannot represent refused in one line with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_cli import assert_one_line_error, tessel_here
from test_hf import VOCAB, save_hf, tessel_model
from transformers import (
    AutoModelForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
)

from tessel.checkpoint.hf_models import for_hf_config
from tessel.cli import main
from tessel.generate import sample

WINDOW = 8


def hf_mistral(**kw) -> MistralForCausalLM:
    return MistralForCausalLM(MistralConfig(**{
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rope_theta": 1e6, "sliding_window": WINDOW, "tie_word_embeddings": False, **kw}))


def hf_gemma3(**kw) -> Gemma3ForCausalLM:
    """Local, global, local layers; linear RoPE scaling on the global one, its own base on the
    local ones; a query scale that is not 1/sqrt(head_dim); Gemma 2's final soft-cap."""
    return Gemma3ForCausalLM(Gemma3TextConfig(**{
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 256, "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_theta": 1e6,
        "rope_local_base_freq": 1e4, "query_pre_attn_scalar": 24,
        "final_logit_softcapping": 30.0, **kw}))


MODELS = {"mistral": hf_mistral, "gemma3": hf_gemma3}


def close(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """Equal to a relative 1e-5 of the logits' scale (fp32)."""
    return bool((ours - theirs).abs().max() <= 1e-5 * theirs.abs().max())


@pytest.mark.parametrize("arch", list(MODELS))
def test_window_models_match_transformers_and_round_trip(arch, tmp_path: Path):
    hf = MODELS[arch]().eval()
    src = save_hf(hf, tmp_path / "hf")
    assert main(["convert", "hf-to-tessel", str(src), str(tmp_path / "tessel")]) == 0
    model = tessel_model(tmp_path / "tessel")
    assert model.cfg.sliding_window == WINDOW
    x = torch.randint(0, VOCAB, (2, 100))  # 12x the window
    with torch.no_grad():
        ours, theirs = model(x)[..., :VOCAB], hf(x).logits
    assert close(ours, theirs)
    # The window matters at this length: the same weights without it give other logits.
    unwindowed = tessel_model(tmp_path / "tessel", model.cfg.model_copy(
        update={"sliding_window": None, "layer_types": None}))
    with torch.no_grad():
        assert not close(unwindowed(x)[..., :VOCAB], theirs)
    # Greedy decoding past the window picks the same tokens (transformers with its cache).
    prompt = x[0, :10].tolist()
    got = sample(model, prompt, 24, temperature=0)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                       eos_token_id=None, pad_token_id=0)[0, 10:].tolist()
    assert got == want
    # Back to HF: bit-exact weights, and transformers reloads the same logits.
    assert main(["convert", "tessel-to-hf", str(tmp_path / "tessel"), str(tmp_path / "back")]) == 0
    before, after = load_file(src / "model.safetensors"), load_file(tmp_path / "back/model.safetensors")
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(reloaded) is type(hf)
    with torch.no_grad():
        assert torch.equal(reloaded(x).logits, theirs)


def _refused(src: Path, out: Path, expected: str) -> None:
    assert_one_line_error(tessel_here("convert", "hf-to-tessel", str(src), str(out)), expected)
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.tmp-*"))


def test_variants_tessel_cannot_represent_are_refused(tmp_path: Path):
    src = save_hf(hf_gemma3(), tmp_path / "gemma")
    cfg = json.loads((src / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    cases = [
        ({**cfg, "attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
        ({**cfg, "rope_parameters": {**cfg["rope_parameters"], "full_attention": {
            "rope_type": "yarn", "factor": 8.0, "rope_theta": 1e6}}},
         "rope scaling 'yarn' is not supported"),
        ({**cfg, "hidden_activation": "gelu"}, "hidden_activation='gelu' is not supported"),
        ({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
          "text_config": cfg}, "Gemma3ForConditionalGeneration has a vision tower"),
    ]
    for i, (config, expected) in enumerate(cases):
        (bad / "config.json").write_text(json.dumps(config))
        _refused(bad, tmp_path / f"out{i}", expected)
    # Mistral with per-layer kinds (Ministral's), and a Llama config with a window.
    mistral = save_hf(hf_mistral(), tmp_path / "mistral")
    cfg = json.loads((mistral / "config.json").read_text())
    (mistral / "config.json").write_text(json.dumps({**cfg, "layer_types": ["full_attention"] * 2}))
    _refused(mistral, tmp_path / "m", "layer_types is not read by MistralForCausalLM")
    (mistral / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    _refused(mistral, tmp_path / "l", "sliding_window=8 is not supported for LlamaForCausalLM")


def test_preset_parameter_counts_are_transformers_own():
    """Each preset's exact count equals the model transformers builds from the published
    config (on the meta device: no memory)."""
    from tessel.config import ModelConfig
    from tessel.models import param_count

    gemma = {"vocab_size": 262208, "head_dim": 256, "rope_theta": 1e6, "sliding_window": 1024,
             "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_local_base_freq": 1e4,
             "query_pre_attn_scalar": 256, "max_position_embeddings": 131072}
    published = {
        "mistral-7b": (MistralForCausalLM, MistralConfig(
            vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, sliding_window=None, rope_theta=1e6,
            tie_word_embeddings=False)),
        "gemma-3-4b": (Gemma3ForCausalLM, Gemma3TextConfig(
            **gemma, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
            num_attention_heads=8, num_key_value_heads=4)),
        "gemma-3-12b": (Gemma3ForCausalLM, Gemma3TextConfig(
            **gemma, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
            num_attention_heads=16, num_key_value_heads=8)),
        "gemma-3-27b": (Gemma3ForCausalLM, Gemma3TextConfig(
            **{**gemma, "head_dim": 128, "query_pre_attn_scalar": 168}, hidden_size=5376,
            intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32,
            num_key_value_heads=16)),
    }
    counts = {}
    for name, (cls, config) in published.items():
        with torch.device("meta"):
            theirs = sum(p.numel() for p in cls(config).parameters())
        counts[name] = param_count(ModelConfig(preset=name))
        assert counts[name] == theirs, name
        # tessel's preset is the config transformers would import from
        hf = config.to_dict()
        imported = ModelConfig(preset=None, **for_hf_config(hf, name).model_fields(hf, name))
        preset = ModelConfig(preset=name)
        for field in ("sliding_window", "layer_types", "rope_local_theta", "rope_theta",
                      "rope_scaling_factor", "query_scale", "n_kv_heads", "head_dim"):
            assert getattr(imported, field) == getattr(preset, field), (name, field)
    assert counts["mistral-7b"] == 7_248_023_552
    assert counts["gemma-3-4b"] == 3_880_263_168


@pytest.mark.parametrize("arch", list(MODELS))
def test_lora_adapters_load_into_peft_on_the_familys_own_class(arch, tmp_path: Path,
                                                                corpus: Path):
    """A LoRA run from the tiny model exports peft adapters under the family's module names
    (q_proj ... down_proj); peft on the transformers model gives tessel's logits."""
    from peft import PeftModel

    from tessel.checkpoint import latest_checkpoint, read_full
    from tessel.checkpoint.init_from import WeightSource, load_config
    from tessel.models.init import materialise
    from tessel.models.lora import add_lora
    from tessel.models.transformer import Transformer
    from tessel.train import Trainer

    src = save_hf(MODELS[arch](), tmp_path / "hf", corpus)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    cfg = load_config(None, {
        "model.init_from": str(src), "data.source": "files", "data.paths": [str(corpus)],
        "train.seq_len": 32, "train.steps": 2, "train.micro_batch_size": 2,
        "train.global_batch_size": 2, "train.eval_interval": 0, "train.eval_iters": 1,
        "optim.lr": 2e-2, "optim.warmup_steps": 0, "checkpoint.interval": 2,
        "metrics.tensorboard": False, "run.dir": str(tmp_path / "run"), "run.sample_tokens": 0,
        "lora.enabled": True, "lora.rank": 4, "lora.alpha": 8.0, "lora.targets": targets})
    Trainer(cfg, console=False).train()
    assert main(["convert", "tessel-to-hf", str(tmp_path / "run"), str(tmp_path / "peft"),
                 "--peft"]) == 0
    with torch.device("meta"):
        ours = Transformer(cfg.model)
    add_lora(ours, cfg.lora.targets, cfg.lora.rank, cfg.lora.alpha)
    materialise(ours, torch.device("cpu"), 0, WeightSource(src, cfg.model).get)
    ours.load_state_dict(read_full(latest_checkpoint(tmp_path / "run/checkpoints"), "model"),
                         strict=False)
    base = AutoModelForCausalLM.from_pretrained(src).eval()
    assert type(base) is type(MODELS[arch]())
    x = torch.randint(0, VOCAB, (2, 40))
    with torch.no_grad():
        plain = base(x).logits
        theirs = PeftModel.from_pretrained(base, tmp_path / "peft").eval()(x).logits
        mine = ours.eval()(x)[..., :VOCAB]
    assert close(mine, theirs)
    assert not close(plain, theirs)  # the adapters matter: the test means something


def test_gemma3_fine_tunes_with_its_own_chat_template_and_exports_during_training(
        tmp_path: Path, corpus: Path):
    """SFT from the tiny Gemma 3 with its own template (found beside its tokenizer):
    the copy exported during training is a Gemma3ForCausalLM with the trained model's logits,
    and its tokenizer's apply_chat_template renders the conversations as tessel rendered
    them for training (the learned tokens: tests/unit/test_family_templates.py, on the same
    template, tests/data/chat/gemma3.jinja)."""
    from transformers import AutoTokenizer

    from tessel.checkpoint import latest_checkpoint
    from tessel.data.chat_template import resolve_template
    from tessel.data.tokenizer import train_bpe

    src = save_hf(hf_gemma3(), tmp_path / "hf")
    texts = [f.read_text() for f in sorted(corpus.iterdir())]
    train_bpe(texts, VOCAB - 20, special_tokens=("<start_of_turn>", "<end_of_turn>", "<bos>",
                                                 "<eos>")).save(src / "tokenizer.json")
    gemma3 = (Path(__file__).parents[1] / "data/chat/gemma3.jinja").read_text()
    (src / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": gemma3, "bos_token": "<bos>", "eos_token": "<eos>"}))
    chats = [[{"role": "user", "content": f"what is {i} plus {i}?"},
              {"role": "assistant", "content": f"the model reads {2 * i} tokens"}]
             for i in range(40)]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    run = tmp_path / "run"
    out = tessel_here("train", f"--model.init_from={src}", f"--run.dir={run}",
                      "--data.source=sft", f"--data.paths=['{data}']", "--train.seq_len=64",
                      "--train.steps=2", "--train.micro_batch_size=2",
                      "--train.global_batch_size=2", "--train.eval_interval=0",
                      "--train.eval_iters=1", "--checkpoint.interval=2",
                      "--checkpoint.hf_export_interval=2", "--metrics.tensorboard=false",
                      "--run.sample_tokens=0", "--data.split=100,0",
                      f"--data.cache_dir={tmp_path / 'cache'}")
    assert out.returncode == 0, out.stderr
    export = run / "checkpoints/step_00000002/hf"  # the run waits for its export at the end
    theirs = AutoModelForCausalLM.from_pretrained(export).eval()
    assert type(theirs) is Gemma3ForCausalLM
    ours = tessel_model(latest_checkpoint(run / "checkpoints"))
    x = torch.randint(0, VOCAB, (2, 80))
    with torch.no_grad():
        assert close(ours(x)[..., :VOCAB], theirs(x).logits)
    tok = AutoTokenizer.from_pretrained(export)
    trained = resolve_template("auto", src, "<eos>")
    for c in chats[:3]:
        assert tok.apply_chat_template(c, tokenize=False) == trained.render(c)
