"""train.objective = "dpo" in the planner: what a DPO run does that a language-model run of
the same config does not (tessel.train.dpo_run, tessel.data.preference_data).

- train.micro_batch_size and train.global_batch_size count preference pairs, and a
  micro-batch of b pairs is 2b rows through the model at once (every chosen row, then every
  rejected one): activations, compute and tokens per step are those of twice the rows
  (`as_run`): parallel.loss_chunks = 0 (automatic) counts both rows, as the run does
  (TrainConfig.rows_per_micro_batch in tessel.parallel.apply). The rows carry no document mask.
- Before the first step one forward-only pass computes the reference log-probabilities of
  every train and validation pair (`reference_logps`), in micro-batches of
  train.micro_batch_size pairs dealt out over the data-parallel replicas. Its time is added
  to the run's (`reference_seconds`).
- With dpo.reference_model a second model of the policy's shape, without LoRA, is built in
  the run's layout for that pass, then freed: its weights sit beside the policy's stored
  weights, whose gradients and optimizer state (created at the first step) do not exist yet
  (`reference_memory`). Without it the policy runs the pass itself and holds less than in a
  training step (no gradients, no optimizer state, nothing saved for backward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tessel.config import Config
from tessel.planner.fp8 import Fp8Terms
from tessel.planner.hardware import GpuProfile
from tessel.planner.layout import Layout
from tessel.planner.memory import (
    CUDA_CONTEXT_BYTES,
    FRAGMENTATION,
    NCCL_BYTES,
    Memory,
    memory_by_rank,
)
from tessel.planner.optimizer import OptimizerSpec
from tessel.planner.speed import estimate_step

ROWS_PER_PAIR = 2
"""A preference pair's rows in a micro-batch: its chosen and its rejected reply."""

ASSUMPTIONS = (
    "DPO (train.objective = \"dpo\"): train.micro_batch_size and global_batch_size count pairs, "
    "each pair 2 rows (chosen, rejected) in one micro-batch, so memory, step time, tokens/s "
    "and MFU are those of twice the rows (mbs in a layout still counts pairs; the automatic "
    "parallel.loss_chunks counts them too), no document mask; before the first step the "
    "reference pass, forward only (1/3 of a micro-batch's compute, half its tensor-, "
    "context- and expert-parallel traffic, no recomputation, no optimizer; FSDP's gathers "
    "taken as hidden), over every train and validation pair, the micro-batches dealt out "
    "over the data-parallel replicas; the planner does not read dpo.paths and takes one epoch's "
    "worth: train.steps x global batch pairs plus data.split's validation share; its time "
    "is in the time to budget. With dpo.reference_model a second copy of the weights (fp32 "
    "masters sharded as the policy's, no LoRA, the copies its forward makes: FSDP's gathers, "
    "one autocast cast of every matmul weight) sits beside the policy's stored weights (no "
    "gradients or optimizer state before the first step) with one micro-batch's largest "
    "transient (a block's activations or the logits) and a training step's communication "
    "buffers (a bound); that is the plan's memory where it exceeds the training step's. "
    "Without it the policy runs the pass and holds less than a training step",
)


def is_dpo(cfg: Config) -> bool:
    return cfg.train.objective == "dpo"


def as_run(cfg: Config, layout: Layout) -> tuple[Layout, int, bool]:
    """(the layout as the model runs it, the global batch in rows, whether rows carry
    document masks): `layout` and the config's own for a language-model run; for DPO twice
    the rows of the micro-batch and the global batch (the loss's pieces follow), no mask."""
    t = cfg.train
    if not is_dpo(cfg):
        return layout, t.global_batch_size, cfg.data.document_mask
    rows = replace(layout, micro_batch=ROWS_PER_PAIR * layout.micro_batch)
    return rows, ROWS_PER_PAIR * t.global_batch_size, False


def reference_pairs(cfg: Config) -> int:
    """The pairs the reference pass is assumed to cover: one epoch's worth, train.steps x
    train.global_batch_size training pairs, plus the validation pairs data.split sets
    beside them (the planner does not read dpo.paths)."""
    t = cfg.train
    train, val, _ = cfg.data.split_fractions()
    return round(t.steps * t.global_batch_size * (train + val) / train)


