"""The planner's train.fp8 and parallel.async_tp terms, each against a count made here from
the shapes (not against the planner's own output): which linears run at the FP8 rate, the
casts' bytes at HBM bandwidth, FSDP's float8 all-gather, the float8 buffers, and the
transfers async TP hides."""

from __future__ import annotations

import dataclasses

import pytest

from tessel.config import Config
from tessel.planner.async_tp import hidden_seconds
from tessel.planner.calls import ring_seconds
from tessel.planner.fp8 import (
    FP8_GEMM_EFFICIENCY,
    Fp8Terms,
    attention_linears,
    converted_elements,
    gathered_bytes,
    mlp_linears,
)
from tessel.planner.hardware import get_profile
from tessel.planner.layout import Layout
from tessel.planner.search import evaluate

H100 = get_profile("h100-sxm")
LLAMA = {"model.preset": "llama3-8b", "train.seq_len": 8192, "train.precision": "bf16",
         "train.compile": True}


def _cfg(**overrides: object) -> Config:
    return Config.load(None, {**LLAMA, **overrides})


def test_the_converted_linears_are_the_blocks_with_dimensions_multiple_of_16():
    m = _cfg().model  # d 4096, q 4096, kv 1024, ffn 14336, swiglu
    assert attention_linears(m, 2) == [(4096, 2048, True), (4096, 512, True),
                                       (4096, 512, True), (2048, 4096, True)]
    assert mlp_linears(m, 14336, 2) == [(4096, 7168, True)] * 2 + [(7168, 4096, True)]
    per_block = 4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    assert converted_elements(m, 1, 32, 0) == 32 * per_block
    # a hidden size that is no multiple of 16 stays in bf16 (torchao's filter)
    odd = _cfg(**{"model.ffn_hidden": 1000}).model
    assert [c for *_, c in mlp_linears(odd, 1000, 1)] == [False] * 3


def test_a_linear_costs_its_fp8_and_bf16_matmuls_and_its_casts_at_hbm_bandwidth():
    rows, k, n, rate = 16384.0, 4096.0, 4096.0, 500e12
    fp8 = Fp8Terms("tensorwise", 1979e12, 3350e9)
    fast = 1979e12 * 0.6 * FP8_GEMM_EFFICIENCY
    # tensorwise: 3 float8 matmuls; casts of the input and weight twice, the gradient once,
    # 5 bytes an element (amax pass, then read + write)
    casts = 5 * (2 * rows * k + 2 * k * n + rows * n)
    want = 3 * 2 * rows * k * n / fast + casts / 3350e9
    assert fp8.linear_seconds(rows, k, n, rate, 0.6, 1.0) == pytest.approx(want)
    # rowwise_with_gw_hp: the weight gradient in bf16, 3-byte casts of x once, w twice, g once
    hp = Fp8Terms("rowwise_with_gw_hp", 1979e12, 3350e9)
    want = (2 * 2 * rows * k * n / fast + 2 * rows * k * n / rate
            + 3 * (rows * k + 2 * k * n + rows * n) / 3350e9)
    assert hp.linear_seconds(rows, k, n, rate, 0.6, 1.0) == pytest.approx(want)
    # float8 all-gather: the weight is cast on its shard (1/8 of it)
    sharded = Fp8Terms("tensorwise", 1979e12, 3350e9, all_gather=True, shard=8)
    assert sharded.cast_bytes(rows, k, n) == 5 * (2 * rows * k + 2 * k * n / 8 + rows * n)


def test_fsdp_gathers_converted_weights_at_one_byte():
    m = _cfg().model
    fp8 = Fp8Terms("tensorwise", 1979e12, 3350e9, all_gather=True, shard=8)
    dense = 8e9
    saved = converted_elements(m, 1, 32, 0)
    assert gathered_bytes(fp8, 2 * dense, 2, m, 1, 32, 0) == 2 * dense - saved
    assert gathered_bytes(dataclasses.replace(fp8, all_gather=False), 2 * dense, 2, m, 1, 32,
                          0) == 2 * dense
    assert gathered_bytes(None, 2 * dense, 2, m, 1, 32, 0) == 2 * dense


