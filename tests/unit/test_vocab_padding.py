"""Vocabulary padding (model.vocab_pad_to): the padded model trains exactly as the unpadded
one, its padding ids are never predicted, it is counted honestly, it converts to and from
Hugging Face with the real vocabulary only, and runs saved before the setting still load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_overrides
from safetensors.torch import save_file

from tessel import Trainer
from tessel.checkpoint import CheckpointError, latest_checkpoint, load_model
from tessel.config import Config, ModelConfig, OptimConfig, read_saved
from tessel.generate import load_run_for_inference, sample
from tessel.models import build_model, flops_per_token, param_count
from tessel.models.loss import token_loss_sum
from tessel.observe.metrics import read_metrics
from tessel.optim.groups import build_optimizer
from tessel.planner.memory import stage_parameters

V = 500  # not a multiple of 128: padded to 512 rows


def tiny(pad: int, preset: str = "tiny", **kw) -> ModelConfig:
    return ModelConfig(preset=preset, vocab_size=V, vocab_pad_to=pad, **kw)


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])  # tied GPT-2 / untied Llama
def test_padded_and_unpadded_models_start_equal_and_train_equal(preset):
    padded, plain = build_model(tiny(128, preset), seed=3), build_model(tiny(1, preset), seed=3)
    assert padded.tok_embeddings.weight.shape[0] == 512 and plain.tok_embeddings.weight.shape[0] == V
    # The real rows are exactly what the unpadded model draws; the padding rows are zero.
    for (name, a), b in zip(padded.named_parameters(), plain.parameters()):
        assert torch.equal(a[: b.shape[0]], b), name
        if a.shape != b.shape:
            assert not a[V:].any(), name
    opt_a = build_optimizer(padded, OptimConfig(lr=1e-2), torch.device("cpu"))
    opt_b = build_optimizer(plain, OptimConfig(lr=1e-2), torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        x, y = torch.randint(0, V, (4, 24), generator=gen), torch.randint(0, V, (4, 24), generator=gen)
        losses = []
        for model, opt in ((padded, opt_a), (plain, opt_b)):
            opt.zero_grad()
            loss = token_loss_sum(model(x), y) / y.numel()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0)
        for (name, a), b in zip(padded.named_parameters(), plain.parameters()):
            torch.testing.assert_close(a.grad[: b.shape[0]], b.grad, rtol=1e-4, atol=1e-5,
                                       msg=name)
            if a.shape != b.shape:  # the padding rows get exactly zero gradient
                assert torch.equal(a.grad[V:], torch.zeros_like(a.grad[V:])), name
    for (name, a), b in zip(padded.named_parameters(), plain.parameters()):
        # Adam divides by sqrt(v): a gradient near 0 turns float-order noise (1e-8) into
        # a visible update, so the weights agree to 1% of lr (measured: 0.6%), not to 1e-6.
        torch.testing.assert_close(a[: b.shape[0]], b, rtol=0, atol=1e-4, msg=name)
        assert not a[b.shape[0]:].any(), name  # padding rows still exactly zero


def test_logits_of_padding_ids_are_minus_infinity_in_any_dtype():
    model = build_model(tiny(128), seed=0)
    x = torch.randint(0, V, (2, 8))
    logits = model(x)
    assert logits.shape == (2, 8, 512)
    assert (logits[..., V:] == float("-inf")).all() and torch.isfinite(logits[..., :V]).all()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(x)
    assert low.dtype == torch.bfloat16 and (low[..., V:] == float("-inf")).all()
    assert build_model(tiny(1), seed=0).vocab_mask is None  # unpadded: no mask, no add
    assert build_model(ModelConfig(preset="tiny"), seed=0).vocab_mask is None  # 512 already


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_counts_include_the_padding_rows(preset):
    cfg = tiny(128, preset)
    model = build_model(cfg, "meta")
    assert param_count(cfg) == sum(p.numel() for p in model.parameters())
    assert param_count(cfg) - param_count(tiny(1, preset)) == (
        (1 if cfg.tie_embeddings else 2) * 12 * cfg.d_model)
    assert stage_parameters(cfg, cfg.n_layers, True, True, 1).total == param_count(cfg)
    matmul = sum(p.numel() for n, p in model.named_parameters(remove_duplicate=False)
                 if p.ndim == 2 and n not in ("tok_embeddings.weight", "pos_embeddings.weight"))
    T = 32
    assert flops_per_token(cfg, T) == 6 * matmul + 12 * cfg.n_layers * cfg.d_model * T


def test_sampling_never_emits_a_padding_id():
    model = build_model(tiny(128), seed=0)
    out = sample(model, [1, 2, 3], 300, temperature=5.0, top_k=None, seed=1)
    assert len(out) == 300 and max(out) < V
    assert max(sample(model, [1, 2, 3], 100, temperature=5.0, top_k=0, seed=2)) < V
    # Without the mask the same sampling does produce them (the test can fail).
    model.vocab_mask = None
    assert max(sample(model, [1, 2, 3], 300, temperature=5.0, top_k=None, seed=1)) >= V


def _tessel_file(model, path: Path) -> Path:
    """A tessel safetensors file, as `tessel checkpoint consolidate` writes one."""
    tensors = {n: p.detach().contiguous() for n, p in model.named_parameters()}
    save_file(tensors, str(path), metadata={
        "format": "tessel", "model_config": json.dumps(model.cfg.model_dump())})
    return path


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_hf_export_keeps_the_real_vocabulary_and_import_pads_it(preset, tmp_path: Path):
    from transformers import AutoModelForCausalLM

    from tessel.checkpoint.hf_convert import hf_to_tessel, tessel_to_hf
    from tessel.checkpoint.init_from import WeightSource, load_config
    from tessel.models.init import materialise
    from tessel.models.transformer import Transformer

    model = build_model(tiny(128, preset, dropout=0.0), seed=4).eval()
    tessel_to_hf(_tessel_file(model, tmp_path / "m.safetensors"), tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.vocab_size == V
    assert hf.get_input_embeddings().weight.shape[0] == V
    assert hf.get_output_embeddings().weight.shape[0] == V
    x = torch.randint(0, V, (2, 20))
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
    torch.testing.assert_close(ours[..., :V], theirs, rtol=1e-5, atol=1e-5)
    # Import: HF's 500 rows padded with zero rows, directly (init_from) and converted.
    hf_to_tessel(tmp_path / "hf", tmp_path / "back")
    for src in (tmp_path / "hf", tmp_path / "back"):
        m = load_config(None, {"model.init_from": str(src)}).model
        assert m.vocab_pad_to == 128 and m.padded_vocab_size == 512
        with torch.device("meta"):
            again = Transformer(m)
        materialise(again, torch.device("cpu"), 0, WeightSource(src, m).get)
        for (name, a), b in zip(again.named_parameters(), model.parameters()):
            assert torch.equal(a, b), name
    # A source saved with other padding (here none) fills a padded model, and back.
    unpadded = build_model(tiny(1, preset), seed=4)
    src = _tessel_file(unpadded, tmp_path / "plain.safetensors")
    m = tiny(128, preset)
    emb = WeightSource(src, m).get("tok_embeddings.weight", (512, m.d_model))
    assert torch.equal(emb[:V], unpadded.tok_embeddings.weight) and not emb[V:].any()


def test_an_old_run_without_the_key_resumes_generates_and_exports(tmp_path: Path, corpus: Path):
    from tessel.checkpoint.hf_convert import tessel_to_hf
    from tessel.cli import main

    over = tiny_overrides(tmp_path / "old", corpus, **{
        "model.vocab_size": 300, "model.vocab_pad_to": 1, "train.steps": 2,
        "checkpoint.interval": 2})
    Trainer(Config.load(None, over), console=False).train()
    run = tmp_path / "old"
    text = (run / "config.toml").read_text()
    assert "vocab_pad_to = 1\n" in text  # new runs always write it
    # As an earlier tessel wrote it: no key in config.toml nor in the checkpoint's state.
    (run / "config.toml").write_text(text.replace("vocab_pad_to = 1\n", ""))
    ckpt = latest_checkpoint(run / "checkpoints")
    state = json.loads((ckpt / "state.json").read_text())
    del state["config"]["model"]["vocab_pad_to"]
    state.pop("state_sha256")
    (ckpt / "state.json").write_text(json.dumps(state))
    assert Config.from_dict(read_saved(run / "config.toml")).model.vocab_pad_to == 1
    assert Config.load(run / "config.toml").model.vocab_pad_to == 128  # as a user's config
    model, _ = load_run_for_inference(run)
    assert model.tok_embeddings.weight.shape[0] == 300
    # Loading it into a padded model fails in one line that names the setting.
    with pytest.raises(CheckpointError) as info:
        load_model(ckpt, build_model(ModelConfig(**{**model.cfg.model_dump(), "vocab_pad_to": 128})))
    assert "\n" not in str(info.value) and "model.vocab_pad_to" in str(info.value)
    assert tessel_to_hf(run, tmp_path / "hf").startswith("wrote")
    assert main(["train", "--resume", str(run), "--train.steps=4", "--quiet"]) == 0
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert steps[-1] == 4


def test_trainer_losses_are_those_of_the_unpadded_model(tmp_path: Path, corpus: Path):
    losses = {}
    for pad in (128, 1):
        over = tiny_overrides(tmp_path / f"pad{pad}", corpus, **{
            "model.vocab_size": 300, "model.vocab_pad_to": pad, "train.steps": 4})
        Trainer(Config.load(None, over), console=False).train()
        losses[pad] = [r["loss"] for r in read_metrics(tmp_path / f"pad{pad}" / "metrics.jsonl")
                       if "loss" in r]
    assert len(losses[1]) == 4
    torch.testing.assert_close(losses[128], losses[1], rtol=1e-5, atol=0)
