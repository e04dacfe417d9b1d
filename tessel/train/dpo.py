"""Direct preference optimisation (train.objective = "dpo"): the loss of TRL's DPOTrainer
(trl 1.16) and the metrics it logs, over the log-probabilities of whole replies.

A micro-batch of `b` preference pairs is 2b rows: the chosen reply of every pair, then the
rejected one of every pair (TRL's order), each row its prompt and reply with the targets of
the prompt and the padding at -100 (`tessel.data.preference`). A reply's log-probability is
the sum of its tokens' log-probabilities (TRL's `logps`, no length normalisation); the
reference model's are computed once before training (`reference_logps`).

With `delta = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)` per pair, the
losses are TRL's `loss_type`s:

- sigmoid: `-logsigmoid(beta * delta)` (DPO);
- hinge: `relu(1 - beta * delta)`;
- ipo: `(delta' - 1 / (2 beta))^2` where delta' divides each log-ratio by its reply's token
  count (TRL's length-normalised IPO);
- robust: `(-(1 - e) logsigmoid(beta delta) + e logsigmoid(-beta delta)) / (1 - 2e)`, e =
  dpo.label_smoothing.

The step's loss is `loss_weight * mean over the step's pairs + sft_weight * mean over the
step's chosen reply tokens of their negative log-likelihood` (TRL's `loss_type = [loss,
"sft"]` with `loss_weights`): both means are over the whole step on every data-parallel rank,
so N processes, or N micro-batches, compute what one does with the same pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from tessel.models.loss import IGNORE_INDEX

LOSSES = ("sigmoid", "ipo", "hinge", "robust")
"""The preference losses dpo.loss names (TRL's loss_type names)."""


def row_logps(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each row's counted targets, their count).

    logits: (R, T, V), targets: (R, T) with -100 where nothing counts. In fp32 whatever the
    compute dtype, as token_loss_sum; under tensor parallelism (loss_parallel) the logits
    are sharded over the vocabulary and cross_entropy reduces over it."""
    rows, length = targets.shape
    nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none",
                          ignore_index=IGNORE_INDEX)
    return -nll.view(rows, length).sum(1), (targets != IGNORE_INDEX).sum(1)


def pair_losses(policy: torch.Tensor, ref: torch.Tensor, counts: torch.Tensor, loss: str,
                beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """The preference loss of each pair (b,), TRL's formulas (module docstring).

    policy, ref: (b, 2) log-probabilities of (chosen, rejected); counts: (b, 2) their reply
    token counts (IPO's length normalisation)."""
    ratios = policy - ref.to(policy.dtype)  # (b, 2): chosen, rejected log-ratios
    delta = ratios[:, 0] - ratios[:, 1]
    if loss == "sigmoid":
        return -F.logsigmoid(beta * delta)
    if loss == "hinge":
        return torch.relu(1 - beta * delta)
    if loss == "ipo":
        per_token = ratios / counts.to(ratios.dtype).clamp(min=1.0)
        return (per_token[:, 0] - per_token[:, 1] - 1 / (2 * beta)) ** 2
    if loss == "robust":
        clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
        flipped = -label_smoothing * F.logsigmoid(-beta * delta)
        return (clean - flipped) / (1 - 2 * label_smoothing)
    raise ValueError(f"unknown preference loss {loss!r}; one of {', '.join(LOSSES)}")


def split_pairs(values: torch.Tensor) -> torch.Tensor:
    """(2b,) values of the rows [chosen..., rejected...] -> (b, 2) (chosen, rejected)."""
    chosen, rejected = values.chunk(2, dim=0)
    return torch.stack([chosen, rejected], dim=1)


@dataclass
class PairStats:
    """Sums over the pairs seen since the last reset (detached, for the metrics): TRL's
    rewards/* and logps/* are their means."""

    pairs: float = 0.0
    sums: dict[str, float] = field(default_factory=dict)

    def add(self, policy: torch.Tensor, ref: torch.Tensor, beta: float) -> None:
        """Pairs with (b, 2) policy and reference log-probabilities."""
        policy, ref = policy.detach().double(), ref.detach().double()
        rewards = beta * (policy - ref)
        values = {"rewards/chosen": rewards[:, 0], "rewards/rejected": rewards[:, 1],
                  "rewards/accuracies": (rewards[:, 0] > rewards[:, 1]).double(),
                  "rewards/margins": rewards[:, 0] - rewards[:, 1],
                  "logps/chosen": policy[:, 0], "logps/rejected": policy[:, 1]}
        self.pairs += float(policy.shape[0])
        for k, v in values.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v.sum())

    def vector(self) -> list[float]:
        """The pair count and the sums in a fixed order (what ranks add up)."""
        return [self.pairs, *(self.sums.get(k, 0.0) for k in METRICS)]

    @staticmethod
    def means(vector: list[float]) -> dict[str, float]:
        """The metrics from a (summed) `vector`; empty when it counts no pair."""
        pairs = vector[0]
        return {k: v / pairs for k, v in zip(METRICS, vector[1:])} if pairs else {}


METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")
"""The metrics a DPO run logs, TRL's names (means over the pairs of the logged steps)."""


def step_loss(policy: torch.Tensor, ref: torch.Tensor, counts: torch.Tensor, settings: Any,
              pair_divisor: float, token_divisor: float) -> torch.Tensor:
    """This micro-batch's share of the step's loss (module docstring): its pairs' losses
    over `pair_divisor` and, with dpo.sft_weight, its chosen replies' negative
    log-likelihood over `token_divisor` (each the step's count as the step divides it)."""
    losses = pair_losses(policy, ref, counts, settings.loss, settings.beta,
                         settings.label_smoothing)
    total = settings.loss_weight * losses.sum() / pair_divisor
    if settings.sft_weight:
        total = total - settings.sft_weight * policy[:, 0].sum() / token_divisor
    return total
