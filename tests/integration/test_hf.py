"""Hugging Face interop against `transformers` itself: small random HF models built in the
test (no hub), converted both ways, compared logit by logit and token by token. The commands
run in this process (`tessel.cli.main`, or `tessel_here` for its exit code and output): a
`python -m tessel` start-up costs ~5 s and shows nothing these tests check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_cli import assert_one_line_error, tessel_here
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from tessel.checkpoint import latest_checkpoint
from tessel.checkpoint.init_from import WeightSource, load_config
from tessel.cli import main
from tessel.config import Config, ModelConfig
from tessel.data.tokenizer import train_bpe
from tessel.generate import sample
from tessel.models.init import materialise
from tessel.models.transformer import Transformer

VOCAB = 320


def hf_llama(**kw) -> LlamaForCausalLM:
    """GQA, untied embeddings, Llama 3 RoPE scaling that matters at these lengths."""
    return LlamaForCausalLM(LlamaConfig(**{
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        **kw}))


def hf_gpt2(**kw) -> GPT2LMHeadModel:
    return GPT2LMHeadModel(GPT2Config(**{
        "vocab_size": VOCAB, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, **kw}))


def save_hf(model, path: Path, corpus: Path | None = None) -> Path:
    """Save with random (not all-ones) norms, and a tokenizer.json trained on `corpus`."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    if corpus is not None:
        texts = [f.read_text() for f in sorted(corpus.iterdir())]
        train_bpe(texts, VOCAB - 20).save(path / "tokenizer.json")
    return path


def tessel_model(path: Path, m: ModelConfig | None = None) -> Transformer:
    """A tessel model initialised from `path` (any source init_from accepts)."""
    if m is None:
        m = load_config(None, {"model.init_from": str(path)}).model
    with torch.device("meta"):
        model = Transformer(m)
    materialise(model, torch.device("cpu"), 0, WeightSource(path, m).get)
    return model.eval()


MODELS = {"gpt2": hf_gpt2, "llama": hf_llama}
# Heads wider than hidden_size / heads (q_proj 64 -> 96: model.head_dim).
WIDE_HEADS = {"llama_head_dim": lambda: hf_llama(head_dim=24)}


@pytest.mark.parametrize("arch", [*MODELS, *WIDE_HEADS])
def test_hf_to_tessel_matches_transformers_and_round_trips_bit_for_bit(arch, tmp_path: Path, capsys):
    hf = {**MODELS, **WIDE_HEADS}[arch]().eval()
    src = save_hf(hf, tmp_path / "hf")
    assert main(["convert", "hf-to-tessel", str(src), str(tmp_path / "tessel")]) == 0
    assert "wrote" in capsys.readouterr().out
    model = tessel_model(tmp_path / "tessel")
    x = torch.randint(0, VOCAB, (3, 100))  # longer than Llama's original 32: scaling matters
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
    # tessel pads the vocabulary (model.vocab_pad_to): its extra ids are -inf, never predicted.
    assert ours.shape[-1] == 384 and (ours[..., VOCAB:] == float("-inf")).all()
    assert (ours[..., :VOCAB] - theirs).abs().max() <= 1e-5
    assert_greedy_and_direct_weights(model, hf, src, x[0, :10].tolist())
    assert_round_trip(src, tmp_path / "tessel", tmp_path / "back")


def assert_greedy_and_direct_weights(model: Transformer, hf, src: Path,  # noqa: ANN001
                                     prompt: list[int]) -> None:
    """Greedy decoding from `prompt` picks transformers' tokens, and model.init_from on the
    HF directory `src` loads the weights `model` holds."""
    got = sample(model, prompt, 24, temperature=0)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                       eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert got == want
    direct = tessel_model(src)
    for (n, a), (_, b) in zip(model.state_dict().items(), direct.state_dict().items()):
        assert torch.equal(a, b), n


def assert_round_trip(src: Path, imported: Path, back: Path) -> None:
    """`tessel-to-hf` of `imported` (src converted) writes src's tensors bit for bit."""
    assert main(["convert", "tessel-to-hf", str(imported), str(back)]) == 0
    before, after = load_file(src / "model.safetensors"), load_file(back / "model.safetensors")
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k


