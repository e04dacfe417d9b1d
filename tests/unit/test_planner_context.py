"""Context parallelism in the planner: what a cp rank saves for backward against what the
real code saves (tessel.parallel.context on a fake process group: one process plays rank 0
of cp ranks, the collectives return tensors of the right shapes), the exchange's time by
hand, the layouts' display, and the search choosing cp for long sequences. (Per-rank memory
of whole CP runs on gloo: tests/distributed/test_layouts.py.)"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from saved_memory import SavedTensorMeter, metered_contexts
from test_planner_memory import ALL, LAYOUTS, adapters
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import tessel.parallel.checkpointing as apply
from tessel.config import Config, ModelConfig
from tessel.models.lora import add_lora, cast_base
from tessel.models.loss import token_loss_sum
from tessel.models.transformer import build_model
from tessel.parallel.context import apply_context_parallel
from tessel.planner import hardware
from tessel.planner.compute import micro_batch_compute
from tessel.planner.layout import Layout
from tessel.planner.memory import estimate_memory
from tessel.planner.report import breakdown, launch_line
from tessel.planner.search import evaluate, search, trainer_refusal
from tessel.planner.speed import (
    CP_CALLS,
    _ring,
    all_to_all,
    cp_exchange,
    estimate_step,
)

H100 = hardware.BUILTIN["h100-sxm"]
GQA = dict(preset="tiny-llama", n_layers=2, d_model=128, n_heads=8, n_kv_heads=2,
           ffn_hidden=352, vocab_size=1000)  # keys/values a quarter of the queries' width
QWEN = dict(GQA, head_dim=24, qk_norm=True)
GPT = dict(preset="tiny", n_layers=2, d_model=96, n_heads=6, vocab_size=700, max_seq_len=256)


def lay(cp: int = 1, mode: str = "allgather", **kw) -> Layout:
    base = dict(dp_replicate=1, dp_shard=1, tp=1, pp=1, cp=cp, zero=0, micro_batch=1)
    if mode != "allgather":  # (the default mode needs no keyword)
        kw["cp_mode"] = mode
    return Layout(**{**base, **kw})


@contextlib.contextmanager
def fake_group(size: int):
    """A process group of `size` ranks in this process (rank 0), whose collectives only
    produce tensors of the right shapes: enough to run the real exchange and count what it
    saves."""
    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield init_device_mesh("cpu", (size,), mesh_dim_names=("cp",))
    finally:
        dist.destroy_process_group()


CASES = [  # shape, cp, mode, precision, checkpointing, document mask
    (GQA, 2, "allgather", "fp32", "none", False),
    (GQA, 4, "allgather", "fp32", "none", True),
    (GQA, 4, "allgather", "bf16", "none", False),
    (GQA, 2, "allgather", "fp32", "selective", True),
    (GQA, 4, "allgather", "fp32", "full", True),
    (QWEN, 2, "allgather", "bf16", "none", True),
    (GPT, 2, "allgather", "fp32", "none", True),  # learned positions, multi-head
    (GQA, 2, "ulysses", "fp32", "none", False),
    (GQA, 2, "ulysses", "fp32", "none", True),
    (GPT, 2, "ulysses", "bf16", "selective", True),
]
# LoRA (test_planner_memory.py's adapters): lora_cp2 of tests/distributed/test_layouts.py
# (its rank 0 measured 746,756 bytes), under full checkpointing, in bf16 with a bf16 base,
# and Ulysses.
LORA_CASES = [
    (LAYOUTS, 2, "allgather", "fp32", "none", True, adapters(ALL, rank=4)),
    (LAYOUTS, 2, "allgather", "fp32", "full", True, adapters(ALL, rank=4)),
    (GQA, 4, "allgather", "bf16", "none", True, adapters(["wq", "wv", "w2"], "bfloat16")),
    (GQA, 2, "ulysses", "fp32", "selective", True, adapters(["wo", "w1"], dropout=0.1)),
]


@pytest.mark.parametrize("shape, cp, mode, precision, ac, docs, lora",
                         [(*case, None) for case in CASES] + LORA_CASES)
def test_a_context_parallel_rank_saves_what_the_planner_predicts(monkeypatch, shape, cp, mode,
                                                                 precision, ac, docs, lora):
    monkeypatch.setattr(apply, "create_selective_checkpoint_contexts",
                        metered_contexts(apply.create_selective_checkpoint_contexts))
    torch.manual_seed(0)
    m = ModelConfig(**shape)
    mbs, T = (2, 32) if shape is LAYOUTS else (2, 128)
    model = build_model(m, seed=0)
    model.train()
    tokens, targets = (torch.randint(0, m.vocab_size, (mbs, T)) for _ in range(2))
    doc_ids = torch.tensor([[0] * (T // 3) + [1] * (T - T // 3)] * mbs) if docs else None
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16"
                else contextlib.nullcontext())
    with fake_group(cp) as mesh:
        # in the trainer's order (tessel.parallel.apply.build_parallel_model)
        context = apply_context_parallel(model, mesh["cp"], mode, balanced=True)
        if lora is not None:
            add_lora(model, lora.targets, lora.rank, lora.alpha, lora.dropout)
            if lora.base_dtype == "bfloat16":
                cast_base(model, torch.bfloat16)
        if ac != "none":
            apply.apply_activation_checkpointing(model, ac)
        meter = SavedTensorMeter.for_modules([model])
        x, y, positions = context.shard(tokens, targets)
        with meter.measuring(), autocast:
            loss = token_loss_sum(model(x, doc_ids, positions), y)
        layout = lay(cp, mode, micro_batch=mbs, activation_checkpointing=ac)
        mem = estimate_memory(m, layout, T, mbs, precision, docs, lora)
        # Autocast's weight casts are counted with the parameters (their compute copies).
        casts = mem.parameters - sum(p.numel() * p.element_size() for p in model.parameters())
        assert meter.peak == pytest.approx(mem.saved + casts, rel=0.01), (meter.peak, mem.saved)
        loss.backward()
    assert meter.current == 0


def test_the_whole_sequences_keys_and_values_are_what_cp_does_not_divide():
    """All-gather mode: per rank the blocks' own tensors fall as 1/cp, the kernel's keys and
    values of the whole sequence do not (held at the KV heads' width: the kernel takes
    grouped-query attention as it is); Ulysses' head-sharded tensors all fall as 1/cp. On
    CUDA (FlexAttention's block masks) no dense mask is counted."""
    m = ModelConfig(preset="llama3-8b")
    T = 32768

    def saved(cp: int, mode: str = "allgather") -> float:
        return estimate_memory(m, lay(cp, mode, tp=2), T, 1, "bf16", flex_attention=True).saved

    keys_values = 2 * 2 * T * m.n_kv_heads * m.head_dim / 2 * m.n_layers  # bf16, KV heads/tp
    assert saved(1) > saved(2) > saved(4) > saved(8) > keys_values
    assert saved(4) - keys_values == pytest.approx((saved(1) - keys_values) / 4, rel=0.01)
    # Ulysses: a quarter, and a copy of the attention output (its all-to-all back).
    output_copy = T / 4 * m.q_dim / 2 * 2 * m.n_layers
    assert saved(4, "ulysses") == pytest.approx(saved(1) / 4 + output_copy, rel=0.01)
    # A CPU run holds one dense additive mask (bf16), shared by every layer: the rank's rows
    # over the whole sequence.
    dense = estimate_memory(m, lay(4, tp=2), T, 1, "bf16").saved
    assert dense - saved(4) == pytest.approx(T / 4 * T * 2, rel=0.01)


# ---- time -----------------------------------------------------------------------------------


def test_the_exchange_and_the_attention_by_hand():
    m = ModelConfig(preset="llama3-8b")
    T, mbs = 32768, 1
    intra = H100.intra_node_gbps * 1e9 * H100.comm_efficiency
    inter = H100.inter_node_gbps * 1e9 * H100.comm_efficiency
    # All-gather: keys and values of the whole sequence, n_kv_heads/tp heads, bf16.
    whole = 2 * mbs * T * m.n_kv_heads // 2 * m.head_dim * 2
    assert cp_exchange(m, lay(4, tp=2), H100, T, 2) == pytest.approx(3 / 4 * whole / intra)
    assert cp_exchange(m, lay(8, tp=2), H100, T, 2) == pytest.approx(7 / 8 * whole / inter)
    assert _ring(whole, 4, intra, all_reduce=False) == pytest.approx(3 / 4 * whole / intra)
    # Ulysses: the rank's queries, keys, values and output, each rank's 1/cp staying put.
    own = mbs * T / 4 * (2 * m.q_dim + 2 * m.n_kv_heads * m.head_dim) // 2 * 2
    assert cp_exchange(m, lay(4, "ulysses", tp=2), H100, T, 2) == pytest.approx(3 / 4 * own / intra)
    # 8 cp ranks two apart span two nodes: 3 peers in the node, 4 over the NIC.
    assert all_to_all(own, 8, H100, stride=2) == pytest.approx(max(3 * own / 8 / intra,
                                                                 4 * own / 8 / inter))
    # Each rank computes 1/cp of the causal attention; contiguous pieces leave the last rank
    # (2cp-1)/cp of the mean.
    _, whole_attention = micro_batch_compute(m, lay(), H100, T, 32, False, H100.bf16_flops)
    _, share = micro_batch_compute(m, lay(4), H100, T, 32, False, H100.bf16_flops)
    _, last = micro_batch_compute(m, lay(4, cp_load_balance=False), H100, T, 32, False,
                                  H100.bf16_flops)
    assert share == pytest.approx(whole_attention / 4)
    assert last == pytest.approx(share * 7 / 4)


@pytest.mark.parametrize("ac, passes", [("none", 2), ("selective", 2), ("matmuls", 3),
                                       ("full", 3)])
def test_the_exchange_is_exposed_once_a_pass(ac, passes):
    """Forward, backward (reduce-scatter of the gradients) and, under checkpointing that
    does not keep what the exchange returned (full, matmuls), the recomputed forward: every
    layer, every micro-batch, not hidden. The per-op selective policy keeps it."""
    m = ModelConfig(preset="llama3-8b")
    layout = lay(4, tp=2, dp_shard=2, zero=1, activation_checkpointing=ac)
    step = estimate_step(m, layout, H100, 32768, 8, "bf16")
    micro_batches = 8 // 2
    # the bytes' time and each call's latency (the keys' and the values' all-gathers)
    one = cp_exchange(m, layout, H100, 32768, 2) + CP_CALLS["allgather"] * H100.collective_latency_s
    assert step.cp_comm_s == pytest.approx(micro_batches * passes * m.n_layers * one)
    assert step.cp_comm_s <= step.raw_comm_s
    c = Config.load(None, {"model.preset": "llama3-8b", "model.max_seq_len": 32768, "train.seq_len": 32768,
                           "train.global_batch_size": 8, "train.micro_batch_size": 1})
    assert "cp exposed" in breakdown(evaluate(c, layout, H100), H100)


# ---- layouts and the search -----------------------------------------------------------------


def test_a_context_parallel_layout_says_its_mode_and_launches_as_printed():
    c = Config.load(None, {"model.preset": "llama3-8b", "model.max_seq_len": 32768, "train.seq_len": 32768,
                           "train.global_batch_size": 8, "train.micro_batch_size": 1,
                           "parallel.cp": 4, "parallel.tp": 2,
                           "parallel.cp_mode": "ulysses", "parallel.dp_shard": 1})
    layout = Layout.from_config(c, 8)
    assert (layout.cp, layout.cp_mode) == (4, "ulysses")
    assert layout.short() == "dp=1 tp=2 pp=1 cp=4/ulysses zero=1 mbs=1"
    assert "cp=4/contiguous" in lay(4, cp_load_balance=False).short()
    line = launch_line("c.toml", evaluate(c, layout, H100))
    assert '--parallel.cp=4 ' in line and '--parallel.cp_mode="ulysses"' in line
    assert "cp_load_balance" not in line and "parallel.ep" not in line  # defaults
    relaunched = c.with_overrides(layout.overrides())
    assert Layout.from_config(relaunched, 8) == layout
    assert "cp_mode" not in lay().overrides()  # meaningless without cp


def test_llama3_405b_at_128k_on_16384_h100s_is_planned_with_context_parallelism():
    """Llama 3's long-context stage: 405B, 131,072 positions, 16M tokens per step (128
    sequences) on 16,384 H100s (Meta ran tp8 cp16 pp16 dp8). Without cp no layout fits (a
    sequence's activations alone exceed a GPU); the plan splits the sequence."""
    c = Config.load("configs/llama3-8b.toml", {
        "model.preset": "llama3-405b", "model.max_seq_len": 131072, "train.seq_len": 131072,
        "train.global_batch_size": 128, "parallel.auto": True})
    result = search(c, 16384, H100, keep=3)
    best = result.plans[0]
    assert best.fits and best.layout.cp > 1 and best.layout.tp == 8
    assert trainer_refusal(c, best.layout, full=True) is None
    assert all(p.layout.cp > 1 for p in result.plans)
    assert best.step.cp_comm_s > 0 and 0.3 < best.mfu < 0.5
