"""The checkpoint manager: save (synchronous or asynchronous), publish, restore, retention
and the Hugging Face exports that follow saves, for one rank's share of a model.

The trainer gives it the state to save (a JSON-able dict plus replicated tensors such as
RNG states) and asks it to restore; which files exist and how a save becomes visible is
`tessel.checkpoint.store`'s business.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tessel.checkpoint.errors import CheckpointError
from tessel.checkpoint.pending import PendingSave
from tessel.checkpoint.store import (
    Models,
    Optimizers,
    latest_checkpoint,
    load_model,
    load_optimizer,
    load_tensors,
    save_checkpoint,
)


class CheckpointManager:
    def __init__(self, root: Path, models: Models, optimizers: Optimizers, *, keep_last: int,
                 async_save: bool, distributed: bool, hf_export: Any = None,
                 phase: Callable[[str], None] | None = None,
                 barrier_group: Callable[[], dist.ProcessGroup | None] = lambda: None,
                 interval: int = 0):
        """`hf_export`: an HFExporter (rank 0, when checkpoint.hf_export_interval is set);
        `phase`: the watchdog's phase marker, told before each collective; `barrier_group`:
        the group of the barrier after publishing (asked only when distributed); `interval`:
        checkpoint.interval, when a save is due (0: only when the run ends or stops)."""
        self.interval = interval
        self.root = root
        self.models = models
        self.optimizers = optimizers
        self.keep_last = keep_last
        self.async_save = async_save
        self.distributed = distributed
        self.hf_export = hf_export
        self.phase = phase or (lambda _what: None)
        self.barrier_group = barrier_group
        self.pending: PendingSave | None = None
        self.last_saved_step = -1
        self._async_pg: dist.ProcessGroup | None = None

    def due(self, step: int) -> bool:
        """Whether to save after optimizer step `step` (every `interval` steps)."""
        return bool(self.interval and step % self.interval == 0)

    def latest(self) -> Path | None:
        return latest_checkpoint(self.root)

    def written_here(self) -> bool:
        """Whether this rank has finished writing the save in flight (if any)."""
        return self.pending is None or self.pending.done()

    def save(self, step: int, state: dict[str, Any], device: torch.device) -> None:
        """Checkpoint `step` on every rank, with `state` (JSON, written by rank 0) and the
        RNG states of the host and `device`; an asynchronous save is published later, once
        every rank has written it (`publish_finished`)."""
        self.publish_finished(wait=True)  # one save in flight at a time
        if self.hf_export is not None:
            self.hf_export.wait()  # pruning must not remove a checkpoint being exported
        result = save_checkpoint(
            self.root, step, self.models, self.optimizers, state, rng_state(device),
            keep_last=self.keep_last, async_save=self.async_save,
            async_group=self._async_group(),
        )
        if isinstance(result, PendingSave):
            self.pending = result
        elif self.hf_export is not None:
            self.hf_export.after_publish(result, step)
        self.last_saved_step = step

    def publish_finished(self, wait: bool = False, all_written: bool = False) -> None:
        """Publish the asynchronous save in flight when every rank has written it
        (`all_written`, agreed by the ranks) or, with `wait`, once it is written."""
        pending = self.pending
        if pending is None or not (wait or all_written):
            return
        path = pending.finish(barrier=self._barrier if self.distributed else None)
        self.pending = None
        if self.hf_export is not None:
            self.hf_export.after_publish(path, int(path.name.removeprefix("step_")))
        if self.distributed:
            self.phase("collective: barrier after publishing a checkpoint")
            self._barrier()

    def _barrier(self) -> None:
        dist.barrier(group=self.barrier_group())

    def restore(self, ckpt: Path, device: torch.device) -> None:
        """Model and optimizer state from `ckpt` (saved under any layout) into this rank's
        parts, and the RNG states of the host and `device` as they were."""
        load_model(ckpt, self.models)
        load_optimizer(ckpt, self.models, self.optimizers)
        rng = load_tensors(ckpt, rng_state(device))
        if "torch_cpu" not in rng:
            raise CheckpointError(f"checkpoint {str(ckpt)!r} lacks 'torch_cpu'; it is damaged")
        torch.set_rng_state(rng["torch_cpu"])
        if device.type == "cuda" and "torch_cuda" in rng:
            torch.cuda.set_rng_state(rng["torch_cuda"], device)

    def finish(self) -> None:
        """At the end of training: publish the last save and let an export finish."""
        self.publish_finished(wait=True)
        if self.hf_export is not None:
            self.hf_export.wait()

    def _async_group(self) -> dist.ProcessGroup | None:
        """A gloo group used only by asynchronous saves: their collectives run on a
        background thread while training runs its own (created on every rank)."""
        if not (self.distributed and self.async_save):
            return None
        if self._async_pg is None:
            self._async_pg = dist.new_group(backend="gloo")
        return self._async_pg


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """The RNG states a checkpoint keeps (dropout must replay exactly on resume)."""
    rng = {"torch_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        rng["torch_cuda"] = torch.cuda.get_rng_state(device)
    return rng
