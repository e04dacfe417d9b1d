"""The planner's LoRA estimate (lora.enabled): the adapters it counts are the real model's
trainable parameters; only they have gradients and AdamW state; the frozen base is held in
lora.base_dtype; what a LoRA rank saves for backward under FSDP; and a LoRA plan needs far
less memory than full fine-tuning. (Activations in one process and under context
parallelism: test_planner_memory.py, test_planner_context.py.)"""

from __future__ import annotations

import pytest
import torch
from saved_memory import SavedTensorMeter
from test_planner_context import fake_group
from test_planner_memory import LAYOUTS

from tessel.config import Config
from tessel.models.lora import add_lora
from tessel.models.loss import token_loss_sum
from tessel.models.transformer import Transformer
from tessel.parallel.apply import build_parallel_model
from tessel.parallel.dims import ParallelDims
from tessel.planner.layout import Layout
from tessel.planner.lora import adapter_parameters
from tessel.planner.memory import (
    ADAM_BYTES,
    GIB,
    GRAD_BYTES,
    MASTER_BYTES,
    estimate_memory,
    memory_by_rank,
)

SMALL = {"model.preset": "tiny-llama", "model.n_layers": 3, "train.seq_len": 64,
         "train.micro_batch_size": 2, "train.global_batch_size": 2, "lora.enabled": True,
         "lora.rank": 4, "lora.targets": ["q_proj", "v_proj", "o_proj", "gate_proj",
                                          "up_proj", "down_proj"]}


def real_model(cfg: Config) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg.model)
    add_lora(model, cfg.lora.targets, cfg.lora.rank, cfg.lora.alpha)
    return model


def plan(cfg: Config, lora: bool):  # noqa: ANN201
    t = cfg.train
    return estimate_memory(cfg.model, Layout.from_config(cfg, 1), t.seq_len, t.global_batch_size,
                           "fp32", lora=cfg.lora if lora else None)


@pytest.mark.parametrize("base_dtype", ["float32", "bfloat16"])
def test_a_small_lora_plan_counts_the_real_models_parameters(base_dtype):
    cfg = Config.load(None, {**SMALL, "lora.base_dtype": base_dtype})
    model = real_model(cfg)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert adapter_parameters(cfg.model, cfg.lora, cfg.model.n_layers, 0, 1) == trainable
    # the blocks' projection weights: what lora.base_dtype holds in bf16
    projections = sum(p.numel() for n, p in model.named_parameters()
                      if n.startswith("layers.") and not p.requires_grad and p.ndim == 2)
    mem, full = plan(cfg, lora=True), plan(cfg, lora=False)
    assert mem.gradients == GRAD_BYTES * trainable
    assert mem.optimizer == ADAM_BYTES * trainable
    base_bytes = MASTER_BYTES * frozen - (2 * projections if base_dtype == "bfloat16" else 0)
    # one fp32 process: no compute copies, so parameters are exactly base + adapters
    assert mem.parameters == base_bytes + MASTER_BYTES * trainable
    assert full.gradients == GRAD_BYTES * frozen and full.optimizer == ADAM_BYTES * frozen
    # frozen matmuls keep no input for their weights' gradients, the frozen head nothing
    assert mem.activations < full.activations


@pytest.mark.parametrize("layout", [
    {"parallel.cp": 2},  # ZeRO-1 keeps the gathered base from forward to backward
    {"parallel.zero": 3, "parallel.activation_checkpointing": "full"},
])
def test_a_sharded_lora_rank_saves_what_the_planner_predicts(layout):
    """Rank 0 of lora_cp2 and lora_zero3_ac_full (tests/distributed/test_layouts.py) in this
    process, on a fake process group of 2: the real parallel model, FSDP included. FSDP's
    gathered frozen weights, which autograd keeps a reference to, are parameters (counted
    with them), not activations: what is saved is what one process without FSDP saves
    (measured: 746,756 and 226,052 bytes, where the full-training figure is 822,916 and
    259,332), as the planner predicts."""
    cfg = Config.load(None, {
        **{f"model.{k}": v for k, v in LAYOUTS.items()}, "data.document_mask": True,
        "train.seq_len": 32, "train.micro_batch_size": 2, "train.global_batch_size": 8,
        "lora.enabled": True, "lora.rank": 4, "lora.alpha": 8.0,
        "lora.targets": ["wq", "wk", "wv", "wo", "w1", "w2", "w3"], **layout})
    torch.manual_seed(0)
    tokens, targets = (torch.randint(0, 512, (2, 32)) for _ in range(2))
    docs = torch.tensor([[0] * 10 + [1] * 22] * 2)
    with fake_group(2):
        dims = ParallelDims.from_config(cfg.parallel, 2)
        model = build_parallel_model(cfg, dims, dims.build_mesh("cpu"), torch.device("cpu"),
                                     None)
        model.train()
        positions = None
        if model.context is not None:
            tokens, targets, positions = model.context.shard(tokens, targets)
        meter = SavedTensorMeter.for_modules(model.inner)
        with meter.measuring():
            loss = token_loss_sum(model.parts[0](tokens, docs, positions), targets)
            loss.backward()  # the peak is the forward's: nothing more is kept in backward
    predicted = memory_by_rank(cfg.model, Layout.from_config(cfg, 2), 32, 8, "fp32", True,
                               cfg.lora)[0]
    assert meter.peak == pytest.approx(predicted.saved, rel=0.01), (meter.peak, predicted.saved)
    assert meter.current == 0


def test_lora_needs_much_less_memory_than_full_fine_tuning():
    """Llama 3 8B on 8 GPUs under ZeRO-3, bf16: a rank-16 LoRA on every projection with a
    bf16 base against full fine-tuning of the same model."""
    cfg = Config.load(None, {"model.preset": "llama3-8b", "train.seq_len": 4096,
                             "train.micro_batch_size": 1, "train.global_batch_size": 8,
                             "parallel.zero": 3, "lora.enabled": True, "lora.rank": 16,
                             "lora.base_dtype": "bfloat16",
                             "lora.targets": ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]})
    layout, t = Layout.from_config(cfg, 8), cfg.train
    lora = estimate_memory(cfg.model, layout, t.seq_len, t.global_batch_size, "bf16",
                           lora=cfg.lora)
    full = estimate_memory(cfg.model, layout, t.seq_len, t.global_batch_size, "bf16")
    state = lambda mem: mem.parameters + mem.gradients + mem.optimizer  # noqa: E731
    # weights, gradients, AdamW state per GPU: 5.3 GB against 19.0 GB (the base's bf16
    # compute copies gathered by FSDP remain); activations are the same 37.6 GB
    assert state(lora) < 0.3 * state(full)
    assert full.total - lora.total > 12 * GIB
    # 42M adapters (0.5% of 8B): their gradients and AdamW state are a few hundred MB at most
    assert lora.gradients + lora.optimizer < 0.01 * (full.gradients + full.optimizer)
