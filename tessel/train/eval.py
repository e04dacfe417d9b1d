"""Evaluation during training: held-out loss over the validation split, in any layout.

Every layout evaluates the same sequences: `eval_iters` micro-batches in total over the
data-parallel ranks (never past the end of the split), and every replica counts equally.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from tessel.models.loss import IGNORE_INDEX, token_loss_sum
from tessel.parallel.dist import all_reduce_sum
from tessel.parallel.tensor import local_value, loss_context
from tessel.train.step import TrainStep


class Evaluator:
    def __init__(self, step: TrainStep, val: Any, eval_iters: int,
                 beat: Callable[[str], None] | None = None):
        """`step`: the TrainStep whose model (and pipeline schedule) is evaluated; `val`:
        the validation loader; `beat(what)`: tells the watchdog evaluation progresses."""
        self.step = step
        self.val = val
        self.eval_iters = eval_iters
        self.beat = beat or (lambda _what: None)

    @torch.no_grad()
    def loss(self) -> float:
        """Token-mean cross-entropy over `eval_iters` validation micro-batches of every
        data-parallel rank; NaN when they hold no counted target (fine-tuning batches whose
        targets are all masked: a mean over nothing)."""
        s, val = self.step, self.val
        val.reset()
        available = max(1, val.n_samples // val.mbs)
        iters = math.ceil(min(self.eval_iters, available) / s.dims.dp)
        total = torch.zeros((), device=s.device, dtype=torch.float64)
        count = 0
        s.model.train(False)
        if s.schedule is not None:
            # The schedule runs whole steps of `accum` micro-batches.
            for i in range(math.ceil(iters / s.accum)):
                self.beat(f"evaluation step {i}")
                part, n = s.pipeline_eval_sum([val.next_batch() for _ in range(s.accum)])
                total += part
                count += n
        else:
            model = s.model.parts[0]
            for i in range(iters):
                self.beat(f"evaluation batch {i}")
                x, y, docs, positions = s.shard(*s.on_device(val.next_batch()))
                with loss_context(s.dims.tp > 1), s.precision.autocast():
                    logits = model(x, docs, positions)
                    total += local_value(token_loss_sum(logits, y)).double()
                    # this rank's share under context parallelism; fine-tuning counts the
                    # learned targets only (-100 is not counted, as in the loss)
                    count += int((y != IGNORE_INDEX).sum()) if s.masked else y.numel()
        s.model.train(True)
        if not s.distributed:
            return total.item() / count if count else math.nan
        # Each replica's loss-reporting rank contributes its sum; all replicas count equally.
        sums = torch.stack([total if s.reports_loss else torch.zeros_like(total),
                            torch.tensor(float(count) if s.reports_loss else 0.0,
                                         dtype=torch.float64, device=s.device)])
        sums = all_reduce_sum(sums)
        return (sums[0] / sums[1]).item() if sums[1].item() else math.nan
