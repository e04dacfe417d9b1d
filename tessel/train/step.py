"""TrainStep: one optimizer step (forward, backward, clip, step) for the plain and the
pipelined case, on one rank of any layout. What `tessel bench` times.

The loss of a step is a mean over every target token of the step, not a mean of
micro-batch means, so the accumulation count never changes its value. With masked targets
(fine-tuning: -100 where nothing is learned) it is the mean over the *counted* targets of the
whole step on every data-parallel rank: the count is all-reduced once per step, before the
backward passes, so N processes compute what one process computes on the same data.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from tessel.data import Batch
from tessel.models.loss import IGNORE_INDEX, token_loss_sum
from tessel.observe.timing import PhaseTimer
from tessel.parallel.dims import ParallelDims
from tessel.parallel.dist import all_reduce_sum
from tessel.parallel.grad_norm import clip_grad_norm
from tessel.parallel.pipeline import EmbeddingSync, build_schedule
from tessel.parallel.tensor import local_value, loss_context
from tessel.train.moe_balance import MoEBalance
from tessel.train.precision import Precision


class TrainStep:
    def __init__(self, model: Any, optimizers: list[torch.optim.Optimizer], dims: ParallelDims,
                 mesh: Any, device: torch.device, precision: Precision, *, accum: int,
                 grad_clip: float, parallel_cfg: Any, distributed: bool,
                 timer: PhaseTimer | None = None, phase: Callable[[str], None] | None = None,
                 masked: bool = False):
        """`model`: the ParallelModel of this rank (its parts, stages and data-parallel
        wrapper); `accum`: micro-batches per step; `phase`: the watchdog's phase marker;
        `masked`: targets may be -100 (not counted), so the step's divisor is the global count
        of counted targets (an all-reduce per step) rather than the local number of targets."""
        self.masked = masked
        self.model = model
        self.optimizers = optimizers
        self.dims = dims
        self.mesh = mesh
        self.device = device
        self.precision = precision
        self.accum = accum
        self.grad_clip = grad_clip
        self.reports_loss = reports_loss(dims, mesh, parallel_cfg.pp_virtual_stages)
        self.distributed = distributed
        self.timer = timer or PhaseTimer(device)
        self.phase = phase or (lambda _what: None)
        self.context = model.context
        self.loss_chunks = model.inner[-1].loss_chunks
        """Pieces the last stage computes the loss in (parallel.loss_chunks)."""
        """Context parallelism: shards each micro-batch's sequences for this rank."""
        self.loss_factor = 1.0  # fault injection only (TESSEL_FAULT)
        self.objective: Any = None
        """train.objective = "dpo": the loss hook (tessel.train.dpo_run.PreferenceObjective)
        that replaces the token cross-entropy; None: the cross-entropy."""
        self.replicas: Any = None
        """Fault tolerance ([fault_tolerance]): averages the loss and gradients over the
        replica groups (`average(loss, grads) -> loss`) and says whether the step may be
        applied (`commit()`); tessel.train.replicas.TrainerReplicas."""
        self.committed = True
        """Whether the last step was applied (False: a replica group failed during it)."""
        self._loss_tokens = 1  # the divisor of the pipeline's loss function
        self.schedule = None
        self.embedding_sync = EmbeddingSync(list(zip(model.stage_ids, model.inner)), mesh,
                                            dims.pp, model.inner[0].cfg.tie_embeddings)
        self.moe = MoEBalance(model.inner, distributed, dims.dp, dims.cp)
        """The MoE layers' aux-loss scale, token counts, balancing bias and metrics."""
        self._pipeline_infers = True
        """The next pipeline training step starts with the schedule's metadata-inference
        forward: on the first step, and again after an evaluation (torch.distributed.
        pipelining re-initialises its stages when the schedule switches eval <-> train)."""
        if dims.pp > 1:
            stages = list(zip(model.stage_ids, model.parts))
            self.schedule = build_schedule(stages, parallel_cfg, mesh["pp"], device, accum,
                                           self._pipeline_loss)

    # ---- the step -----------------------------------------------------------------------

    def set_lr(self, lr: float) -> None:
        for opt in self.optimizers:
            for group in opt.param_groups:
                if isinstance(group["lr"], torch.Tensor):  # torchao's keep it a tensor
                    group["lr"].fill_(lr)
                else:
                    group["lr"] = lr

    def __call__(self, batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over `batches` (the step's micro-batches); returns the loss
        and the gradient norm before clipping as device tensors (no host sync). The loss is
        this replica's on the rank that reports it, zero elsewhere."""
        self.phase("forward/backward (DDP/FSDP/TP/PP collectives inside)")
        self.timer.start("compute")
        objective = self.objective
        divisors = objective.divisors(batches, self.dims.dp) if objective is not None else None
        n_tokens = self.counted_tokens(batches) if self.masked and objective is None else sum(
            b.targets.numel() for b in batches)
        scaler = self.precision.scaler
        # fp16: the loss scale this step's gradients are multiplied by (GradScaler syncs
        # with the host in its step anyway, so reading it here costs nothing more).
        scale = scaler.get_scale() if scaler is not None and self.moe.active else 1.0
        if self.moe.active:
            self.moe.before_step(len(batches), scale)
        total = torch.zeros((), device=self.device)
        if self.schedule is not None:
            if objective is not None:
                objective.expect(batches, divisors, self._pipeline_infers)
            total = self._pipeline_step(batches, n_tokens)
            self.embedding_sync()  # tied embeddings: both copies take the summed gradient
        else:
            model = self.model.parts[0]
            # Under context parallelism each rank holds 1/cp of every sequence's tokens and
            # gradients are averaged over the cp ranks too: scale so they sum instead.
            divisor = n_tokens / self.dims.cp
            for i, batch in enumerate(batches):
                x, y, docs, positions = self.shard(*self.on_device(batch)[:3])
                last = i == len(batches) - 1
                with (self.model.dp.micro_batch(self.model.parts, last),
                      loss_context(self.dims.tp > 1)):
                    with self.precision.autocast():
                        out = model(x, docs, positions, **self.loss_inputs(y))  # (B, T/cp, V)
                    loss = (objective.loss(out, y, batch.ref, divisors) if objective is not None
                            else self.loss_sum(out, y) / divisor)
                    if self.loss_factor != 1.0:
                        loss = loss * self.loss_factor
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                total += local_value(loss.detach())
        if self.replicas is not None:  # fault tolerance: the mean over the replica groups
            self.phase("collective: gradients averaged over the replica groups (torchft)")
            total = self.replicas.average(total, [p.grad for p in self.model.parameters()
                                                  if p.grad is not None])
        self.phase("optimizer (grad-norm all-reduce inside)")
        self.timer.start("optimizer")
        if scaler is not None:
            for opt in self.optimizers:
                scaler.unscale_(opt)
        clip = self.grad_clip if self.grad_clip > 0 else math.inf
        pp_group = self.mesh["pp"].get_group() if self.dims.pp > 1 and self.mesh is not None else None
        # A tied embedding's pipeline copy is counted once (on the first stage) but clipped
        # like the original.
        copy = self.embedding_sync.param if self.embedding_sync.is_copy else None
        params = [p for p in self.model.parameters() if p is not copy]
        grad_norm = clip_grad_norm(params, clip, pp_group,
                                   also_clip=[copy] if copy is not None else [])
        self.committed = self.replicas is None or self.replicas.commit()
        for opt in self.optimizers:
            if not self.committed:
                pass  # a replica group failed during the step: none of it is applied
            elif scaler is not None:
                scaler.step(opt)
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.update()
        if self.moe.active:  # after the step: the bias moves with this step's counts
            # GradScaler skips the optimizer step when it found inf/nan gradients, and only
            # then lowers the scale: such a step changed no weight, so the router's bias
            # (trained state like them) must not move either.
            skipped = scaler is not None and scaler.get_scale() < scale
            self.moe.after_step(len(batches), self.device,
                                move_bias=self.committed and not skipped)
        self.timer.end()
        return total, grad_norm

    def loss_inputs(self, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the model takes besides its inputs for its output: the targets when it
        computes the loss itself, over pieces (parallel.loss_chunks > 1)."""
        return {"targets": targets} if self.loss_chunks > 1 else {}

    def loss_sum(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The summed loss of a micro-batch from the model's output: its logits, or the loss
        it computed itself (`loss_inputs`)."""
        return out.sum() if self.loss_chunks > 1 else token_loss_sum(out, targets)

    def _pipeline_loss(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.objective is not None:
            return self.objective.pipeline_loss(out, targets)
        loss = self.loss_sum(out, targets) / self._loss_tokens
        return loss * self.loss_factor if self.loss_factor != 1.0 else loss

    def _pipeline_step(self, batches: list[Batch], n_tokens: int) -> torch.Tensor:
        """All micro-batches of the step through the pipeline schedule (which interleaves
        their forward and backward passes); the loss lives on the last stage."""
        x, y, docs, positions = self.shard(*self.on_device(concat(batches))[:3])
        self._loss_tokens = n_tokens / self.dims.cp  # as in the plain step: cp ranks sum
        losses: list[torch.Tensor] = []
        args = (x,) if self.model.has_first else ()
        kwargs = {**model_kwargs(docs, positions), **self.loss_inputs(y)}
        target = y if self.model.has_last else None
        assert self.schedule is not None
        if self._pipeline_infers and self.moe.active:
            self.moe.skip_first_forward()  # that forward must not count as a micro-batch
        self._pipeline_infers = False
        with loss_context(self.dims.tp > 1), self.precision.autocast():
            self.schedule.step(*args, target=target, losses=losses, **kwargs)
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack([local_value(v.detach()).float() for v in losses]).sum()

    def pipeline_eval_sum(self, batches: list[Batch]) -> tuple[torch.Tensor, int]:
        """Summed loss of `batches` through the pipeline schedule without gradients, and
        the number of target tokens (the sum is on the last stage, zero elsewhere)."""
        x, y, docs, positions = self.shard(*self.on_device(concat(batches))[:3])
        self._loss_tokens = 1  # sums
        self._pipeline_infers = True  # the next training step re-initialises the stages
        losses: list[torch.Tensor] = []
        assert self.schedule is not None
        with loss_context(self.dims.tp > 1), self.precision.autocast():
            self.schedule.eval(*((x,) if self.model.has_first else ()),
                               target=y if self.model.has_last else None,
                               losses=losses, **model_kwargs(docs, positions),
                               **self.loss_inputs(y))
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        for v in losses:
            total += local_value(v).double()
        # fine-tuning counts the learned targets only (no host sync for dense data)
        return total, int((y != IGNORE_INDEX).sum()) if self.masked else y.numel()

    # ---- helpers ------------------------------------------------------------------------

    def counted_tokens(self, batches: list[Batch]) -> float:
        """Counted (not -100) targets of the whole step on all data-parallel ranks, divided
        by the data-parallel degree: the divisor that, once DDP/FSDP average the gradients
        over dp, makes the step's gradient that of the mean over every counted target.

        Every rank of a replica (its tp, pp and cp ranks) holds the same full micro-batches,
        so a sum over all ranks counts each replica world / dp times."""
        local = sum(int((b.targets != IGNORE_INDEX).sum()) for b in batches)
        if not self.distributed:
            return float(max(local, 1))
        self.phase("collective: all-reduce of the counted targets")
        count = all_reduce_sum(torch.tensor([local], dtype=torch.float64, device=self.device))
        world = torch.distributed.get_world_size()
        total = count.item() * self.dims.dp / world  # counted targets of the step, all replicas
        return max(total, 1.0) / self.dims.dp

    def shard(self, x: torch.Tensor, y: torch.Tensor, docs: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(inputs, targets, whole-sample document ids, positions) for this rank: under
        context parallelism its part of each sequence and their global positions (the
        document ids stay whole); else the batch as it is, positions None."""
        if self.context is None:
            return x, y, docs, None
        x, y, positions = self.context.shard(x, y)
        return x, y, docs, positions

    def on_device(self, batch: Batch) -> tuple[Any, ...]:
        if self.device.type != "cuda":
            return tuple(batch)
        # Pinned memory lets the copy overlap with compute (non_blocking).
        return tuple(
            t.pin_memory().to(self.device, non_blocking=True) if t is not None else None
            for t in batch
        )

    def global_loss(self, loss: torch.Tensor) -> float:
        """The step's loss averaged over data-parallel replicas (a host sync)."""
        if not self.distributed:
            return loss.item()
        self.phase("collective: all-reduce of the loss")
        mine = (loss.detach().float().reshape(1) if self.reports_loss
                else torch.zeros(1, device=self.device))
        return all_reduce_sum(mine.to(self.device)).item() / (self.dims.dp * self.dims.cp)

    def first_lr(self) -> float:
        return float(self.optimizers[0].param_groups[0]["lr"])  # torchao's: a tensor


def reports_loss(dims: ParallelDims, mesh: Any, virtual_stages: int) -> bool:
    """Whether this rank holds its replica's loss: in each data-parallel replica, the last
    pipeline stage's first tensor-parallel rank (once per context-parallel part)."""
    if mesh is None:
        return True
    if dims.pp > 1:
        n_stages = dims.pp * virtual_stages
        if (n_stages - 1) % dims.pp != mesh["pp"].get_local_rank():
            return False
    return mesh["tp"].get_local_rank() == 0


def model_kwargs(docs: torch.Tensor | None, positions: torch.Tensor | None) -> dict[str, Any]:
    """The model's keyword arguments besides the tokens, as a pipeline schedule passes them to
    every stage (split along the batch like the tokens)."""
    kwargs: dict[str, Any] = {}
    if docs is not None:
        kwargs["doc_ids"] = docs
    if positions is not None:
        kwargs["positions"] = positions
    return kwargs


def concat(batches: list[Batch]) -> Batch:
    """Micro-batches stacked into one batch (the pipeline schedule splits it again)."""
    docs = [b.doc_ids for b in batches]
    return Batch(
        torch.cat([b.inputs for b in batches]),
        torch.cat([b.targets for b in batches]),
        torch.cat(docs) if docs[0] is not None else None,  # type: ignore[arg-type]
    )


