"""Properties the planner's predictions must have whatever the model and layout (hypothesis):
memory grows with layers, sequence and micro-batch; sharding never adds memory; more GPUs
with a proportionally larger batch (weak scaling) never lower the best aggregate
throughput."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tessel.config import Config, ModelConfig
from tessel.planner.hardware import BUILTIN
from tessel.planner.layout import Layout
from tessel.planner.memory import estimate_memory
from tessel.planner.search import search

H100 = BUILTIN["h100-sxm"]

heads = st.sampled_from([4, 8, 16])
head_dim = st.sampled_from([32, 64, 128])
kv_ratio = st.sampled_from([1, 2, 4])
ffn_mult = st.sampled_from([2, 3, 4])


@st.composite
def models(draw) -> ModelConfig:
    h, hd = draw(heads), draw(head_dim)
    kv = max(h // draw(kv_ratio), 1)
    d = h * hd
    return ModelConfig(preset="tiny-llama", n_layers=draw(st.integers(2, 24)), d_model=d,
                       n_heads=h, n_kv_heads=kv, ffn_hidden=d * draw(ffn_mult),
                       vocab_size=draw(st.sampled_from([512, 32000, 128256])), max_seq_len=8192)


@st.composite
def layouts(draw) -> Layout:
    tp = draw(st.sampled_from([1, 2, 4]))
    zero = draw(st.integers(0, 3))
    return Layout(1, draw(st.sampled_from([1, 2, 8])), tp, 1, 1, zero,
                  draw(st.sampled_from([1, 2, 4])),
                  draw(st.sampled_from(["none", "selective", "matmuls", "full"])),
                  sequence_parallel=draw(st.booleans()),
                  activation_checkpointing_every=draw(st.sampled_from([1, 2])),
                  # a given number of loss pieces (the automatic count: its own property)
                  loss_chunks=draw(st.sampled_from([1, 4])))


precisions = st.sampled_from(["fp32", "bf16"])


@settings(max_examples=40, deadline=None)
@given(models(), layouts(), precisions, st.integers(1, 8))
def test_more_layers_never_need_less_memory(m, lay, precision, extra):
    more = m.model_copy(update={"n_layers": m.n_layers + extra})
    gb = lay.micro_batch * lay.dp * 2
    a = estimate_memory(m, lay, 1024, gb, precision)
    b = estimate_memory(more, lay, 1024, gb, precision)
    assert b.total >= a.total
    assert b.saved >= a.saved and b.parameters >= a.parameters


@settings(max_examples=40, deadline=None)
@given(models(), layouts(), precisions)
def test_longer_sequences_and_bigger_micro_batches_need_more_activation_memory(m, lay, precision):
    gb = lay.micro_batch * lay.dp * 4
    base = estimate_memory(m, lay, 1024, gb, precision).saved
    assert estimate_memory(m, lay, 2048, gb, precision).saved > base
    doubled = Layout(**{**lay.__dict__, "micro_batch": lay.micro_batch * 2})
    assert estimate_memory(m, doubled, 1024, gb * 2, precision).saved > base


@settings(max_examples=40, deadline=None)
@given(models(), layouts(), precisions)
def test_sharding_more_never_needs_more_memory(m, lay, precision):
    if lay.dp < 2 or lay.zero == 0:
        return
    gb = lay.micro_batch * lay.dp * 2
    more = Layout(**{**lay.__dict__, "dp_shard": lay.dp_shard * 2})
    a = estimate_memory(m, lay, 1024, gb, precision)
    b = estimate_memory(m, more, 1024, gb * 2, precision)
    assert b.optimizer <= a.optimizer and b.total <= a.total


@settings(max_examples=15, deadline=None)
@given(models(), st.sampled_from([1, 2, 4]), st.sampled_from([512, 2048]))
def test_weak_scaling_never_lowers_the_best_throughput(m, gpus, seq_len):
    def best(n: int) -> float:
        cfg = Config.load(None, {**{f"model.{k}": v for k, v in m.model_dump().items()
                                   if k not in ("preset",) and v is not None},
                                 "model.preset": None, "train.seq_len": seq_len,
                                 "train.global_batch_size": 8 * n, "train.micro_batch_size": 1})
        plans = search(cfg, n, H100, keep=1).plans
        return plans[0].tokens_per_s if plans else 0.0

    small, large = best(gpus), best(gpus * 2)
    assert large >= small * 0.999


@settings(max_examples=40, deadline=None)
@given(models(), layouts(), st.sampled_from([2, 4, 8]), st.sampled_from(["allgather", "ulysses"]))
def test_splitting_the_sequence_never_needs_more_activation_memory_on_a_gpu(m, lay, cp, mode):
    """With FlexAttention's block masks (CUDA), a context-parallel rank saves its share of
    every block's tensors and at most the whole sequence's keys and values: never more than
    the whole sequence on one rank. (On CPU a dense mask over the whole sequence can make a
    small model's rank hold more.)"""
    if mode == "ulysses" and (m.n_heads % (lay.tp * cp) or m.n_kv_heads % (lay.tp * cp)):
        mode = "allgather"
    split = Layout(**{**lay.__dict__, "cp": cp, "cp_mode": mode})
    gb = lay.micro_batch * lay.dp
    whole = estimate_memory(m, lay, 4096, gb, "bf16", flex_attention=True)
    part = estimate_memory(m, split, 4096, gb, "bf16", flex_attention=True)
    assert part.saved <= whole.saved and part.activations <= whole.activations


@settings(max_examples=40, deadline=None)
@given(models(), layouts(), precisions, st.sampled_from([1024, 4096, 8192]))
def test_the_automatic_loss_pieces_never_need_more_memory_than_whole_logits(m, lay, precision,
                                                                          seq_len):
    """parallel.loss_chunks = 0 splits the loss only where the logits are large, and then the
    rank holds less than with the whole logits at once."""
    gb = lay.micro_batch * lay.dp
    whole = estimate_memory(m, Layout(**{**lay.__dict__, "loss_chunks": 1}), seq_len, gb,
                            precision)
    auto = estimate_memory(m, Layout(**{**lay.__dict__, "loss_chunks": 0}), seq_len, gb,
                           precision)
    assert auto.total <= whole.total
