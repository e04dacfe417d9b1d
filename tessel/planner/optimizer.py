"""What the optimizer costs a layout: state bytes per parameter by optimizer and state
precision, and Muon's Newton-Schulz FLOPs and whole-matrix communication per step.

Muon (optim.name = "muon") keeps one momentum buffer for each hidden matrix (the blocks'
attention and MLP projections, each routed and shared expert's matrices) and AdamW's two
moments for everything else (embeddings, head, norms, biases, routers): the default
optim.muon_adamw split; other patterns are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tessel.config import ModelConfig
from tessel.planner.layout import Layout

STATE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "int8": 1.0 + 4.0 / 256}
"""Bytes per state element: int8 (torchao's AdamW8bit) adds a float32 scale per block of 256."""
NS_COEFFICIENT_FLOPS = 2
"""A multiply-add is two FLOPs."""

ASSUMPTIONS = (
    "optimizer state: AdamW 2 moments per parameter, Muon 1 momentum buffer per hidden "
    "matrix element (AdamW's 2 for the embeddings, head, norms, biases and routers), each "
    "4 bytes (float32), 2 (bfloat16) or 1 + 4/256 (int8 with a float32 scale per 256); "
    "Muon's step: 5 Newton-Schulz steps of 2(2A^2B + A^3) FLOPs per A x B matrix (A <= B) "
    "at the matmul rate, spread over the ranks holding shards of the matrix (dp x cp x tp "
    "under FSDP, else the tp ranks), the busiest owner's share at least one whole matrix; "
    "each matrix gathered whole (fp32 all-gather) and its result returned (reduce-scatter) "
    "over those ranks, not overlapped; the largest whole matrix and its result (fp32) "
    "transient in memory",
)


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer as the planner sees it."""

    name: str = "adamw"
    state_dtype: str = "float32"
    ns_steps: int = 5

    @classmethod
    def from_config(cls, optim: Any) -> OptimizerSpec:
        """From an OptimConfig (its state_dtype where it has one)."""
        return cls(optim.name, getattr(optim, "state_dtype", "float32"), optim.muon_ns_steps)

    @property
    def muon(self) -> bool:
        return self.name == "muon"

    def state_bytes(self, elements: float, muon_elements: float) -> float:
        """Optimizer-state bytes of `elements` local parameter elements, `muon_elements` of
        them Muon's matrices (ignored unless this is Muon)."""
        per = STATE_BYTES[self.state_dtype]
        if not self.muon:
            return 2 * per * elements
        return per * muon_elements + 2 * per * (elements - muon_elements)

    def step_bytes(self, elements: float, muon_elements: float) -> float:
        """Device-memory traffic of the element-wise update: AdamW reads and writes the
        parameter, reads the gradient and writes it to zero, reads and writes both moments
        (36 bytes in float32); Muon's matrices one buffer and its Nesterov update's write
        and read."""
        per = STATE_BYTES[self.state_dtype]
        adamw = 20 + 4 * per
        if not self.muon:
            return adamw * elements
        return (28 + 2 * per) * muon_elements + adamw * (elements - muon_elements)


ADAMW = OptimizerSpec()


def muon_matrices(m: ModelConfig, layers: int, moe_layers: int) -> list[tuple[int, int, int]]:
    """(rows, cols, how many) of the whole (unsplit) hidden matrices of `layers` blocks,
    `moe_layers` of them Mixture-of-Experts layers."""
    d, f, q, kv = m.d_model, m.ffn_hidden, m.q_dim, m.n_kv_heads * m.head_dim
    n_in = 2 if m.mlp != "gelu" else 1
    out = [(q, d, layers), (kv, d, 2 * layers), (d, q, layers)]
    dense = layers - moe_layers
    if dense:
        out += [(f, d, n_in * dense), (d, f, dense)]
    if moe_layers:
        assert m.moe_ffn_hidden is not None
        h = m.moe_ffn_hidden
        out += [(h, d, n_in * m.moe_experts * moe_layers), (d, h, m.moe_experts * moe_layers)]
        if m.moe_shared_experts:
            s = m.moe_shared_experts * h
            out += [(s, d, n_in * moe_layers), (d, s, moe_layers)]
    return [(a, b, n) for a, b, n in out if n]


def ns_flops(rows: int, cols: int, steps: int) -> float:
    """FLOPs of `steps` quintic Newton-Schulz iterations on one rows x cols matrix."""
    a, b = min(rows, cols), max(rows, cols)
    return steps * NS_COEFFICIENT_FLOPS * (2 * a * a * b + a ** 3)


def muon_sharers(layout: Layout, fsdp: bool) -> int:
    """Ranks that hold shards of one dense matrix and split its Newton-Schulz work."""
    return layout.dp * layout.cp * layout.tp if fsdp else layout.tp


@dataclass(frozen=True)
class MuonStep:
    """Muon's extra work in one optimizer step of one rank."""

    flops: float
    """Newton-Schulz FLOPs this rank runs (its share)."""
    comm_bytes: float
    """fp32 bytes this rank's ring collectives move (all-gather + reduce-scatter)."""
    group: int
    """Ranks of those collectives."""


def muon_step(m: ModelConfig, layout: Layout, layers: int, moe_layers: int, steps: int,
              fsdp: bool) -> MuonStep:
    """Newton-Schulz FLOPs and gather traffic of one pipeline rank's Muon matrices."""
    mats = muon_matrices(m, layers, moe_layers)
    n = muon_sharers(layout, fsdp)
    total = sum(ns_flops(a, b, steps) * k for a, b, k in mats)
    largest = max((ns_flops(a, b, steps) for a, b, _ in mats), default=0.0)
    flops = max(total / n, largest) if n > 1 else total
    elements = sum(a * b * k for a, b, k in mats)
    # all-gather of every matrix, then the reduce-scatter of its result: 2 x (n-1)/n x bytes
    comm = 2 * 4.0 * elements * (n - 1) / n if n > 1 else 0.0
    return MuonStep(flops, comm, n)


def muon_transient_bytes(m: ModelConfig, moe: bool) -> float:
    """The largest parameter gathered whole, and its result, in float32 (an MoE layer's
    expert stack is one parameter)."""
    mats = muon_matrices(m, 1, 1 if moe else 0)
    largest = max(a * b for a, b, _ in mats)
    if moe and m.moe_ffn_hidden is not None:
        largest = max(largest, m.moe_experts * m.d_model * m.moe_ffn_hidden)
    return 2 * 4.0 * largest