@pytest.mark.budget(35)  # seconds on the reference machine: measured, +~40%
def test_fine_tuned_model_exports_to_transformers_with_the_same_logits(tmp_path: Path, corpus: Path):
    src = save_hf(hf_llama(), tmp_path / "hf", corpus)
    run = tmp_path / "run"
    out = tessel_here("train", f"--model.init_from={src}", f"--run.dir={run}",
                      "--data.source=files", f"--data.paths=['{corpus}']", "--train.seq_len=64",
                      "--train.steps=4", "--train.micro_batch_size=2",
                      "--train.global_batch_size=4", "--train.eval_interval=0",
                      "--train.eval_iters=1", "--checkpoint.interval=2",
                      "--checkpoint.hf_export_interval=2", "--metrics.tensorboard=false")
    assert out.returncode == 0, out.stderr
    assert f"initialising from Hugging Face LlamaForCausalLM {src}" in out.stdout
    assert f"tokenizer from {src / 'tokenizer.json'}" in out.stdout
    assert Config.load(run / "config.toml").data.tokenizer == str(src / "tokenizer.json")

    export = tmp_path / "exported"
    assert main(["convert", "tessel-to-hf", str(run), str(export)]) == 0
    ckpt = latest_checkpoint(run / "checkpoints")
    ours = tessel_model(ckpt)
    theirs = AutoModelForCausalLM.from_pretrained(export).eval()
    x = torch.randint(0, VOCAB, (2, 80))
    with torch.no_grad():
        assert (ours(x)[..., :VOCAB] - theirs(x).logits).abs().max() <= 1e-5
    # Training moved the weights away from the starting point.
    assert not torch.equal(tessel_model(src).output.weight, ours.output.weight)
    # AutoTokenizer reads the exported tokenizer as tessel does.
    tok = AutoTokenizer.from_pretrained(export)
    text = "the model reads tokens and predicts the next token"
    from tessel.data.tokenizer import load_tokenizer

    assert tok(text, add_special_tokens=False)["input_ids"] == load_tokenizer(
        src / "tokenizer.json").encode(text)
    # The exports written during training (steps 2 and 4) load too, and the last is the same.
    for step in (2, 4):
        assert (run / f"checkpoints/step_{step:08d}/hf/config.json").is_file()
    during = load_file(run / "checkpoints/step_00000004/hf/model.safetensors")
    after = load_file(export / "model.safetensors")
    assert all(torch.equal(during[k], after[k]) for k in after)


def test_the_python_api_reads_the_shape_with_load_config_and_says_so(tmp_path: Path,
                                                                     corpus: Path):
    """README: `tessel.load_config` reads the shape of model.init_from's weights,
    `Config.load` never does. A Trainer given the latter is refused in one line that says
    so (it used to fail tensor by tensor while building); the former trains."""
    from tessel import TesselError, Trainer

    src = save_hf(hf_llama(), tmp_path / "hf", corpus)
    run = tmp_path / "run"
    overrides = {"model.init_from": str(src), "run.dir": str(run), "data.source": "files",
                 "data.paths": [str(corpus)], "data.cache_dir": str(tmp_path / "cache"),
                 "train.seq_len": 32, "train.steps": 1, "train.micro_batch_size": 2,
                 "train.global_batch_size": 2, "train.eval_interval": 0,
                 "train.eval_iters": 1, "metrics.tensorboard": False, "run.sample_tokens": 0}
    with pytest.raises(TesselError) as exc:
        Trainer(Config.load(None, overrides), console=False)
    message = str(exc.value)
    assert "\n" not in message, message
    assert ("with n_layers=2, d_model=64, n_heads=4, but the config's model has n_layers=4, "
            "d_model=192, n_heads=6" in message), message
    assert "load the config with tessel.load_config(path, overrides)" in message
    assert not run.exists()
    trainer = Trainer(load_config(None, overrides), console=False)
    try:
        assert trainer.train().step == 1
    finally:
        trainer.close()


# A context shorter than train.seq_len's default (256): sampling must not care.
SHORT_CONTEXT = {"gpt2_context_128": lambda: hf_gpt2(n_positions=128)}


@pytest.mark.parametrize("arch", [*MODELS, *SHORT_CONTEXT])
def test_generate_samples_an_imported_model_as_transformers_does(arch, tmp_path: Path,
                                                                  corpus: Path, capsys):
    """A user's first check after an import: `tessel generate` on the HF directory itself and
    on `hf-to-tessel` output ("has no complete checkpoint yet" before), greedy text equal to
    transformers' generate; the import's config.toml fine-tunes within the model's context."""
    hf = {**MODELS, **SHORT_CONTEXT}[arch]().eval()
    src = save_hf(hf, tmp_path / "hf", corpus)
    assert main(["convert", "hf-to-tessel", str(src), str(tmp_path / "tessel")]) == 0
    imported = Config.load(tmp_path / "tessel/config.toml")
    assert imported.train.seq_len == imported.model.max_seq_len == hf.config.max_position_embeddings
    from tessel.data.tokenizer import load_tokenizer

    tok = load_tokenizer(str(src / "tokenizer.json"))
    prompt = "the quick brown"
    ids = tok.encode(prompt)
    want = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                       eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    if tok.eod_id in want:  # tessel stops at the end-of-document token
        want = want[: want.index(tok.eod_id)]
    capsys.readouterr()
    for where in (src, tmp_path / "tessel"):
        assert main(["generate", str(where), "--prompt", prompt, "--temperature", "0",
                     "--max-new-tokens", "16"]) == 0
        assert capsys.readouterr().out == prompt + tok.decode(want) + "\n"
    (src / "tokenizer.json").unlink()
    assert main(["generate", str(src), "--prompt", "x"]) == 2
    assert "no tokenizer.json" in capsys.readouterr().err


