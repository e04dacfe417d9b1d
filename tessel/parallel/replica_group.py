"""Fault-tolerant data-parallel replica groups through torchft ([fault_tolerance]).

Each replica group is one `tessel train` process holding the whole model; the groups are
plain data parallelism (DDP) across machines that may fail. torchft's Lighthouse decides,
at every step, which groups take part (the quorum); torchft's Manager averages the
gradients over those groups only, commits the step only when every participant finished
it, and hands a group that is behind (restarted) the state of a healthy peer. tessel writes
no quorum protocol of its own: this module is the narrow door to torchft, imported only
when the mode is on.

What tessel decides (docs/parallelism.md, "Fault-tolerant replicas"): each group trains on
its fixed share of every global batch (`data_share`); with fewer groups in a step the
gradient is the mean over the shares that took part (a smaller effective batch, the shares
of the missing groups are skipped); a step that fails is discarded and retried on the same
data.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from tessel.config import Config, FaultToleranceConfig
from tessel.config.fault_tolerance import lighthouse_problem
from tessel.errors import CollectiveTimeout, TesselError
from tessel.parallel.dims import ParallelDims, ParallelError

FT_INSTALL = "pip install 'tessel[ft]'"


def replica_groups(cfg: Config) -> int:
    """How many replica groups share each global batch (1 when the mode is off)."""
    ft = cfg.fault_tolerance
    return ft.group_size if ft.enable else 1


def data_share(cfg: Config, dp_rank: int, dp: int) -> tuple[int, int]:
    """(rank, number of shares) of this process's part of every global batch: its
    data-parallel rank within its replica group, offset by the group's number."""
    ft = cfg.fault_tolerance
    if not ft.enable:
        return dp_rank, dp
    return ft.replica_id * dp + dp_rank, dp * ft.group_size


