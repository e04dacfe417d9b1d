"""What a model saves for backward, per token: the profiles the activation probe
(`probe.py`) measures and the memory model (`memory.py`) multiplies out."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SavedBytes:
    """Bytes saved per token of a micro-batch, by how tensor parallelism divides them."""

    replicated: float = 0.0
    sequence: float = 0.0
    sharded: float = 0.0

    def per_token(self, tp: int, sequence_parallel: bool) -> float:
        """Bytes per token on one tensor-parallel rank."""
        seq = self.sequence / tp if sequence_parallel and tp > 1 else self.sequence
        return self.replicated + seq + self.sharded / tp

    def __add__(self, other: SavedBytes) -> SavedBytes:
        return SavedBytes(self.replicated + other.replicated, self.sequence + other.sequence,
                          self.sharded + other.sharded)

    def __mul__(self, factor: float) -> SavedBytes:
        return SavedBytes(self.replicated * factor, self.sequence * factor, self.sharded * factor)

    def __sub__(self, other: SavedBytes) -> SavedBytes:
        return SavedBytes(self.replicated - other.replicated, self.sequence - other.sequence,
                          self.sharded - other.sharded)

    @property
    def total(self) -> float:
        return self.replicated + self.sequence + self.sharded


@dataclass(frozen=True)
class ActivationProfile:
    """What one micro-batch of a model saves for backward, per token (scaled to the model)."""

    block: SavedBytes
    """One transformer block without recomputation."""
    block_selective: SavedBytes
    """One block under selective checkpointing: the saved operator outputs and its input."""
    block_input: SavedBytes
    """One block's input: all that full checkpointing keeps per block."""
    per_position: float
    """Per layer, bytes per token per position of the sequence (an additive attention mask,
    attention probabilities): times seq_len. Replicated over tp (masks) for simplicity."""
    mask_per_position: float
    """Of per_position, the additive mask SDPA makes of a dense boolean one (none with
    FlexAttention's block masks)."""
    per_position_selective: float
    """The same under selective checkpointing (the attention scores it keeps, if the
    attention kernel materialises them)."""
    embedding: SavedBytes
    """The first stage's embedding work (token ids, dropout)."""
    head: SavedBytes
    """The last stage's final norm, output projection input, logits and loss."""
    weight_casts_per_param: float
    """Autocast's low-precision copies of the matmul weights, bytes per weight element,
    saved anew by every micro-batch's forward (0 without autocast over fp32 weights)."""
    moe_block: SavedBytes | None = None
    """One Mixture-of-Experts block without recomputation (None for a dense model)."""
    moe_block_selective: SavedBytes | None = None
    """One MoE block under selective checkpointing."""
    moe_router_copy: float = 0.0
    """Bytes an MoE layer saves per micro-batch whatever its tokens: the router's fp32 copy
    of its weight when the parameters are bf16 (FSDP), which the fp32 router matmul keeps."""


@dataclass(frozen=True)
class ContextProfile:
    """What a context-parallel rank saves, per token of its part of the sequence (micro_batch
    x seq_len / cp tokens), in one cp mode."""

    block: SavedBytes
    """One block, whatever cp (its own tokens' tensors; Ulysses' head-sharded ones)."""
    gathered: SavedBytes
    """One block, times cp: what the attention kernel keeps of the whole sequence's keys and
    values (all-gather mode; at the KV heads' width, as the kernel reads them)."""
    per_position: float
    """Per layer, per token per position of the whole sequence (times seq_len): the
    additive mask SDPA builds from the boolean one, attention probabilities."""
    mask_per_position: float
    """Of per_position, the dense mask's part (none with FlexAttention's block masks)."""
    per_position_cp: float
    """Per layer, times seq_len x cp: a dense mask of the whole sequence (Ulysses, whose
    ranks run every query row)."""
    block_selective: SavedBytes
    """One block under selective checkpointing."""
    per_position_selective: float
    embedding: SavedBytes
    head: SavedBytes
