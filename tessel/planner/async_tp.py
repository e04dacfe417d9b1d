"""What parallel.async_tp hides of tensor parallelism's collectives (`speed.py` subtracts it).

Micro-pipelined TP splits each sequence-parallel all-gather (before the column-parallel
projections) and reduce-scatter (after the row-parallel one) into tp pieces: the matmul of
a piece runs while the next piece moves. The transfers hide behind the matmuls of all but
one piece (the all-gather's last piece arrives with nothing left to compute beside it; the
reduce-scatter's first piece is computed before anything can be sent), so of a sub-layer's
collectives at most (tp - 1)/tp of the matmuls they are fused with hides them. Those are the
forward and the input-gradient matmuls of its linears, two thirds of their time (the weight
gradient's matmul is not fused with a collective). Each call's latency stays exposed.
"""

from __future__ import annotations

from tessel.config import ModelConfig
from tessel.planner.calls import ring_seconds
from tessel.planner.compute import linears_seconds
from tessel.planner.fp8 import Fp8Terms, attention_linears, mlp_linears
from tessel.planner.hardware import GpuProfile
from tessel.planner.layout import Layout

FUSED_SHARE = 2 / 3  # of a linear's forward + backward: the forward and input-gradient matmuls


def hidden_seconds(m: ModelConfig, layout: Layout, hw: GpuProfile, tokens: float,
                   act_bytes: float, layers: int, moe_layers: int, bandwidth: float,
                   fp8: Fp8Terms | None, peak: float) -> float:
    """Seconds of one micro-batch's tensor-parallel collectives (forward and backward, on a
    pipeline rank of `layers` blocks, `moe_layers` of them MoE blocks, whose MLP is not
    split) that async TP hides: per sub-layer (attention; a dense MLP) the smaller of its
    collectives' transfer time (an all-gather + reduce-scatter pair each way, an
    all-reduce's bytes) and (tp - 1)/tp of the fused matmuls' time."""
    tp = layout.tp
    if tp <= 1 or not layout.sequence_parallel:
        return 0.0
    rate = peak * hw.matmul_efficiency
    pairs = 2 * ring_seconds(tokens * m.d_model * act_bytes, tp, bandwidth, all_reduce=True)
    share = FUSED_SHARE * (tp - 1) / tp

    def hidden(linears: list) -> float:
        return min(pairs, share * linears_seconds(linears, tokens, rate, hw, fp8))

    attention = hidden(attention_linears(m, tp))
    mlp = hidden(mlp_linears(m, m.ffn_hidden, tp))
    return layers * attention + (layers - moe_layers) * mlp