def check_replicas(cfg: Config, dims: ParallelDims, precision: str) -> None:
    """Refuse, in one line, what the fault-tolerant mode cannot run."""
    ft = cfg.fault_tolerance
    if not ft.enable:
        return
    if importlib.util.find_spec("torchft") is None:
        raise ParallelError(f"fault_tolerance.enable needs torchft, which is not installed: "
                            f"{FT_INSTALL}")
    if dims.world_size > 1:
        raise ParallelError(
            f"fault_tolerance.enable runs each replica group as one process holding the whole "
            f"model (plain DDP across the groups); this group has {dims.world_size} processes "
            f"({dims.describe()}): launch one single-process `tessel train` per replica group "
            "(sharded or multi-process groups, HSDP's replicate dimension, are not supported)")
    if cfg.recovery.spike_sigma > 0:
        raise ParallelError("fault_tolerance.enable does not combine with recovery.spike_sigma "
                            "(a rollback reloads a checkpoint the other replica groups do "
                            "not): set recovery.spike_sigma = 0")
    if precision == "fp16":
        raise ParallelError("fault_tolerance.enable does not combine with fp16 loss scaling "
                            "(a discarded step would still move the scale): use "
                            "train.precision = 'bf16' or 'fp32'")
    per_step = cfg.train.micro_batch_size * dims.dp * ft.group_size
    if cfg.train.global_batch_size % per_step:
        raise ParallelError(
            f"train.global_batch_size={cfg.train.global_batch_size} does not split over "
            f"fault_tolerance.group_size={ft.group_size} replica groups of micro-batches of "
            f"{cfg.train.micro_batch_size}; use a multiple of {per_step}")
    if not (ft.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")):
        raise ParallelError("fault_tolerance.enable needs the torchft Lighthouse's address: "
                            "set fault_tolerance.lighthouse (e.g. http://host:29510) or "
                            "TORCHFT_LIGHTHOUSE (start one with `torchft_lighthouse "
                            "--min_replicas N`)")
    problem = None if ft.lighthouse else lighthouse_problem(os.environ["TORCHFT_LIGHTHOUSE"])
    if problem:
        raise ParallelError(f"TORCHFT_LIGHTHOUSE {problem}")


def quiet_torchft() -> None:
    """Keep torchft's routine chatter out of the run's output (before torchft is imported):
    its Rust side logs every quorum and commit at INFO, about six lines a step (RUST_LOG=info
    brings them back); with a CPU-only torch 2.13 its Manager warns at every new quorum that it
    cannot reset NCCL's flight recorder (CPU builds have none), and receiving a peer's state
    warns that torch.frombuffer was given a read-only buffer (the tensors are copied into
    the model and optimizer at once). Its errors and other warnings still show."""
    os.environ.setdefault("RUST_LOG", "warn")
    logging.getLogger("torchft.manager").addFilter(
        lambda record: "flight recorder" not in record.getMessage())
    warnings.filterwarnings("ignore", message="The given buffer is not writable",
                            category=UserWarning)


def weights_only_transport(timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport (what a recovering group fetches its peer's state
    through), reading what arrives with torch's weights-only unpickler. torchft's own reads
    it with plain pickle (`weights_only=False`, for learning-rate schedulers' state), so any
    process that could answer a group's request could run code in it; tessel's state for a
    peer is tensors, numbers, strings and containers (tessel.train.replicas), which the
    weights-only unpickler reads whole, and anything else is refused."""
    import urllib.request

    from torchft.checkpointing._serialization import _streaming_load
    from torchft.checkpointing.http_transport import HTTPTransport

    class WeightsOnlyHTTPTransport(HTTPTransport):
        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                return _streaming_load(f, weights_only=True)

    return WeightsOnlyHTTPTransport(timeout=timeout, num_chunks=0)


def membered(base: type) -> type:
    """torchft's reconfigurable process group `base`, remembering the replica numbers of the
    groups of each quorum it is configured for (torchft passes them as `global_ranks`, one per
    group, read from the number in each group's `replica_id`): two groups started with one
    `fault_tolerance.replica_id` show as that number twice."""

    class Membered(base):  # type: ignore[misc, valid-type]
        members: list[int] = []

        def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                      quorum_id: int | None = None, group_rank: int | None = None,
                      group_world_size: int | None = None,
                      global_ranks: list[int] | None = None) -> None:
            self.members = list(global_ranks or [])
            super().configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank,
                              group_world_size, global_ranks)

    return Membered


class ReplicaGroup:
    """This process's membership of the replica groups: torchft's Manager, a reconfigurable
    gloo (CPU) or NCCL (CUDA) process group across the groups, and the store it rendezvous
    through. `state_dict` / `load_state_dict` are what a recovering peer receives / what this
    group applies when it recovers (called by torchft, on this thread, at `quorum`).

    A group is admitted once a quorum holds it and no other group with its replica_id; a group
    that finds its number taken in its first quorum (another `tessel train` runs with that
    fault_tolerance.replica_id) is refused in one line. The group already admitted keeps
    training: the step the newcomer joined is discarded when it leaves, as for a failed group."""

    def __init__(self, cfg: FaultToleranceConfig, device: torch.device, step: int,
                 state_dict: Callable[[], dict[str, Any]],
                 load_state_dict: Callable[[dict[str, Any]], None]):
        quiet_torchft()
        from torch.distributed import TCPStore
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        timeout = timedelta(seconds=cfg.timeout_s)
        self._lighthouse = cfg.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
        self._timeout_s, self._min = cfg.timeout_s, cfg.min_replica_size
        self._replica, self._groups = cfg.replica_id, cfg.group_size
        self._admitted = self._closed = False
        host = socket.gethostname()  # what torchft's Manager advertises to its peers too
        # The group's own store (a group is one process, so no torchrun store is there):
        # the cross-group process group of each quorum rendezvous through the first
        # member's store.
        self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        self._pg = membered(ProcessGroupNCCL if device.type == "cuda"
                            else ProcessGroupGloo)(timeout=timeout)
        try:
            self.manager = self._manager(cfg, self._pg, host, timeout, state_dict,
                                         load_state_dict)
        except Exception as exc:  # noqa: BLE001 (torchft's RPC client raises plain errors)
            raise self._failed("cannot reach the Lighthouse", exc) from None
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def _manager(self, cfg: FaultToleranceConfig, pg: Any, host: str, timeout: timedelta,
                 state_dict: Callable[[], dict[str, Any]],
                 load_state_dict: Callable[[dict[str, Any]], None]) -> Any:
        from torchft import Manager

        return Manager(
            pg=pg, load_state_dict=load_state_dict, state_dict=state_dict,
            min_replica_size=cfg.min_replica_size,
            use_async_quorum=False,  # a recovering group applies its peer's state before
            # drawing the step's data, so the trainer's step and data position are the peer's
            timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
            rank=0, world_size=1, store_addr=host, store_port=self._store.port,
            lighthouse_addr=cfg.lighthouse or None, replica_id=f"tessel_{cfg.replica_id}",
            hostname=host, checkpoint_transport=weights_only_transport(timeout),
            init_sync=False)  # every group starts from the same seed or weights

    def quorum(self) -> int:
        """Join this step's quorum (recovering from a peer first when behind); the number
        of replica groups taking part."""
        try:
            self.manager.start_quorum()
        except TesselError:  # from applying a peer's state: says what is wrong already
            raise
        except Exception as exc:  # noqa: BLE001 (torchft's RPC client raises plain errors)
            raise self._failed("no quorum of replica groups", exc) from None
        if not self._admitted and self._pg.members.count(self._replica) > 1:
            raise TesselError(
                f"fault_tolerance: replica group {self._replica} is already running: another "
                f"`tessel train` with fault_tolerance.replica_id={self._replica} joined the "
                f"Lighthouse at {self._lighthouse} (both would train the same share of every "
                f"global batch); give each group its own replica_id, 0 to {self._groups - 1}")
        self._admitted = True
        return self.manager.num_participants()

    def average(self, tensors: list[torch.Tensor]) -> None:
        """Average `tensors` in place over the groups of the quorum, in one collective. A
        failure (a peer died) is recorded by torchft: `commit` then says no."""
        if not tensors:
            return
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        self.manager.allreduce(flat).wait()
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()

    def commit(self) -> bool:
        """Whether every group of the quorum finished this step (then it may be applied)."""
        try:
            return self.manager.should_commit()
        except Exception as exc:  # noqa: BLE001
            raise self._failed("no commit decision", exc) from None

    def close(self) -> None:
        if not self._closed:  # (a refused first quorum closes it before the trainer does)
            self._closed = True
            self.manager.shutdown(wait=False)

    def _failed(self, what: str, exc: Exception) -> CollectiveTimeout:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        return CollectiveTimeout(
            f"fault_tolerance: {what} within fault_tolerance.timeout_s={self._timeout_s}s "
            f"({first}); check that the Lighthouse at {self._lighthouse} runs and that at "
            f"least min_replica_size={self._min} replica groups are up: start the missing "
            "groups (they recover from a peer) or resume this run")
