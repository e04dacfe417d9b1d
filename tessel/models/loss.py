"""The language-modelling loss, whole or over chunks of the tokens."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
"""A target the loss skips (the -100 of fine-tuning data; cross-entropy's default)."""


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy, computed in fp32 whatever the compute dtype.

    logits: (B, T, V), targets: (B, T). Callers divide by the token count of the whole step
    so that the loss is a mean over tokens however the batch is split into micro-batches.
    Targets of -100 (fine-tuning: prompts, padding) add nothing; callers count only the others.
    """
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum",
                           ignore_index=IGNORE_INDEX)


PIECE_LOGITS = 2**28
"""The most logits one piece of a chunked loss holds per rank when the count is automatic
(parallel.loss_chunks = 0): 1 GiB in fp32."""


def loss_pieces(setting: int, tokens: float, vocab: float) -> int:
    """The pieces a micro-batch's loss runs in: `setting` (parallel.loss_chunks), or with 0
    as many as keep each piece's `tokens` x `vocab` logits (this rank's) at PIECE_LOGITS."""
    if setting:
        return setting
    return max(1, math.ceil(tokens * vocab / PIECE_LOGITS))


def chunked_loss_sum(logits_of: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor,
                     targets: torch.Tensor, chunks: int) -> torch.Tensor:
    """`token_loss_sum(logits_of(h), targets)` computed over `chunks` pieces of the tokens.

    h: (B, T, C) final hidden states, targets: (B, T). With chunks > 1 each piece's logits
    are made, reduced to its summed loss and dropped, and made again in the backward pass
    (non-reentrant checkpointing), so at most one piece's (tokens/chunks x vocabulary) logits
    exist at a time; the value and gradients are the whole loss's up to the order of the sums.
    """
    if chunks <= 1:
        return token_loss_sum(logits_of(h), targets)
    flat_h, flat_t = h.flatten(0, 1), targets.flatten()  # (B*T, C), (B*T,)
    total = None
    for piece_h, piece_t in zip(flat_h.tensor_split(chunks), flat_t.tensor_split(chunks)):
        if piece_t.numel() == 0:
            continue
        part = checkpoint(_piece_loss, logits_of, piece_h, piece_t, use_reentrant=False)
        total = part if total is None else total + part
    assert total is not None
    return total


def chunked_row_losses(logits_of: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor,
                       targets: torch.Tensor, chunks: int) -> torch.Tensor:
    """The summed next-token cross-entropy of each row, (B,), over `chunks` pieces of the
    tokens as `chunked_loss_sum` runs them (one piece's logits at a time, remade in backward):
    what preference tuning needs of a micro-batch (each reply's log-probability is minus its
    row's sum, the targets -100 outside it). Each piece keeps its tokens' losses (N floats,
    not N x vocabulary), which are summed per row once all pieces are done."""
    rows, length = targets.shape
    flat_h, flat_t = h.flatten(0, 1), targets.flatten()
    pieces = [checkpoint(_piece_token_losses, logits_of, piece_h, piece_t, use_reentrant=False)
              for piece_h, piece_t in zip(flat_h.tensor_split(chunks), flat_t.tensor_split(chunks))
              if piece_t.numel()]
    return torch.cat(pieces).view(rows, length).sum(1)


def _piece_token_losses(logits_of: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor,
                        targets: torch.Tensor) -> torch.Tensor:
    """(N, C), (N,) -> the fp32 cross-entropy of each of N tokens (0 where -100)."""
    return F.cross_entropy(logits_of(h).float(), targets, reduction="none",
                           ignore_index=IGNORE_INDEX)


def _piece_loss(logits_of: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor,
                targets: torch.Tensor) -> torch.Tensor:
    """(N, C), (N,) -> the summed fp32 cross-entropy of N tokens."""
    return F.cross_entropy(logits_of(h).float(), targets, reduction="sum",
                           ignore_index=IGNORE_INDEX)