def test_sharded_output_above_the_size_limit_and_bf16(tmp_path: Path):
    src = save_hf(hf_gpt2(), tmp_path / "hf")
    assert main(["convert", "hf-to-tessel", str(src), str(tmp_path / "t")]) == 0
    out = tmp_path / "sharded"
    assert main(["convert", "tessel-to-hf", str(tmp_path / "t"), str(out), "--max-shard-size",
                 "100KB", "--dtype", "bfloat16"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2 and all((out / s).is_file() for s in shards)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert next(model.parameters()).dtype == torch.bfloat16
    # ... and a sharded HF directory reads back.
    assert main(["convert", "hf-to-tessel", str(out), str(tmp_path / "again")]) == 0


def test_bad_hf_input_is_one_line(tmp_path: Path, corpus: Path):
    src = save_hf(hf_llama(), tmp_path / "hf")
    # An architecture tessel does not convert.
    other = tmp_path / "falcon"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "falcon",
                                                   "architectures": ["FalconForCausalLM"]}))
    (other / "model.safetensors").write_bytes(b"")
    assert_one_line_error(tessel_here("convert", "hf-to-tessel", str(other), str(tmp_path / "x")),
                          "unsupported architecture 'falcon'")
    # A tensor missing, a field missing, a shape that does not match.
    broken = tmp_path / "broken"
    broken.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    (broken / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    assert_one_line_error(tessel_here("convert", "hf-to-tessel", str(broken), str(tmp_path / "y")),
                          "tensor 'model.layers.2.input_layernorm.weight' is missing")
    (broken / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "hidden_size"}))
    assert_one_line_error(tessel_here("convert", "hf-to-tessel", str(broken), str(tmp_path / "y")),
                          "missing field 'hidden_size'")
    (broken / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    assert_one_line_error(
        tessel_here("train", f"--model.init_from={broken}", f"--run.dir={tmp_path / 'r'}",
               "--data.source=synthetic", "--train.steps=1", "--train.seq_len=32"),
        "tensor 'layers.0.feed_forward.w1.weight' has shape (160, 64), the model's is (96, 64)")
    # A tokenizer with more ids than the model has rows.
    (broken / "config.json").write_text(json.dumps({**cfg, "vocab_size": 64}))
    texts = [f.read_text() for f in sorted(corpus.iterdir())]
    train_bpe(texts, 300).save(broken / "tokenizer.json")
    assert_one_line_error(tessel_here("convert", "hf-to-tessel", str(broken), str(tmp_path / "z")),
                          "the tokenizer does not match the model")
    # An explicit shape that contradicts the weights.
    assert_one_line_error(
        tessel_here("train", f"--model.init_from={src}", "--model.d_model=128", "--data.source=synthetic",
               f"--run.dir={tmp_path / 'r2'}"),
        "model.d_model=128 but the weights of model.init_from have 64")
    assert_one_line_error(tessel_here("convert", "tessel-to-hf", str(tmp_path / "nothing"),
                                 str(tmp_path / "o")), "does not exist")
    assert_one_line_error(tessel_here("convert", "tessel-to-hf", str(src), str(tmp_path / "o")),
                          "is already a Hugging Face model directory")


def test_dropout_is_carried_both_ways(tmp_path: Path, capsys):
    """Stock GPT-2 trains with 0.1 dropout (GPT2Config's default): imported as model.dropout
    0.1 (0.0 before) and exported as 0.1; rates tessel cannot hold are refused in one line."""
    src = save_hf(hf_gpt2(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1), tmp_path / "hf")
    assert main(["convert", "hf-to-tessel", str(src), str(tmp_path / "t")]) == 0
    assert Config.load(tmp_path / "t/config.toml").model.dropout == 0.1
    assert main(["convert", "tessel-to-hf", str(tmp_path / "t"), str(tmp_path / "back")]) == 0
    back = json.loads((tmp_path / "back/config.json").read_text())
    assert (back["resid_pdrop"], back["embd_pdrop"], back["attn_pdrop"]) == (0.1, 0.1, 0.1)
    differ = save_hf(hf_gpt2(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.0), tmp_path / "d")
    assert_one_line_error(tessel_here("convert", "hf-to-tessel", str(differ), str(tmp_path / "x")),
                          "resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.0 differ")
    llama = save_hf(hf_llama(attention_dropout=0.1), tmp_path / "l")
    assert_one_line_error(tessel_here("convert", "hf-to-tessel", str(llama), str(tmp_path / "y")),
                          "attention_dropout=0.1 cannot be carried")
    # A Llama-shaped tessel model trained with dropout exports its weights and says what it
    # did not write.
    ok = save_hf(hf_llama(), tmp_path / "ok")
    assert main(["convert", "hf-to-tessel", str(ok), str(tmp_path / "lt")]) == 0
    from safetensors import safe_open
    from safetensors.torch import save_file

    weights = tmp_path / "lt/model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        meta = f.metadata()
    model_config = {**json.loads(meta["model_config"]), "dropout": 0.1}
    save_file(load_file(weights), str(weights), {**meta, "model_config": json.dumps(model_config)})
    capsys.readouterr()
    assert main(["convert", "tessel-to-hf", str(tmp_path / "lt"), str(tmp_path / "lb")]) == 0
    assert "model.dropout=0.1 is not written" in capsys.readouterr().out
    assert json.loads((tmp_path / "lb/config.json").read_text())["attention_dropout"] == 0.0


def _tokenizer_without_eod(path: Path, corpus: Path) -> int:
    """A byte-level BPE whose only special token is `<|eot|>`, none of tessel's known
    end-of-text names, filling the whole vocabulary; returns its id."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([f.read_text() for f in sorted(corpus.iterdir())], trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|eot|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tok.get_vocab_size() == VOCAB
    tok.save(str(path / "tokenizer.json"))
    return tok.token_to_id("<|eot|>")


def test_a_tokenizer_without_an_end_of_document_token_uses_the_models_eos(
        tmp_path: Path, corpus: Path, capsys):
    """Before: tessel added <|endoftext|> (id 320) and refused the import (321 ids > 320)."""
    src = save_hf(hf_llama(), tmp_path / "hf")
    eot = _tokenizer_without_eod(src, corpus)
    cfg = json.loads((src / "config.json").read_text())
    # Nothing names an EOS: refused, saying how to choose one.
    (src / "generation_config.json").unlink()
    (src / "config.json").write_text(json.dumps({**cfg, "eos_token_id": None,
                                                 "bos_token_id": None, "pad_token_id": None}))
    assert_one_line_error(tessel_here("convert", "hf-to-tessel", str(src), str(tmp_path / "x")),
                          "pass --eod-token with one of its tokens")
    assert main(["convert", "hf-to-tessel", str(src), str(tmp_path / "y"),
                 "--eod-token", "<|eot|>"]) == 0
    assert "documents end with '<|eot|>'" in capsys.readouterr().out
    # The model's config.json names it: used, and said.
    (src / "config.json").write_text(json.dumps({**cfg, "eos_token_id": eot}))
    assert main(["convert", "hf-to-tessel", str(src), str(tmp_path / "t")]) == 0
    assert (f"documents end with '<|eot|>' (id {eot}, config.json eos_token_id)"
            in capsys.readouterr().out)
    assert Config.load(tmp_path / "t/config.toml").data.eod_token == "<|eot|>"
    # Fine-tuning ends every document with it, and export names it as EOS.
    run = tmp_path / "run"
    out = tessel_here("train", str(tmp_path / "t/config.toml"), f"--run.dir={run}",
                      "--data.source=files", f"--data.paths=['{corpus}']", "--train.seq_len=32",
                      "--train.steps=1", "--train.micro_batch_size=2",
                      "--train.global_batch_size=2", "--train.eval_interval=0",
                      "--train.eval_iters=1", "--data.split=100,0",
                      f"--data.cache_dir={tmp_path / 'cache'}", "--metrics.tensorboard=false")
    assert out.returncode == 0, out.stderr
    from tessel.data.indexed import IndexedDataset

    (idx,) = (tmp_path / "cache").glob("corpus-*/data.idx")
    ds = IndexedDataset(idx.with_suffix(""))
    assert all(ds.document(i)[-1] == eot for i in range(len(ds)))
    assert main(["convert", "tessel-to-hf", str(run), str(tmp_path / "exp")]) == 0
    assert json.loads((tmp_path / "exp/config.json").read_text())["eos_token_id"] == eot
    assert AutoTokenizer.from_pretrained(tmp_path / "exp").eos_token == "<|eot|>"
