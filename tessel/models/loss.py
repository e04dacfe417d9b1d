"""The language-modelling loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
