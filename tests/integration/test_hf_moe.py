"""Hugging Face interop of Mixture-of-Experts models against `transformers` itself: Mixtral
and Qwen3-MoE built small and random in the test (no hub), imported, exported, fine-tuned,
compared logit by logit in fp32 (eval mode: Mixtral's router jitter is training-only)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_cli import assert_one_line_error, tessel
from test_hf import VOCAB, save_hf, tessel_model
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from tessel.checkpoint import latest_checkpoint
from tessel.cli import main
from tessel.config import Config

TOL = 1e-4  # fp32, max abs difference of the logits


def hf_mixtral(**kw) -> MixtralForCausalLM:
    """GQA, untied, 4 experts top-2 in both layers."""
    return MixtralForCausalLM(MixtralConfig(**{
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
        "num_experts_per_tok": 2, "max_position_embeddings": 256, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "router_aux_loss_coef": 0.02,
        "router_jitter_noise": 0.01, **kw}))


def hf_qwen3(**kw) -> Qwen3MoeForCausalLM:
    """Heads of 24 on d_model 64 (q_proj 64 -> 96), QK-norm, layer 0 dense (mlp_only_layers),
    4 experts of 48 top-2 in layer 1."""
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**{
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 24, "num_experts": 4, "num_experts_per_tok": 2,
        "norm_topk_prob": True, "mlp_only_layers": [0], "max_position_embeddings": 256,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, **kw}))


MODELS = {"mixtral": hf_mixtral, "qwen3_moe": hf_qwen3}


def save_moe(model, path: Path, corpus: Path | None = None) -> Path:
    """save_hf (random norms, QK-norm's included) with routers 50x HF's initial std, so that
    routing is decisive (near-ties in the top-k would turn on float noise) ."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(50)
    return save_hf(model.eval(), path, corpus)


def max_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return (ours[..., :VOCAB] - theirs).abs().max().item()


@pytest.mark.parametrize("arch", MODELS)
def test_import_and_export_match_transformers(arch, tmp_path: Path, capsys):
    hf = MODELS[arch]()
    src = save_moe(hf, tmp_path / "hf")
    # transformers 5.24's save_pretrained writes the Hub's per-expert format.
    names = set(load_file(src / "model.safetensors"))
    assert ("model.layers.1.block_sparse_moe.experts.3.w2.weight" in names if arch == "mixtral"
            else "model.layers.1.mlp.experts.3.down_proj.weight" in names)
    assert main(["convert", "hf-to-tessel", str(src), str(tmp_path / "tessel")]) == 0
    m = Config.load(tmp_path / "tessel/config.toml").model
    assert (m.moe_experts, m.moe_top_k, m.n_moe_layers) == (4, 2, 2 if arch == "mixtral" else 1)
    model = tessel_model(tmp_path / "tessel")
    x = torch.randint(0, VOCAB, (3, 40))
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
    imported = max_diff(ours, theirs)
    assert imported < TOL
    # The same from the HF directory directly (model.init_from), balancing bias zero.
    direct = tessel_model(src)
    for (n, a), (_, b) in zip(model.state_dict().items(), direct.state_dict().items()):
        assert torch.equal(a, b), n
    assert not direct.layers["1"].feed_forward.expert_bias.any()
    # Back to HF: the same tensors bit for bit, and transformers computes the same logits.
    assert main(["convert", "tessel-to-hf", str(tmp_path / "tessel"), str(tmp_path / "back")]) == 0
    assert MODELS[arch]().__class__.__name__ in capsys.readouterr().out
    before, after = load_file(src / "model.safetensors"), load_file(tmp_path / "back/model.safetensors")
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        exported = max_diff(ours, again(x).logits)
    print(f"{arch}: max |logit difference| HF -> tessel {imported:.2e}, tessel -> HF "
          f"{exported:.2e}")
    assert exported < TOL


@pytest.mark.parametrize("arch", MODELS)
def test_transformers_5_fused_experts_import(arch, tmp_path: Path, capsys):
    """transformers 5 holds the experts fused (mlp.experts.gate_up_proj (E, 2 x hidden, d),
    down_proj (E, d, hidden)); a directory with its state_dict as it is imports the same."""
    hf = MODELS[arch]()
    src = save_moe(hf, tmp_path / "hf")
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(src / "config.json", fused / "config.json")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    x = torch.randint(0, VOCAB, (2, 40))
    with torch.no_grad():
        diff = max_diff(tessel_model(fused)(x), hf(x).logits)
    assert diff < TOL
    # and a wrong shape is one line, not a traceback
    state["model.layers.1.mlp.experts.down_proj"] = state["model.layers.1.mlp.experts.down_proj"][:3]
    save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    capsys.readouterr()
    assert main(["convert", "hf-to-tessel", str(fused), str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tensor 'model.layers.1.mlp.experts.down_proj' has shape (3, 64, " in err[0]


def test_fine_tuned_qwen3_moe_exports_with_the_same_logits(tmp_path: Path, corpus: Path):
    """`tessel train` from the HF directory (model.init_from), a few steps, an export during
    training and one after: transformers computes the trained model's logits."""
    src = save_moe(hf_qwen3(), tmp_path / "hf", corpus)
    run = tmp_path / "run"
    assert main(["train", f"--model.init_from={src}", f"--run.dir={run}", "--data.source=files",
                 f"--data.paths=['{corpus}']", "--train.seq_len=32", "--train.steps=3",
                 "--train.micro_batch_size=2", "--train.global_batch_size=4",
                 "--train.eval_interval=0", "--train.eval_iters=1", "--checkpoint.interval=3",
                 "--checkpoint.hf_export_interval=3", "--metrics.tensorboard=false",
                 "--run.sample_tokens=0", f"--data.cache_dir={tmp_path / 'cache'}"]) == 0
    cfg = Config.load(run / "config.toml")
    assert (cfg.model.head_dim, cfg.model.qk_norm, cfg.model.moe_first_dense_layers) == (24, True, 1)
    assert cfg.model.moe_aux_loss_coef == 0.001  # router_aux_loss_coef, transformers' default
    export = tmp_path / "exported"
    assert main(["convert", "tessel-to-hf", str(run), str(export)]) == 0
    ours = tessel_model(latest_checkpoint(run / "checkpoints"))
    theirs = AutoModelForCausalLM.from_pretrained(export).eval()
    x = torch.randint(0, VOCAB, (2, 40))
    with torch.no_grad():
        diff = max_diff(ours(x), theirs(x).logits)
    print(f"qwen3_moe fine-tuned: tessel vs exported max |logit difference| {diff:.2e}")
    assert diff < TOL
    # Training moved the experts and the QK-norm; the export written during training is the same.
    start = tessel_model(src)
    for name in ("layers.1.feed_forward.experts.w1", "layers.0.attention.q_norm.weight"):
        assert not torch.equal(start.get_parameter(name), ours.get_parameter(name)), name
    during = load_file(run / "checkpoints/step_00000003/hf/model.safetensors")
    after = load_file(export / "model.safetensors")
    assert during.keys() == after.keys() and all(torch.equal(during[k], after[k]) for k in after)


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    dst.mkdir()
    cfg = {**json.loads((src / "config.json").read_text()), **changes}
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "model.safetensors").symlink_to(src / "model.safetensors")
    return dst


def test_what_tessel_cannot_compute_is_refused_in_one_line(tmp_path: Path, capsys):
    qwen, mixtral = save_moe(hf_qwen3(), tmp_path / "q"), save_moe(hf_mixtral(), tmp_path / "m")
    cases = [
        (qwen, {"norm_topk_prob": False}, "norm_topk_prob=false is not supported with "
                                          "num_experts_per_tok=2"),
        (qwen, {"num_hidden_layers": 3, "mlp_only_layers": [2]},
         "MoE layers [0, 1] (decoder_sparse_step=1, mlp_only_layers=[2]) are not"),
        (qwen, {"decoder_sparse_step": 0}, "decoder_sparse_step=0 / mlp_only_layers=[0]"),
        (qwen, {"use_sliding_window": True, "sliding_window": 16}, "sliding_window=16"),
        (qwen, {"num_experts_per_tok": 5}, "moe_top_k=5 exceeds moe_experts=4"),
        (mixtral, {"num_experts_per_tok": 1}, "num_experts_per_tok=1 is not supported"),
        (mixtral, {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
         "rope scaling 'yarn' is not supported"),
    ]
    for i, (src, changes, needle) in enumerate(cases):
        bad = _edit_config(src, tmp_path / f"bad{i}", **changes)
        capsys.readouterr()
        assert main(["convert", "hf-to-tessel", str(bad), str(tmp_path / f"out{i}")]) == 2, needle
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], (needle, err)
    # The CLI itself: one line, exit 2, for an import and for model.init_from.
    assert_one_line_error(tessel("convert", "hf-to-tessel", str(tmp_path / "bad0"),
                                 str(tmp_path / "o")), "norm_topk_prob=false is not supported")
    # Decoder-sparse-step layouts tessel can express import (every 2nd layer from layer 1).
    ok = _edit_config(qwen, tmp_path / "step2", num_hidden_layers=2, decoder_sparse_step=2,
                      mlp_only_layers=[])
    assert main(["convert", "hf-to-tessel", str(ok), str(tmp_path / "step2-out")]) == 0
    m = Config.load(tmp_path / "step2-out/config.toml").model
    assert (m.moe_first_dense_layers, m.moe_every, m.n_moe_layers) == (1, 2, 1)
    # An export HF cannot hold: a sigmoid router.
    assert main(["convert", "hf-to-tessel", str(mixtral), str(tmp_path / "mt")]) == 0
    weights = tmp_path / "mt/model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        meta = f.metadata()
    model_config = {**json.loads(meta["model_config"]), "moe_router": "sigmoid"}
    save_file(load_file(weights), str(weights), {**meta, "model_config": json.dumps(model_config)})
    capsys.readouterr()
    assert main(["convert", "tessel-to-hf", str(tmp_path / "mt"), str(tmp_path / "mb")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "moe_router='sigmoid', mlp='swiglu') has no Hugging Face" in err[0]


def _with_bias(tessel_dir: Path, bias: dict[int, torch.Tensor]) -> None:
    """Give the tessel weights in `tessel_dir` a balancing bias (layer -> one per expert), as
    a run with model.moe_bias_update_rate > 0 leaves it."""
    weights = tessel_dir / "model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(weights)
    tensors.update({f"layers.{i}.feed_forward.expert_bias": b for i, b in bias.items()})
    save_file(tensors, str(weights), meta)


def _biased_model(path: Path):
    """The tessel model at `path` with its balancing bias (tessel_model leaves it zero)."""
    from tessel.checkpoint.init_from import WeightSource, load_config
    from tessel.models.init import materialise
    from tessel.models.transformer import Transformer

    m = load_config(None, {"model.init_from": str(path)}).model
    with torch.device("meta"):
        model = Transformer(m)
    source = WeightSource(path, m)
    materialise(model, torch.device("cpu"), 0, source.get, source.buffer)
    return model.eval(), m


def test_a_balancing_bias_is_refused_on_export_unless_dropped_with_its_effect(
        tmp_path: Path, capsys):
    """Mixtral routes without tessel's balancing bias: weights whose bias can change a choice
    are refused in one line; --drop-expert-bias exports them and says how far the logits move,
    which is what transformers computes on the export against tessel with the bias. A bias
    equal for every expert changes no choice: exported as is, exactly."""
    import re

    from tessel.checkpoint.hf_bias import probe_tokens
    from tessel.checkpoint.hf_export import HFExporter

    src = save_moe(hf_mixtral(), tmp_path / "hf")
    ours_dir = tmp_path / "tessel"
    assert main(["convert", "hf-to-tessel", str(src), str(ours_dir)]) == 0
    _with_bias(ours_dir, {0: torch.full((4,), 0.25), 1: torch.full((4,), -1.0)})
    assert main(["convert", "tessel-to-hf", str(ours_dir), str(tmp_path / "exact")]) == 0
    model, m = _biased_model(ours_dir)
    x = probe_tokens(m)
    with torch.no_grad():
        exact = AutoModelForCausalLM.from_pretrained(tmp_path / "exact").eval()
        assert max_diff(model(x), exact(x).logits) < TOL

    _with_bias(ours_dir, {0: torch.zeros(4), 1: torch.tensor([0.0, 0.0, 0.3, 0.0])})
    capsys.readouterr()
    assert main(["convert", "tessel-to-hf", str(ours_dir), str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "differs between experts by up to 0.3 in 1 of 2 MoE layers" in err[0]
    assert "--drop-expert-bias" in err[0] and not (tmp_path / "refused").exists()

    assert main(["convert", "tessel-to-hf", str(ours_dir), str(tmp_path / "dropped"),
                 "--drop-expert-bias"]) == 0
    summary = capsys.readouterr().out
    found = re.search(r"on 128 random tokens the logits move by up to (\S+) and the most likely "
                      r"next token changes at (\d+) of 128 positions", summary)
    assert found, summary
    model, _ = _biased_model(ours_dir)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "dropped").eval()
    with torch.no_grad():
        ours, hf = model(x)[..., :VOCAB], theirs(x).logits
    measured = (ours - hf).abs().max().item()
    assert measured > 1e-3  # the bias changed choices: the export is not the model
    assert float(found[1]) == pytest.approx(measured, rel=1e-2)
    assert int(found[2]) == int((ours.argmax(-1) != hf.argmax(-1)).sum())

    # Exports during training run that command, with the flag when the run's config says
    # checkpoint.hf_export_drop_expert_bias (tests/unit/test_moe_training.py: refused without).
    for drop in (False, True):
        command = HFExporter(1, tmp_path / "log", print, drop_expert_bias=drop).command(ours_dir)
        assert command[command.index("tessel-to-hf"):] == [
            "tessel-to-hf", str(ours_dir), str(ours_dir / "hf"), *["--drop-expert-bias"] * drop]


def test_non_finite_weights_are_refused_on_export_and_import(tmp_path: Path, corpus: Path,
                                                             capsys):
    """A NaN in an MoE balancing bias exported silently: the bias check measured its spread
    over the NaN and passed, and transformers' logits then differed (round 3, item 12).
    Weights holding NaN or infinity are refused in one line naming the tensor, whatever
    reads them (an export, with or without --drop-expert-bias; an import; sampling),
    nothing written."""
    src = save_moe(hf_mixtral(), tmp_path / "hf", corpus)
    ours_dir = tmp_path / "tessel"
    assert main(["convert", "hf-to-tessel", str(src), str(ours_dir)]) == 0
    _with_bias(ours_dir, {0: torch.tensor([0.0, float("nan"), 0.0, 0.0]), 1: torch.zeros(4)})

    def refused(argv: list[str], needle: str) -> None:
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("tessel: error: ") and needle in err[0], err

    bias = "tensor 'layers.0.feed_forward.expert_bias' holds 1 NaN or infinite value(s) of 4"
    for extra in ([], ["--drop-expert-bias"]):
        refused(["convert", "tessel-to-hf", str(ours_dir), str(tmp_path / "out"), *extra], bias)
    refused(["generate", str(ours_dir), "--max-new-tokens=2"], bias)
    weights = load_file(src / "model.safetensors")
    name = "model.layers.1.block_sparse_moe.experts.2.w1.weight"
    weights[name][3, 5] = float("inf")
    save_file(weights, str(src / "model.safetensors"), {"format": "pt"})
    needle = f"tensor {name!r} holds 1 NaN or infinite value(s)"
    refused(["convert", "hf-to-tessel", str(src), str(tmp_path / "out")], needle)
    refused(["generate", str(src), "--max-new-tokens=2"], needle)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no leftovers
