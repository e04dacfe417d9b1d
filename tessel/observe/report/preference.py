"""The report's preference plots, for DPO runs only (train.objective = "dpo"): TRL's
figures as the trainer logs them (`tessel.train.dpo.PairStats`), training and held-out.

    rewards/chosen, rewards/rejected   beta x the log-probability ratio to the reference
    rewards/margins                    their difference, the mean over the pairs
    rewards/accuracies                 the share of pairs whose chosen reward is higher
    logps/chosen, logps/rejected       the replies' summed log-probabilities
    eval_<each of them>                the same over the held-out pairs (validation records)

A run without these keys (pretraining, SFT) has no such plots.
"""

from __future__ import annotations

from tessel.observe.report.plots import Line, Plot
from tessel.observe.report.run import Run

PLOT_IDS = ("plot-dpo_rewards", "plot-dpo_accuracy", "plot-dpo_logps")


def is_dpo(run: Run) -> bool:
    return any(k.startswith("rewards/") for r in run.train for k in r)


def preference_plots(run: Run) -> list[Plot]:
    """Rewards (chosen, rejected, margin), preference accuracy and reply log-probabilities
    over steps, each for the training pairs and, dotted, the held-out ones; nothing for a
    run that is not DPO."""
    if not is_dpo(run):
        return []

    def both(key: str, label: str, scale: float = 1.0) -> list[Line]:
        return [Line.of(run.train, key, label, scale),
                Line.of(run.val, f"eval_{key}", f"{label} (held out)", scale, dots=True)]

    return [
        Plot(PLOT_IDS[0], "Preference rewards (beta x log-ratio to the reference)", "reward",
             [*both("rewards/chosen", "chosen"), *both("rewards/rejected", "rejected"),
              *both("rewards/margins", "margin")], "metrics.jsonl has no rewards/* values"),
        Plot(PLOT_IDS[1], "Preference accuracy (chosen reward above rejected)", "% of pairs",
             both("rewards/accuracies", "accuracy", 100.0),
             "metrics.jsonl has no rewards/accuracies values"),
        Plot(PLOT_IDS[2], "Reply log-probabilities (summed over each reply)", "log-prob",
             [*both("logps/chosen", "chosen"), *both("logps/rejected", "rejected")],
             "metrics.jsonl has no logps/* values"),
    ]

