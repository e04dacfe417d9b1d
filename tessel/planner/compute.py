"""Compute time of one micro-batch on one GPU: each matmul's FLOPs at the peak the stack and
precision give, recomputation per checkpointing policy, and float8's rate for the blocks'
projections (train.fp8: `tessel.planner.fp8`). `speed.py` adds the communication, the bubble
and the optimizer."""

from __future__ import annotations

from tessel.config import ModelConfig
from tessel.models.loss import loss_pieces
from tessel.models.variants import attention_share
from tessel.planner.fp8 import Fp8Terms, Linear, attention_linears, mlp_linears
from tessel.planner.hardware import GpuProfile
from tessel.planner.kept import unchecked_share
from tessel.planner.layout import Layout

MATMUL_HALF_SIZE = 128  # a matmul whose smallest dimension is k runs at k/(k+128) of the rate
# Recomputed work as a share of a micro-batch's: full checkpointing runs each block's forward
# again; matmuls (every matmul output kept) recomputes only element-wise work (its time, not
# its FLOPs, shows). The per-op `selective` policy's share is counted from the shapes of the
# matmuls it recomputes (`recompute_seconds`).
RECOMPUTE = {"none": 0.0, "matmuls": 0.03, "full": 1.0 / 3.0}
# Routed experts' grouped matmuls (torch._grouped_mm) run at this fraction of what dense
# matmuls of the same size reach. Not fitted: one published measurement, VeOmni PR #460
# (ByteDance-Seed/VeOmni, H100, torch._grouped_mm MoE forward, Qwen3-30B-A3B's expert shape:
# 32,768 tokens, 128 experts of 768, top-8): 242 TFLOP/s, 0.46 of the 530 TFLOP/s this model
# gives dense matmuls of that size (0.625 x 768/896 of 989), rounded to 0.5.
GROUPED_GEMM_EFFICIENCY = 0.5


def _size_efficiency(k: float) -> float:
    return k / (k + MATMUL_HALF_SIZE)


def linears_seconds(linears: list[Linear], rows: float, rate: float, hw: GpuProfile,
                    fp8: Fp8Terms | None) -> float:
    """Seconds of forward + backward of a block's linears over `rows` rows at `rate` FLOP/s
    (times the small-dimension factor), train.fp8's converted ones as `fp8` says."""
    total = 0.0
    for k, n, converted in linears:
        size = _size_efficiency(min(rows, k, n))
        if fp8 is not None and converted:
            total += fp8.linear_seconds(rows, k, n, rate, hw.matmul_efficiency, size)
        else:
            total += 6 * rows * k * n / (rate * size)
    return total


