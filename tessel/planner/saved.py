"""What a model saves for backward, per token: the profiles the activation probe
(`probe.py`) measures and the memory model (`memory.py`) multiplies out, and how one rank
of a layout sees them (`rank_profile`, `layer_bytes`)."""

from __future__ import annotations

from dataclasses import dataclass, replace


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
class Kept:
    """What one block keeps under a selective checkpointing policy (`selective`, `matmuls`:
    tessel.parallel.checkpointing), per token."""

    block: SavedBytes
    """The kept operator outputs and the block's input."""
    per_position: float = 0.0
    """Per token per position (attention scores, if the kernel materialises them)."""
    moe_block: SavedBytes | None = None
    """An MoE block's (None for a dense model)."""
    gathered: SavedBytes = SavedBytes()
    """Under context parallelism, times cp: the whole sequence's keys and values that the
    all-gather returned (kept by the per-op policy)."""


@dataclass(frozen=True)
class ActivationProfile:
    """What one micro-batch of a model saves for backward, per token (scaled to the model)."""

    block: SavedBytes
    """One transformer block without recomputation."""
    kept: dict[str, Kept]
    """One block under each selective checkpointing policy, by its name."""
    block_input: SavedBytes
    """One block's input: all that full checkpointing keeps per block."""
    per_position: float
    """Per layer, bytes per token per position of the sequence (an additive attention mask,
    attention probabilities): times seq_len. Replicated over tp (masks) for simplicity."""
    mask_per_position: float
    """Of per_position, the additive mask SDPA makes of a dense boolean one (none with
    FlexAttention's block masks)."""
    embedding: SavedBytes
    """The first stage's embedding work (token ids, dropout)."""
    head: SavedBytes
    """The last stage's final norm, output projection input, logits and loss."""
    head_vocab: SavedBytes
    """Of `head`, what has the vocabulary's width (what the loss keeps of the logits): kept
    by no piece of a chunked loss (parallel.loss_chunks), which makes it again in backward."""
    head_input: SavedBytes
    """Of `head`, the output projection's saved input (autocast's copy of the final hidden
    state under bf16 autocast), which a chunked loss keeps as the hidden state itself."""
    weight_casts_per_param: float
    """Autocast's low-precision copies of the matmul weights, bytes per weight element,
    saved anew by every micro-batch's forward (0 without autocast over fp32 weights)."""
    moe_block: SavedBytes | None = None
    """One Mixture-of-Experts block without recomputation (None for a dense model)."""
    tp_gathered: float = 0.0
    """Per token and block, what the per-op policy keeps of the sequence-parallel all-gathers
    (the attention's and the MLP's gathered inputs), held whole by every tp rank."""
    tp_reduced: float = 0.0
    """Per token and block, what it keeps of the reductions after wo and w2 (all-reduced, or
    reduce-scattered along the sequence with sequence parallelism)."""
    moe_router_copy: float = 0.0
    """Bytes an MoE layer saves per micro-batch whatever its tokens: the router's fp32 copy
    of its weight when the parameters are bf16 (FSDP), which the fp32 router matmul keeps."""
    first: ActivationProfile | None = None
    """The same for a stage's first block where it differs: a LoRA model's, whose input (the
    frozen embeddings') needs no gradient, so what runs before its first adapter keeps
    nothing (its embedding and head as the profile's own). None: as every block."""


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
    kept: dict[str, Kept]
    """One block under each selective checkpointing policy (dense: no moe_block)."""
    embedding: SavedBytes
    head: SavedBytes
    head_vocab: SavedBytes
    head_input: SavedBytes
    first: ContextProfile | None = None
    """A stage's first block's, where it differs (LoRA: see ActivationProfile.first)."""


def rank_profile(acts: ActivationProfile, context: ContextProfile | None, cp: int,
                 dense_mask: bool) -> ActivationProfile:
    """`acts` as one rank sees it, per token of its part of the sequence: under context
    parallelism (`context`, measured in the layout's cp mode) its blocks' tensors plus cp x
    the whole sequence's keys and values the kernel keeps, and its masks over the whole
    sequence (MoE layers' MLPs as without cp, on the rank's tokens); without `dense_mask`
    (FlexAttention) no dense mask; its `first` block's likewise."""
    first = None
    if acts.first is not None:
        first = rank_profile(acts.first, context.first if context is not None else None, cp,
                             dense_mask)
    if context is not None:
        block = context.block + context.gathered * cp
        kept = {}
        for policy, k in context.kept.items():
            whole = k.block + k.gathered * cp
            moe = acts.kept[policy].moe_block
            kept[policy] = Kept(whole, k.per_position, moe and (
                whole + (moe - acts.kept[policy].block)))
        acts = replace(
            acts, block=block, kept=kept,
            per_position=context.per_position + context.per_position_cp * cp,
            mask_per_position=context.mask_per_position + context.per_position_cp * cp,
            embedding=context.embedding, head=context.head, head_vocab=context.head_vocab,
            head_input=context.head_input,
            moe_block=acts.moe_block and block + (acts.moe_block - acts.block))
    if not dense_mask:
        acts = replace(acts, per_position=acts.per_position - acts.mask_per_position,
                       mask_per_position=0.0)
    return replace(acts, first=first) if first is not None else acts


def layer_bytes(acts: ActivationProfile, checkpointing: str, tp: int, sp: bool,
                seq_len: int) -> tuple[float, float]:
    """Bytes per token one micro-batch keeps of a dense and of an MoE layer under
    activation checkpointing `checkpointing` on a tensor-parallel rank."""
    if checkpointing == "full":
        return acts.block_input.per_token(tp, sp), acts.block_input.per_token(tp, sp)
    if checkpointing in acts.kept:
        kept = acts.kept[checkpointing]
        scores = kept.per_position * seq_len
        returned = 0.0  # what tensor parallelism's collectives returned, kept by the per-op policy
        if checkpointing == "selective" and tp > 1:
            returned = (acts.tp_gathered + acts.tp_reduced / tp) if sp else acts.tp_reduced
        moe = kept.moe_block or kept.block
        # An MoE layer's MLP runs on the rank's own part of the sequence: only its
        # attention's gather and reduction (half of a dense block's).
        return (kept.block.per_token(tp, sp) + scores + returned,
                moe.per_token(tp, sp) + scores + returned / 2)
    per_position = acts.per_position * seq_len
    moe = acts.moe_block or acts.block
    return acts.block.per_token(tp, sp) + per_position, moe.per_token(tp, sp) + per_position
