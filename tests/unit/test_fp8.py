"""train.fp8 on CPU: torchao's float8 training emulated (tessel.parallel.fp8): the recipes, the
start-up line, the refusals (one line, exit 2, no run directory), the tensor-parallel styles,
compile without graph breaks, plain checkpoints, and an emulated run learning as the high
precision one does. The layouts are in tests/distributed/test_fp8_layouts.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tessel.cli import main
from tessel.config import Config
from tessel.models.transformer import Transformer
from tessel.observe.metrics import read_metrics
from tessel.parallel.fp8 import (
    TPStyles,
    apply_fp8,
    fp8_emulated,
    fp8_recipe,
    plain_tensor,
    tp_styles,
)

TINY_LLAMA = {"model.preset": "tiny-llama", "model.n_layers": 1}  # every dimension a multiple of 16


def flags(overrides: dict) -> list[str]:
    """Dotted CLI flags; each value as TOML reads it (JSON's true, "text", [..] are TOML's)."""
    return [f"--{k}={json.dumps(v)}" for k, v in overrides.items()]


def test_recipes_and_emulation_follow_the_keys():
    cfg = Config.load(None, {"train.fp8": True})
    assert fp8_recipe(cfg) == "tensorwise" and fp8_emulated(cfg, "cpu") and not fp8_emulated(cfg, "cuda")
    assert fp8_recipe(Config.load(None, {})) is None
    assert fp8_recipe(Config.load(None, {"train.fp8": "rowwise_with_gw_hp"})) == "rowwise_with_gw_hp"
    assert fp8_emulated(Config.load(None, {"train.fp8": True, "train.fp8_emulate": True}), "cuda")
    assert Config.load(None, ["train.fp8=rowwise"]).train.fp8 == "rowwise"  # a dotted override
    assert Config.load(None, ["train.fp8=true"]).train.fp8 is True


@pytest.mark.parametrize(("extra", "words"), [
    ({"train.fp8_emulate": False}, "train.fp8 needs an NVIDIA GPU with FP8 tensor cores"),
    ({"train.fp8": "mxfp8"}, "train.fp8 = 'mxfp8' is not available"),
    ({"train.precision": "fp16"}, "train.fp8 runs under bf16 or fp32 (emulated)"),
    ({"train.fp8": "rowwise_with_gw_hp", "train.precision": "bf16"},
     "train.fp8 = 'rowwise_with_gw_hp' does not run under bf16 on a CPU"),
    # tiny's d_model 40: no linear of it has dimensions that are multiples of 16
    ({"model.preset": "tiny", "model.d_model": 40, "model.n_heads": 4},
     "train.fp8: no linear layer of this model has dimensions that are multiples of 16"),
    ({"lora.enabled": True}, "lora.enabled does not combine with train.fp8"),
])
def test_what_fp8_cannot_serve_is_one_line_exit_2_nothing_written(
        extra, words, tmp_path: Path, corpus: Path, capsys):
    from conftest import tiny_overrides

    overrides = tiny_overrides(tmp_path / "run", corpus, **{**TINY_LLAMA, "train.fp8": True,
                                                            "train.device": "cpu", **extra})
    assert main(["train", *flags(overrides), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_without_torchao_fp8_is_one_line_exit_2(tmp_path: Path, corpus: Path):
    from conftest import tiny_overrides

    overrides = tiny_overrides(tmp_path / "run", corpus, **{**TINY_LLAMA, "train.fp8": True})
    # torchao made unimportable for this process alone (a None entry in sys.modules)
    code = ("import sys; sys.modules['torchao'] = None; from tessel.cli import main; "
            f"sys.exit(main(['train', *{flags(overrides)!r}, '--quiet']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip() == ("tessel: error: train.fp8 needs torchao: pip install torchao "
                                   "(or set train.fp8 = false)")
    assert not (tmp_path / "run").exists()


def test_the_start_up_line_names_the_recipe_emulation_and_what_stays_high_precision(
        tmp_path: Path, corpus: Path, capsys):
    from conftest import tiny_overrides

    overrides = tiny_overrides(tmp_path / "run", corpus, **{
        "model.preset": "tiny-llama", "model.n_layers": 1, "model.ffn_hidden": 200,
        "train.fp8": "rowwise", "train.steps": 1})
    assert main(["train", *flags(overrides)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("train.fp8")]
    # the MLP's 200 hidden units are no multiple of 16: its three matrices stay as they are
    assert lines == ["train.fp8: rowwise scaling on 4 block linears (emulated: the float8 casts "
                     "and scales run, the matmuls in float32); kept in high precision: output "
                     "layer; feed_forward.w1 (200x64, not multiples of 16); feed_forward.w2 "
                     "(64x200, not multiples of 16); feed_forward.w3 (200x64, not multiples of "
                     "16)"], lines


def _fp8_block(recipe: str = "tensorwise") -> tuple[torch.nn.Module, torch.Tensor]:
    cfg = Config.load(None, {**TINY_LLAMA, "train.fp8": recipe})
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    apply_fp8(model, cfg, emulate=True, all_gather=False, tp=1)
    return model.layers["0"], model._rope_table()


def test_float8_linears_replace_the_blocks_projections_not_the_output():
    from torchao.float8.float8_linear import Float8Linear

    block, _ = _fp8_block()
    names = sorted(n for n, m in block.named_modules() if isinstance(m, Float8Linear))
    assert names == ["attention.wk", "attention.wo", "attention.wq", "attention.wv",
                     "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]


@pytest.mark.slow
def test_compiled_float8_block_has_no_graph_break_on_cpu():
    """torch.compile(fullgraph=True) refuses any graph break: the float8 casts, scales and
    the emulated matmul trace as one graph (aot_eager: the trace without codegen)."""
    block, freqs = _fp8_block("rowwise")
    x = torch.randn(2, 16, 64, requires_grad=True)
    want = block(x, freqs)
    got = torch.compile(block, fullgraph=True, backend="aot_eager")(x, freqs)
    got.sum().backward()
    assert torch.equal(got, want) and x.grad is not None


def test_float8_tp_styles_on_cuda_plain_ones_over_gloo():
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    block, _ = _fp8_block()
    att = block.attention
    tw = Config.load(None, {"train.fp8": "tensorwise"})
    cuda = tp_styles(tw, "cuda")
    assert isinstance(cuda.colwise(att.wq), Float8ColwiseParallel)
    assert isinstance(cuda.rowwise(att.wo), Float8RowwiseParallel)
    assert isinstance(cuda.prepare_input([att.wq, att.wk, att.wv]), PrepareFloat8ModuleInput)
    # a plain nn.Linear among the consumers: the input is gathered in high precision
    assert not isinstance(cuda.prepare_input([att.wq, torch.nn.Linear(16, 16)]),
                          PrepareFloat8ModuleInput)
    for styles in (tp_styles(tw, "cpu"), tp_styles(Config.load(None, {"train.fp8": "rowwise"}), "cuda"),
                   TPStyles()):
        assert type(styles.colwise(att.wq)) is ColwiseParallel


def test_checkpoints_hold_the_plain_weight_under_float8_all_gather():
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    cfg = Config.load(None, {**TINY_LLAMA, "train.fp8": True})
    model = Transformer(cfg.model)
    apply_fp8(model, cfg, emulate=True, all_gather=True, tp=1)
    weight = model.layers["0"].attention.wq.weight
    assert isinstance(weight, WeightWithDynamicFloat8CastTensor)
    plain = plain_tensor(weight)
    assert not isinstance(plain, WeightWithDynamicFloat8CastTensor)
    assert plain is weight._tensor  # the weight itself: a load into it lands in the model
    other = torch.ones(2)
    assert plain_tensor(other) is other


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


@pytest.mark.slow
@pytest.mark.budget(180)  # seconds on the reference machine: 178 s measured on a loaded one
def test_an_emulated_fp8_run_learns_as_the_bf16_run_does(tmp_path: Path, corpus: Path):
    """40 steps of tiny-llama under bf16 autocast, with and without tensorwise float8
    linears, on the same batches: the loss falls as far (benchmarks/fp8_recipes.py measures
    the gap over 200 steps for every recipe)."""
    from conftest import tiny_overrides

    common = {**TINY_LLAMA, "model.n_layers": 2, "train.steps": 40, "train.precision": "bf16"}
    for name, extra in {"bf16": {}, "fp8": {"train.fp8": True}}.items():
        assert main(["train", *flags(tiny_overrides(tmp_path / name, corpus, **common, **extra)),
                     "--quiet"]) == 0
    bf16, fp8 = _losses(tmp_path / "bf16"), _losses(tmp_path / "fp8")
    assert len(bf16) == len(fp8) == 40
    start, end_bf16, end_fp8 = bf16[0], sum(bf16[-5:]) / 5, sum(fp8[-5:]) / 5
    assert fp8[0] == pytest.approx(start, rel=0.02)
    assert end_bf16 < start - 1.0  # it learns
    assert (start - end_fp8) == pytest.approx(start - end_bf16, rel=0.05), (bf16, fp8)