def micro_batch_compute(m: ModelConfig, layout: Layout, hw: GpuProfile, seq_len: int,
                        layers: int, last: bool, peak: float, moe_layers: int = 0,
                        fp8: Fp8Terms | None = None) -> tuple[float, float]:
    """(seconds of one micro-batch's forward + backward on one GPU of a pipeline rank with
    `layers` blocks, `moe_layers` of them Mixture-of-Experts layers, of which attention)
    without recomputation. `fp8`: the blocks' linears train.fp8 converts (attention's and
    the dense MLPs', shared experts' included) run as `Fp8Terms.linear_seconds` says;
    attention, the router, routed experts and the head stay at `peak`."""
    tokens = layout.micro_batch * seq_len / layout.cp
    tp = layout.tp
    d, f = m.d_model, m.ffn_hidden
    n_in = 2 if m.mlp != "gelu" else 1
    rate = peak * hw.matmul_efficiency

    def matmuls(shapes: list[tuple[float, float]], rows: float, at: float) -> float:
        """Seconds of forward + backward of (K, N) matmuls over `rows` rows at rate `at`."""
        return sum(6 * rows * k * n / (at * _size_efficiency(min(rows, k, n))) for k, n in shapes)

    # Each matmul of a block on one tensor-parallel rank; M is `tokens`.
    attn_mm = linears_seconds(attention_linears(m, tp), tokens, rate, hw, fp8)
    block = attn_mm + linears_seconds(mlp_linears(m, f, tp), tokens, rate, hw, fp8)
    # Attention: QK^T and PV over the causal half of the (gathered) sequence, per head: each
    # context-parallel rank 1/cp of it (Ulysses: every row, heads/cp heads); contiguous
    # pieces leave the last rank (2cp-1)/cp of the mean.
    heads = m.n_heads / tp
    attn_flops = 6 * 2 * tokens * seq_len * m.head_dim * heads / 2
    # Sliding-window layers (model.sliding_window) see min(window, position) keys.
    attn_flops *= attention_share(m, seq_len)
    if layout.cp > 1 and not layout.cp_load_balance and layout.cp_mode == "allgather":
        attn_flops *= (2 * layout.cp - 1) / layout.cp
    attention = attn_flops / (rate * _size_efficiency(m.head_dim))
    total = (layers - moe_layers) * (block + attention)
    if moe_layers:
        assert m.moe_ffn_hidden is not None
        h, k, E = m.moe_ffn_hidden, m.moe_top_k, m.moe_experts
        # The fp32 router at half the BF16 rate, the shared experts as a dense MLP, the routed
        # experts over tokens x top_k slots, each local expert's rows tokens x k x ep / E.
        # Under tensor parallelism MoE layers are not split: each rank runs its 1/tp of the
        # sequence through whole weights.
        moe_tokens = tokens / tp
        moe = attn_mm + attention + matmuls([(d, E)], moe_tokens, rate / 2)
        if m.moe_shared_experts:
            moe += linears_seconds(mlp_linears(m, m.moe_shared_experts * h, 1), moe_tokens,
                                   rate, hw, fp8)
        slots = moe_tokens * k
        rows = slots * layout.ep / E
        moe += sum(6 * slots * a * b / (rate * GROUPED_GEMM_EFFICIENCY
                                        * _size_efficiency(min(rows, a, b)))
                   for a, b in [(d, h)] * n_in + [(h, d)])
        total += moe_layers * moe
    if last:
        v = m.padded_vocab_size / tp
        total += 6 * tokens * d * v / (rate * _size_efficiency(min(tokens, d, v)))
    return total, layers * attention


def recompute_seconds(m: ModelConfig, layout: Layout, hw: GpuProfile, seq_len: int,
                      t_mb: float, peak: float, layers: int, last: bool) -> float:
    """Seconds one micro-batch spends again in its backward: the share RECOMPUTE gives of its
    compute `t_mb` (full, matmuls), or the per-op policy's recomputed matmuls (the 2nd, 4th,
    6th of each block: wk, wo and w3 in a SwiGLU block, wk, wo and w2 in a GELU one), on the
    blocks checkpointing applies to; and the output projection's forward again for each
    piece of a chunked loss on the last stage."""
    ac = layout.activation_checkpointing
    share = 1.0 - unchecked_share(layout, m.n_layers)
    tokens = layout.micro_batch * seq_len / layout.cp
    tp, d = layout.tp, m.d_model
    rate = peak * hw.matmul_efficiency
    seconds = t_mb * RECOMPUTE.get(ac, 0.0) * share
    if ac == "selective":
        kv = m.n_kv_heads * m.head_dim
        hidden = m.ffn_hidden / tp
        even = [(d, kv / tp), (m.q_dim / tp, d),
                (d, hidden) if m.mlp != "gelu" else (hidden, d)]
        seconds += share * layers * sum(
            2 * tokens * k * n / (rate * _size_efficiency(min(tokens, k, n))) for k, n in even)
    if last and loss_pieces(layout.loss_chunks, tokens, m.padded_vocab_size / tp) > 1:
        v = m.padded_vocab_size / tp
        seconds += 2 * tokens * d * v / (rate * _size_efficiency(min(tokens, d, v)))
    return seconds
