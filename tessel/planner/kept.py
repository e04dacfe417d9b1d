"""What a rank keeps of its layers and its head under activation checkpointing on some
blocks (parallel.activation_checkpointing_every) and a chunked loss (parallel.loss_chunks)."""

from __future__ import annotations

from tessel.config import ModelConfig
from tessel.models.variants import attention_share, uses_local_table
from tessel.parallel.checkpointing import checkpointed_blocks
from tessel.planner.layout import Layout
from tessel.planner.saved import ActivationProfile, SavedBytes


def moe_layer_count(m: ModelConfig, layers: range | list[int]) -> int:
    """How many of `layers` (indices) are MoE layers."""
    if isinstance(layers, range) and layers.step == 1:
        return m.moe_layers_between(layers.start, layers.stop)
    return sum(m.is_moe_layer(i) for i in layers) if m.moe_experts else 0


def stage_counts(m: ModelConfig, layout: Layout, layers: range) -> tuple[int, int, int, int]:
    """A stage's (layers, MoE layers, checkpointed dense layers, checkpointed MoE layers)."""
    n, n_moe = len(layers), moe_layer_count(m, layers)
    if layout.activation_checkpointing == "none":
        return n, n_moe, 0, 0
    checked = [i for i in checkpointed_blocks(m.n_layers, layout.activation_checkpointing_every)
               if i in layers]
    checked_moe = moe_layer_count(m, checked)
    return n, n_moe, len(checked) - checked_moe, checked_moe


def head_bytes(acts: ActivationProfile, loss_chunks: int) -> SavedBytes:
    """What the head keeps: with a chunked loss no logits (each piece makes its own again in
    backward), and the final hidden state in the residual dtype instead of the output
    projection's (autocast) copy of it, held whole by every tensor-parallel rank."""
    if loss_chunks == 1:
        return acts.head
    return (acts.head - acts.head_vocab - acts.head_input
            + SavedBytes(replicated=acts.block_input.sequence))


def unchecked_share(layout: Layout, n_layers: int) -> float:
    """The share of the blocks that keep everything (no checkpointing on them)."""
    if layout.activation_checkpointing == "none" or not n_layers:
        return 1.0
    every = layout.activation_checkpointing_every
    return 1 - len(checkpointed_blocks(n_layers, every)) / n_layers


def shared_per_token(m: ModelConfig, layout: Layout, seq_len: int, document_mask: bool,
                      dense_mask: bool, compute: int) -> float:
    """Bytes per token of what a micro-batch's blocks share: a dense additive mask in the
    compute dtype (`compute` bytes per token per position: this rank's rows over the whole
    sequence, or, for a Ulysses rank, every row; FlexAttention's block mask is small and
    left out) and each token's RoPE rotation when positions are given per token (documents,
    context parallelism)."""
    cp = layout.cp
    rows_here = cp == 1 or layout.cp_mode == "allgather"
    masked = document_mask or (cp > 1 and rows_here)  # Ulysses without documents: causal
    per_token = 4.0 * m.head_dim if m.position == "rope" and (document_mask or cp > 1) else 0.0
    if masked and dense_mask:
        per_token += seq_len * (1 if rows_here else cp) * compute
    # Sliding-window layers (model.sliding_window) get a mask of their own, with or without
    # documents, and their own per-token rotation with model.rope_local_theta.
    if attention_share(m, seq_len) < 1.0:
        per_token += seq_len * (1 if rows_here else cp) * compute if dense_mask else 0.0
        if uses_local_table(m) and (document_mask or cp > 1):
            per_token += 4.0 * m.head_dim
    return per_token


def context_buffers(m: ModelConfig, layout: Layout, tokens: float, compute: int) -> float:
    """Context parallelism's buffers of one layer in flight: the whole sequence's keys and
    values as gathered, or Ulysses' all-to-all send and
    receive buffers of queries, keys and values."""
    if layout.cp == 1:
        return 0.0
    kv = m.n_kv_heads * m.head_dim / layout.tp
    if layout.cp_mode == "ulysses":
        return 2 * tokens * (m.q_dim / layout.tp + 2 * kv) * compute
    return 2 * tokens * layout.cp * kv * compute
