"""What LoRA (lora.enabled) changes in a memory estimate: the adapters' own parameters per
tensor-parallel rank, and the bytes of the frozen base.

The base has no gradients and no optimizer state; only the adapters train. Their placement
under tensor parallelism is `tessel.parallel.tensor.shard_lora`'s: beside a column-parallel
projection A is whole and B split by tp, beside a row-parallel one A is split and B whole.
"""

from __future__ import annotations

from tessel.config import LoraConfig, ModelConfig
from tessel.models.lora import resolve_targets


def projection_shapes(m: ModelConfig) -> dict[str, tuple[int, int, bool]]:
    """tessel projection name -> (in, out, column-parallel) for a dense block."""
    d, f, q, kv = m.d_model, m.ffn_hidden, m.q_dim, m.n_kv_heads * m.head_dim
    shapes = {"wq": (d, q, True), "wk": (d, kv, True), "wv": (d, kv, True),
              "wo": (q, d, False), "w1": (d, f, True), "w2": (f, d, False)}
    if m.mlp == "swiglu":
        shapes["w3"] = (d, f, True)
    return shapes


def adapter_parameters(m: ModelConfig, lora: LoraConfig, layers: int, moe_layers: int,
                       tp: int) -> int:
    """Adapter elements on one tensor-parallel rank holding `layers` blocks, `moe_layers` of
    them MoE layers (whose MLP has no adapters)."""
    shapes = projection_shapes(m)
    total = 0
    for t in resolve_targets(lora.targets):
        if t not in shapes:
            continue  # the trainer refuses it (the model has no such projection)
        n_in, n_out, column = shapes[t]
        per_layer = (lora.rank * n_in + lora.rank * n_out // tp if column
                     else lora.rank * n_in // tp + lora.rank * n_out)
        total += per_layer * (layers - moe_layers if t in ("w1", "w2", "w3") else layers)
    return total


def base_block_matmul_bytes(lora: LoraConfig) -> int:
    """Bytes per element of the frozen blocks' projection weights (lora.base_dtype)."""
    return 2 if lora.base_dtype == "bfloat16" else 4