def test_a_plan_counts_fp8_only_where_the_gpu_has_it_and_less_than_the_peak_ratio():
    def plan(gpu: str, fp8: object):
        cfg = _cfg(**{"train.micro_batch_size": 2, "train.global_batch_size": 16,
                      "parallel.dp_shard": 8, "parallel.zero": 3,
                      "parallel.activation_checkpointing": "selective"})
        # the recipe set on the validated config (train.fp8's recipes are the FP8 layer's)
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"fp8": fp8})})
        return evaluate(cfg, Layout.from_config(cfg, 8), get_profile(gpu))

    bf16, fp8 = plan("h100-sxm", False), plan("h100-sxm", True)
    assert 1.05 < fp8.tokens_per_s / bf16.tokens_per_s < 2.0
    # ZeRO-3 with float8 all-gather: two gathered blocks' converted weights at 1 byte
    block = converted_elements(_cfg().model, 1, 1, 0)
    assert bf16.memory.parameters - fp8.memory.parameters == pytest.approx(2 * block)
    # the weight gradient in bf16 is slower than all three matmuls in float8
    assert plan("h100-sxm", "rowwise_with_gw_hp").tokens_per_s < plan(
        "h100-sxm", "rowwise").tokens_per_s
    # no FP8 tensor cores (A100), or MXFP8 on Hopper: the bf16 plan, exactly
    assert plan("a100-80gb", True).tokens_per_s == plan("a100-80gb", False).tokens_per_s
    assert plan("h100-sxm", "mxfp8").tokens_per_s == bf16.tokens_per_s


def test_async_tp_hides_at_most_its_transfers_and_the_fused_matmuls_share():
    m = _cfg().model
    lay = Layout(dp_replicate=1, dp_shard=1, tp=8, pp=1, cp=1, zero=1, micro_batch=1)
    tokens, bandwidth = 8192.0, 450e9 * 0.75
    pairs = 2 * ring_seconds(tokens * 4096 * 2, 8, bandwidth, all_reduce=True)
    got = hidden_seconds(m, lay, H100, tokens, 2, 32, 0, bandwidth, None, H100.bf16_flops)
    assert 0 < got <= 32 * 2 * pairs  # never more than the transfers (2 sub-layers a block)
    # a slow link: the matmuls bound it, (tp-1)/tp of the forward and input gradient
    slow = hidden_seconds(m, lay, H100, tokens, 2, 32, 0, 1e6, None, H100.bf16_flops)
    fast = hidden_seconds(m, lay, H100, tokens, 2, 32, 0, 1e15, None, H100.bf16_flops)
    assert slow > fast > 0
    assert hidden_seconds(m, dataclasses.replace(lay, tp=1), H100, tokens, 2, 32, 0,
                          bandwidth, None, H100.bf16_flops) == 0.0

    def step(async_tp: bool) -> float:
        cfg = _cfg(**{"parallel.tp": 8, "parallel.async_tp": async_tp,
                      "train.micro_batch_size": 1, "train.global_batch_size": 8})
        return evaluate(cfg, Layout.from_config(cfg, 8), H100).step.tp_comm_s

    assert 0 < step(True) < step(False)


def test_tessel_plan_says_which_matmuls_it_counts_at_the_fp8_rate():
    from tessel.planner.report import stack_line

    line = stack_line(_cfg(**{"train.fp8": True}), H100)
    assert "train.fp8 (tensorwise): at the FP8 peak" in line
    assert "linears with both dimensions multiples of 16" in line
    assert "the output layer at the BF16 rate" in line
    assert "no FP8 tensor cores" in stack_line(_cfg(**{"train.fp8": True}),
                                               get_profile("a100-80gb"))
    assert "fp8" not in stack_line(_cfg(), H100) and "async_tp" not in stack_line(_cfg(), H100)
    assert "parallel.async_tp" in stack_line(_cfg(**{"parallel.async_tp": True}), H100)


def test_tensorwise_tensor_parallel_all_gathers_move_float8():
    """Under tensorwise scaling with sequence parallelism (torchao's float8 TP styles, on
    CUDA) each collective's all-gather half moves 1 byte an element, its reduce-scatter half
    bf16's 2: the bytes part of the tensor-parallel time is 3/4 of rowwise's (which crosses in
    bf16); without sequence parallelism (all-reduces in bf16) nothing changes."""
    def tp_seconds(recipe: str, sp: bool = True) -> float:
        cfg = _cfg(**{"parallel.tp": 8, "parallel.sequence_parallel": sp, "train.fp8": recipe,
                      "train.micro_batch_size": 1, "train.global_batch_size": 8})
        return evaluate(cfg, Layout.from_config(cfg, 8), H100).step.tp_comm_s

    def latency(recipe: str) -> float:  # what the calls cost whatever their bytes
        cfg = _cfg(**{"parallel.tp": 8, "train.fp8": recipe, "train.micro_batch_size": 1,
                      "train.global_batch_size": 8})
        no_bytes = dataclasses.replace(H100, intra_node_gbps=1e30)
        return evaluate(cfg, Layout.from_config(cfg, 8), no_bytes).step.tp_comm_s

    tensorwise, rowwise = tp_seconds("tensorwise"), tp_seconds("rowwise")
    assert latency("tensorwise") == pytest.approx(latency("rowwise"), rel=1e-12)
    bytes_part = rowwise - latency("rowwise")
    assert bytes_part > 0
    assert tensorwise - latency("tensorwise") == pytest.approx(0.75 * bytes_part, rel=1e-9)
    assert tp_seconds("tensorwise", sp=False) == pytest.approx(tp_seconds("rowwise", sp=False),
                                                              rel=1e-12)