@dataclass(frozen=True)
class ReferencePass:
    """The reference log-probabilities' pass of a DPO run, before its first step."""

    pairs: int
    """Pairs it covers (`reference_pairs`)."""
    seconds: float
    """Its time: each data-parallel replica runs 1/dp of the pairs' micro-batches."""
    memory: Memory | None
    """With dpo.reference_model: the busiest rank's memory during it; None: the policy's
    own pass, which holds less than a training step."""
    training: Memory
    """The training step's memory, the peak unless `memory` exceeds it."""

    @property
    def is_peak(self) -> bool:
        return self.memory is not None and self.memory.total > self.training.total


def reference_pass(cfg: Config, rows: Layout, hw: GpuProfile, precision: str,
                   optimizer: OptimizerSpec, fp8: Fp8Terms | None, flex_attention: bool,
                   training: Memory) -> ReferencePass:
    """The reference pass of `cfg` under `rows` (`as_run`'s layout) on `hw` (the stack's
    speed already applied), beside the training step's memory `training`."""
    pairs = reference_pairs(cfg)
    seconds = reference_seconds(cfg, rows, hw, precision, optimizer, fp8, pairs)
    memory = (reference_memory(cfg, rows, precision, flex_attention)
              if cfg.dpo.reference_model else None)
    return ReferencePass(pairs, seconds, memory, training)


def reference_seconds(cfg: Config, rows: Layout, hw: GpuProfile, precision: str,
                      optimizer: OptimizerSpec, fp8: Fp8Terms | None, pairs: int) -> float:
    """Seconds of the forward-only pass over `pairs` pairs: micro-batches of
    train.micro_batch_size pairs dealt out over the data-parallel replicas, each a third of a
    training micro-batch's compute without recomputation and half its model-parallel
    traffic; through a pipeline, a step's micro-batches at a time (the last group filled up
    with copies), each group paying the schedule's fill and its forward sends."""
    t = cfg.train
    batch = ROWS_PER_PAIR * t.global_batch_size
    step = estimate_step(cfg.model, replace(rows, activation_checkpointing="none"), hw,
                         t.seq_len, batch, precision, None, optimizer, fp8=fp8,
                         async_tp=cfg.parallel.async_tp)
    accum = batch // (rows.micro_batch * rows.dp)
    per_micro_batch = (step.compute_s / 3
                       + (step.tp_comm_s + step.cp_comm_s + step.ep_comm_s) / 2) / accum
    # dealt out over the data-parallel replicas, as many on each (reference_logps)
    micro_batches = math.ceil(math.ceil(pairs / (rows.micro_batch // ROWS_PER_PAIR)) / rows.dp)
    if rows.pp == 1:
        return micro_batches * per_micro_batch
    groups = math.ceil(micro_batches / accum)
    interleaved = rows.pp_schedule not in ("gpipe", "1f1b")
    fill = (rows.pp - 1) * per_micro_batch / (rows.pp_virtual_stages if interleaved else 1)
    return groups * (accum * per_micro_batch + fill + step.pp_comm_s / 2)


def reference_memory(cfg: Config, rows: Layout, precision: str, flex_attention: bool) -> Memory:
    """The busiest rank's memory while dpo.reference_model's copy computes: the policy's
    stored weights (`Memory.weights`: no compute copies, gradients or optimizer state
    yet), the reference's weights with the copies its forward makes (every matmul weight's
    autocast cast: one forward keeps all of them, checkpointing or not), the largest
    transient of one micro-batch (a block's full activations, as a checkpointed block's
    recomputation holds them, or the loss's logits) and a training step's communication
    buffers. The copy is taken as freed before the first step, as tessel.train.dpo_run
    means it to be."""
    m, t = cfg.model, cfg.train
    batch = ROWS_PER_PAIR * t.global_batch_size
    lora = cfg.lora if cfg.lora.enabled else None
    policy = memory_by_rank(m, rows, t.seq_len, batch, precision, False, lora, flex_attention)
    theirs, working = (memory_by_rank(m, replace(rows, activation_checkpointing=ac), t.seq_len,
                                      batch, precision, False, None, flex_attention)
                       for ac in ("none", "full"))
    during = []
    for mine, ref, one in zip(policy, theirs, working):
        parameters = mine.weights + ref.parameters
        transient = one.activations - one.saved
        allocated = parameters + transient + ref.communication
        margin = (CUDA_CONTEXT_BYTES + (NCCL_BYTES if rows.world > 1 else 0.0)
                  + FRAGMENTATION * allocated)
        during.append(Memory(parameters, 0.0, 0.0, transient, ref.communication, margin,
                             stage=mine.stage, weights=mine.weights + ref.weights))
    return max(during, key=lambda mem: mem.total)

