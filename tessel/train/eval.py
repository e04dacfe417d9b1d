"""Evaluation during training: held-out loss over the validation split, in any layout.

Every layout evaluates the same sequences as one process does: the first `eval_iters`
micro-batches of the validation split (never past its end), split over the data-parallel
ranks as the loader deals them (micro-batch `i` of rank `r` is the split's `i * dp + r`).
When they do not split evenly, every rank still runs as many forward passes as the busiest
one (sharded layouts gather weights in every forward), and the extra ones count nothing: the
figure is the token-mean over exactly those micro-batches, the single-process figure.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from tessel.data import Batch
from tessel.models.loss import IGNORE_INDEX
from tessel.parallel.dist import all_reduce_sum
from tessel.parallel.tensor import local_value, loss_context
from tessel.train.step import TrainStep


class Evaluator:
    def __init__(self, step: TrainStep, val: Any, eval_iters: int,
                 beat: Callable[[str], None] | None = None, interval: int = 0,
                 last: int | None = None):
        """`step`: the TrainStep whose model (and pipeline schedule) is evaluated; `val`:
        the validation loader (its `dp_rank` of `dp_size` shares; None: a run without a
        validation split, which evaluates nothing); `beat(what)`: tells the watchdog
        evaluation progresses; `interval` (train.eval_interval, 0: never) and `last` (the
        run's last step): when an evaluation is due."""
        self.step = step
        self.val = val
        self.eval_iters = eval_iters
        self.beat = beat or (lambda _what: None)
        self.interval, self.last = interval, last

    def due(self, step: int) -> bool:
        """Whether to evaluate after optimizer step `step`: every `interval` steps and after
        the last one."""
        return bool(self.interval and step % self.interval == 0) or step == self.last

    @torch.no_grad()
    def loss(self) -> float:
        """Token-mean cross-entropy over the first `eval_iters` validation micro-batches,
        whichever data-parallel rank runs them; NaN when they hold no counted target
        (fine-tuning batches whose targets are all masked: a mean over nothing)."""
        s, val = self.step, self.val
        val.reset()
        wanted = min(self.eval_iters, max(1, val.n_samples // val.mbs))  # over all ranks
        iters = math.ceil(wanted / val.dp_size)  # on every rank
        drawn = 0

        def next_batch() -> tuple[Batch, bool]:
            """The loader's next micro-batch and whether it counts (one of the `wanted`)."""
            nonlocal drawn
            counted = drawn * val.dp_size + val.dp_rank < wanted
            drawn += 1
            batch = val.next_batch()
            if counted:
                return batch, True
            # run (the ranks' collectives stay in step), count nothing
            return batch._replace(targets=torch.full_like(batch.targets, IGNORE_INDEX)), False

        s.model.train(False)
        if s.objective is not None:  # DPO: its loss and metrics (tessel.train.dpo_run)
            loss = s.objective.evaluate(s, next_batch, iters)
            s.model.train(True)
            return loss
        total = torch.zeros((), device=s.device, dtype=torch.float64)
        count = 0
        if s.schedule is not None:
            # The schedule runs whole steps of `accum` micro-batches.
            for i in range(math.ceil(iters / s.accum)):
                self.beat(f"evaluation step {i}")
                batches = [next_batch() for _ in range(s.accum)]
                part, n = s.pipeline_eval_sum([b for b, _ in batches])
                total += part
                kept = sum(c for _, c in batches)
                # masked data counts learned targets only (none in a batch not counted);
                # dense data counts every target of the micro-batches kept (all equal in size)
                count += n if s.masked else n * kept // len(batches)
        else:
            model = s.model.parts[0]
            for i in range(iters):
                self.beat(f"evaluation batch {i}")
                batch, counted = next_batch()
                x, y, docs, positions = s.shard(*s.on_device(batch)[:3])
                with loss_context(s.dims.tp > 1), s.precision.autocast():
                    out = model(x, docs, positions, **s.loss_inputs(y))
                    total += local_value(s.loss_sum(out, y)).double()
                    # this rank's share under context parallelism; fine-tuning counts the
                    # learned targets only (-100 is not counted, as in the loss)
                    if counted:
                        count += int((y != IGNORE_INDEX).sum()) if s.masked else y.numel()
        s.model.train(True)
        if not s.distributed:
            return total.item() / count if count else math.nan
        # Each replica's loss-reporting rank contributes its sum and count: the token mean
        # over the micro-batches counted, whichever rank ran them.
        sums = torch.stack([total if s.reports_loss else torch.zeros_like(total),
                            torch.tensor(float(count) if s.reports_loss else 0.0,
                                         dtype=torch.float64, device=s.device)])
        sums = all_reduce_sum(sums)
        return (sums[0] / sums[1]).item() if sums[1].item() else math.nan
