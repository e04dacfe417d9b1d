"""The planner's activation memory against what autograd really saves, in one process: the
bytes held for backward at the end of a forward pass (saved-tensor hooks, plus selective
checkpointing's cache), for several model shapes, precisions, checkpointing modes, document
masks and dropout, with and without LoRA adapters. Per-rank layouts (TP, SP, PP, ZeRO):
tests/distributed/test_layouts.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from saved_memory import SavedTensorMeter, metered_contexts

import tessel.parallel.checkpointing as apply
from tessel.config import Config, LoraConfig, ModelConfig
from tessel.models.lora import add_lora, cast_base
from tessel.models.loss import token_loss_sum
from tessel.models.transformer import build_model
from tessel.planner.layout import Layout
from tessel.planner.memory import estimate_memory

LLAMA = dict(preset="tiny-llama", n_layers=3, d_model=128, n_heads=8, n_kv_heads=2,
             ffn_hidden=352, vocab_size=1000)
GPT = dict(preset="tiny", n_layers=4, d_model=96, n_heads=6, vocab_size=700, max_seq_len=256)
# Qwen3's attention: heads of their own width (8 x 24 = 192 on d_model 128) and QK-norm; and
# the same on the multi-head GPT shape.
QWEN = dict(LLAMA, head_dim=24, qk_norm=True)
GPT_QK = dict(GPT, head_dim=20, qk_norm=True)
# Mixture-of-Experts: tiny-moe (1 dense + 3 MoE layers, 8 experts top-2, 1 shared expert);
# and a GELU variant with softmax top-1 (Switch), a capacity factor and no shared expert.
MOE = dict(preset="tiny-moe")
SWITCH = dict(preset="tiny-moe", mlp="gelu", moe_top_k=1, moe_shared_experts=0,
              moe_capacity_factor=1.25, moe_z_loss_coef=0.001, moe_every=2)
CASES = [
    (LLAMA, "fp32", "none", False, 0.0),
    (LLAMA, "bf16", "none", False, 0.0),
    (LLAMA, "fp32", "none", True, 0.0),
    (LLAMA, "fp32", "full", False, 0.0),
    (LLAMA, "fp32", "selective", False, 0.0),
    (LLAMA, "bf16", "selective", True, 0.0),
    (GPT, "fp32", "none", False, 0.0),
    (GPT, "fp32", "none", True, 0.1),
    (GPT, "bf16", "full", False, 0.0),
    (GPT, "fp32", "selective", False, 0.1),
    (QWEN, "fp32", "none", False, 0.0),
    (QWEN, "bf16", "selective", True, 0.0),
    (QWEN, "bf16", "full", False, 0.0),
    (GPT_QK, "fp32", "none", True, 0.1),
    (MOE, "fp32", "none", False, 0.0),
    (MOE, "bf16", "none", False, 0.0),
    (MOE, "fp32", "selective", False, 0.0),
    (MOE, "bf16", "full", True, 0.0),
    (SWITCH, "fp32", "none", False, 0.1),
    (SWITCH, "bf16", "selective", False, 0.0),
    # Megatron's "selective" (every matmul output kept), as tessel's selective was before the
    # per-op policy
    (LLAMA, "fp32", "matmuls", False, 0.0),
    (GPT, "bf16", "matmuls", True, 0.1),
    (MOE, "fp32", "matmuls", False, 0.0),
    (QWEN, "bf16", "matmuls", True, 0.0),
]
# LoRA: the shape and adapters of tests/distributed/test_layouts.py's LORA_2 (4 layers, rank
# 4 on every projection, documents, fp32), whose layouts measured these figures per rank;
# then other targets, a bf16 base (its input cast inside the projection: the adapters share
# the input), adapter dropout, and MoE models (adapters on the attention).
LAYOUTS = dict(preset="tiny-llama", n_layers=4, d_model=64, n_heads=4, n_kv_heads=2,
               head_dim=16, vocab_size=512, ffn_hidden=192)
ALL = ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]


def adapters(targets: list[str], base_dtype: str = "float32", dropout: float = 0.0,
             rank: int = 8) -> LoraConfig:
    return LoraConfig(enabled=True, rank=rank, alpha=2.0 * rank, targets=targets,
                      base_dtype=base_dtype, dropout=dropout)


LORA_CASES = [
    (LAYOUTS, "fp32", "none", True, 0.0, adapters(ALL, rank=4)),  # lora_ddp: 1,423,876 bytes
    (LAYOUTS, "fp32", "full", True, 0.0, adapters(ALL, rank=4)),  # lora_zero3_ac_full: 226,052
    (LAYOUTS, "fp32", "selective", True, 0.0, adapters(ALL, rank=4)),  # 1,635,076
    (LLAMA, "bf16", "none", False, 0.0, adapters(["wq", "wv"])),
    (LLAMA, "bf16", "none", True, 0.0, adapters(ALL, "bfloat16")),
    (LLAMA, "fp32", "none", False, 0.0, adapters(ALL, "bfloat16")),
    (LLAMA, "bf16", "full", False, 0.0, adapters(["wq", "wv"], "bfloat16")),
    (LLAMA, "fp32", "selective", False, 0.0, adapters(["w1", "w2"], dropout=0.1)),
    (GPT, "fp32", "none", True, 0.1, adapters(["wq", "w2"], dropout=0.1)),
    (GPT, "bf16", "selective", False, 0.0, adapters(["wo", "w1"])),
    (QWEN, "fp32", "none", True, 0.0, adapters(["wk", "w3"])),
    (MOE, "fp32", "none", False, 0.0, adapters(["wq", "wk", "wv", "wo"])),
    (MOE, "bf16", "none", False, 0.0, adapters(["wq", "wo"], "bfloat16")),
]


# Checkpointing on every N-th block only, and the loss over pieces of the tokens: (shape,
# precision, policy, every, loss_chunks)
PARTIAL_CASES = [
    (LLAMA, "fp32", "full", 2, 1),
    (GPT, "bf16", "selective", 2, 1),
    (MOE, "fp32", "selective", 3, 4),
    (LLAMA, "bf16", "none", 1, 4),
    (QWEN, "fp32", "selective", 1, 3),
    (GPT, "fp32", "matmuls", 4, 2),
]


@pytest.mark.parametrize("shape, precision, ac, mask, dropout, lora",
                         [(*case, None) for case in CASES] + LORA_CASES)
def test_saved_activations_match_the_prediction(monkeypatch, shape, precision, ac, mask, dropout,
                                                lora):
    _check_saved(monkeypatch, shape, precision, ac, mask, dropout, lora)


@pytest.mark.parametrize("shape, precision, ac, every, chunks", PARTIAL_CASES)
def test_per_layer_checkpointing_and_a_chunked_loss_match_the_prediction(
        monkeypatch, shape, precision, ac, every, chunks):
    _check_saved(monkeypatch, shape, precision, ac, False, 0.0, None, every, chunks)


def _check_saved(monkeypatch, shape, precision, ac, mask, dropout, lora, every=1, chunks=1):
    monkeypatch.setattr(apply, "create_selective_checkpoint_contexts",
                        metered_contexts(apply.create_selective_checkpoint_contexts))
    torch.manual_seed(0)
    m = ModelConfig(**shape, dropout=dropout)
    mbs, T = (2, 32) if shape is LAYOUTS else (3, 96)
    model = build_model(m, seed=0)
    model.train()
    if lora is not None:  # as the trainer applies it (tessel.parallel.apply.apply_lora)
        add_lora(model, lora.targets, lora.rank, lora.alpha, lora.dropout)
        if lora.base_dtype == "bfloat16":
            cast_base(model, torch.bfloat16)
    apply.apply_activation_checkpointing(model, ac, every)
    model.loss_chunks = chunks
    tokens = torch.randint(0, m.vocab_size, (mbs, T))
    docs = torch.tensor([[0] * (T // 3) + [1] * (T - T // 3)] * mbs) if mask else None
    meter = SavedTensorMeter.for_modules([model])
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16"
                else contextlib.nullcontext())
    targets = torch.randint(0, m.vocab_size, (mbs, T))
    with meter.measuring(), autocast:
        if chunks > 1:
            loss = model(tokens, docs, targets=targets).sum()
        else:
            loss = token_loss_sum(model(tokens, docs), targets)
    layout = Layout(1, 1, 1, 1, 1, 0, mbs, ac, activation_checkpointing_every=every,
                    loss_chunks=chunks)
    mem = estimate_memory(m, layout, T, mbs, precision, mask, lora)
    # Autocast's weight casts are saved tensors too; the planner counts them with the
    # parameters (their copies), above the masters (fp32; a LoRA base: lora.base_dtype).
    casts = mem.parameters - sum(p.numel() * p.element_size() for p in model.parameters())
    predicted = mem.saved + casts
    assert meter.peak == pytest.approx(predicted, rel=0.01), (meter.peak, predicted)
    loss.backward()  # and all of it is released again
    assert meter.current == 0


def test_moe_layers_of_a_stage_are_counted_as_the_model_marks_them():
    """The planner counts a stage's MoE layers in closed form (asked for every stage of every
    candidate layout); the count equals ModelConfig.is_moe_layer's, layer by layer."""
    from tessel.planner.kept import moe_layer_count

    for first in range(4):
        for every in range(1, 4):
            m = Config.load(None, {"model.preset": "tiny-moe", "model.n_layers": 12,
                                   "model.moe_first_dense_layers": first,
                                   "model.moe_every": every}).model
            assert m.n_moe_layers == sum(m.is_moe_layer(i) for i in range(12))
            for a in range(13):
                for b in range(a, 14):
                    want = sum(m.is_moe_layer(i) for i in range(a, b))
                    assert moe_layer_count(m, range(a, b)) == want, (first, every, a, b)
                    assert moe_layer_count(m, list(range(a, b))) == want
