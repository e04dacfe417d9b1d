"""The trainer's side of fault-tolerant replica groups ([fault_tolerance], torchft through
tessel.parallel.replica_group): what a recovering peer receives, the quorum at every step, the
timeline events of lost, returned and recovered groups, and a discarded step's data.

A group's state for a peer is everything a resume from a checkpoint restores, from the one
registry (tessel.train.state.RunState): the weights, the optimizer state and the other parts
(step, data position, batches drawn, tokens seen, training time, last validation loss, the
alert rules' memory). It travels over torchft's checkpoint transport; no checkpoint file is
read or written for it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from tessel.errors import CollectiveTimeout, TesselError
from tessel.parallel.replica_group import ReplicaGroup

if TYPE_CHECKING:
    from tessel.config import Config
    from tessel.train.lifecycle import Lifecycle
    from tessel.train.state import Counters, RunState

MAX_DISCARDS = 10
"""Steps discarded in a row before a group gives up: one discard is a peer that failed during
the step; ten mean that no step can commit here (too few groups for min_replica_size while
the Lighthouse forms smaller quorums, or a fault that repeats)."""


class TrainerReplicas:
    def __init__(self, cfg: Config, device: torch.device, dp: int, data: Any, state: RunState,
                 counters: Counters, faults: Any, lifecycle: Lifecycle):
        """`dp`: the data-parallel degree within a group; `data`: the run's data (its train
        and val loaders); `state`: the run's stateful parts, what a peer receives;
        `faults`: the fault injection; `lifecycle`: where events are recorded."""
        ft = cfg.fault_tolerance
        self.batch = cfg.train.global_batch_size
        self.data, self.state, self.counters = data, state, counters
        self.faults, self.lifecycle = faults, lifecycle
        self.group_size, self.timeout_s = ft.group_size, ft.timeout_s
        self.min_replicas = ft.min_replica_size
        self.participants: int | None = None  # replica groups in the last quorum
        self._healed_at: int | None = None  # this group's step when it took a peer's state
        self._position: tuple[dict[str, Any], int] | None = None
        self._discards = 0  # steps discarded in a row
        self._joined: int | None = None  # the groups of the first quorum, for the first step
        self.group = ReplicaGroup(ft, device, counters.step, self.state_dict,
                                  self.load_state_dict)
        if data.val is not None:
            # Training takes the group's share of every global batch; evaluation does not:
            # every group evaluates the split's first eval_iters micro-batches, as one process
            # does, so groups with equal weights log the same val_loss.
            val = data.val
            val.dp_rank, val.dp_size = val.dp_rank - ft.replica_id * dp, dp
        lifecycle.display.print(f"tessel: fault tolerance: replica group {ft.replica_id} of "
                                f"{ft.group_size} (torchft; a step commits with at least "
                                f"{ft.min_replica_size})")

    # ---- what a recovering peer receives ------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return self.state.peer_state()  # what a checkpoint saves (tessel.train.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._healed_at = self.counters.step
        try:
            self.state.load_peer_state(state)  # refuses other datasets, in one line
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise TesselError(f"fault_tolerance: a peer's state does not fit this replica "
                              f"group ({first}); every group must run the same model, "
                              "optimizer and data") from None

    # ---- every step ---------------------------------------------------------------------

    def join(self) -> None:
        """The first quorum, for the first step, before the run writes anything: a group
        whose replica_id another running group holds is refused here in one line (exit 2),
        with nothing written; a group behind takes a peer's state."""
        try:
            n = self.group.quorum()
            # A new run waits (up to fault_tolerance.timeout_s) for every group, so that its
            # first steps train on whole global batches rather than on the first groups up.
            deadline = time.monotonic() + self.timeout_s
            while n < self.group_size and time.monotonic() < deadline and self.counters.step == 0:
                time.sleep(0.1)  # (the Lighthouse answers at once while no group is missing)
                n = self.group.quorum()
        except BaseException:
            self.group.close()  # leave the Lighthouse now: the others need not wait for it
            raise
        self._joined = n

    def begin_step(self) -> None:
        """Before the step draws its data: join the quorum (taking a peer's state when this
        group is behind), record what changed, and remember the data position in case the
        step is discarded."""
        if self._joined is None and self.participants is None:
            self.join()
        n = self._joined if self._joined is not None else self.group.quorum()
        self._joined = None
        step, record = self.counters.step, self.lifecycle.replicas_changed
        if self._healed_at is not None:
            record("replica_healed", n, f"replica group recovered step {step}'s weights, "
                   f"optimizer state and data position from a peer (it was at step "
                   f"{self._healed_at}; nothing read from disk for it)",
                   from_step=self._healed_at)
            self._healed_at = None
        before = self.participants
        if before is not None and n != before:
            kind = "replicas_lost" if n < before else "replicas_joined"
            batch = self.batch
            share = batch * n // self.group_size
            record(kind, n, f"replica groups {before} -> {n} at step {step} (a step trains on "
                   f"{share} of the global batch's {batch} sequences)", replicas_before=before)
        self.participants = n
        self._position = (self.data.train.state_dict(), self.counters.batches_drawn)

    def average(self, loss: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
        """The step's loss and gradients averaged over the groups of the quorum (one
        collective): the loss logged is the mean over the groups that took part."""
        mean = loss.detach().float().reshape(1).clone()
        self.faults.at_replica_allreduce(self.counters.step)
        self.group.average([mean, *grads])
        return mean.reshape(())

    def commit(self) -> bool:
        """Whether the step may be applied; if not (a group failed during it), the data
        position goes back so that the step is retried on the same global batch. After
        MAX_DISCARDS in a row the run stops in one line (exit code 3)."""
        if self.group.commit():
            self._discards = 0
            return True
        assert self._position is not None
        loader_state, self.counters.batches_drawn = self._position
        self.data.train.load_state_dict(loader_state)
        self._discards += 1
        if self._discards >= MAX_DISCARDS:
            m, step = self.min_replicas, self.counters.step + 1
            raise CollectiveTimeout(
                f"fault_tolerance: step {step} was discarded {self._discards} times in a "
                f"row ({self.participants} replica group(s) took part, min_replica_size={m}): "
                "start the missing groups, and the Lighthouse with --min_replicas of at least "
                f"{m} so that too few groups wait for more instead")
        self.lifecycle.display.print(f"tessel: fault tolerance: step {self.counters.step + 1} "
                                     "discarded (a replica group failed during it); retrying "
                                     "it on the same data")
        return False

    def figures(self) -> dict[str, int]:
        """For the metrics: the replica groups of the last quorum."""
        return {"replicas": self.participants} if self.participants is not None else {}

    def close(self) -> None:
        self.group.close()
