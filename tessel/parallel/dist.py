"""Process-group start-up and shutdown for runs launched by torchrun.

A run is distributed when torchrun's WORLD_SIZE is above 1; otherwise no process group is
created at all and the single-process path stays free of collectives.
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ProcessInfo:
    world_size: int
    rank: int
    local_rank: int

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """The rank that prints and writes metrics and run-level files."""
        return self.rank == 0


def process_info() -> ProcessInfo:
    """This process's place in the job, from torchrun's environment."""
    return ProcessInfo(
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        rank=int(os.environ.get("RANK", "0")),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )


# Whether this process ever started a process group (exit_process must then skip
# interpreter finalization even after the group was destroyed).
_GROUP_STARTED: list[bool] = []


def init_distributed(info: ProcessInfo, device: torch.device, timeout_s: int) -> torch.device:
    """Start the process group (NCCL on CUDA, gloo on CPU) and return this rank's device.

    `timeout_s` bounds every collective: a rank that waits longer (a peer died or hangs)
    fails instead of hanging the job forever.
    """
    if device.type == "cuda":
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"  # gloo for CPU tensors (async checkpoint staging)
    else:
        backend = "gloo"
    if not dist.is_initialized():
        _GROUP_STARTED.append(True)
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend=backend, timeout=timeout, device_id=device if device.type == "cuda" else None,
            **_attempt_store(info, timeout),
        )
    return device


def _attempt_store(info: ProcessInfo, timeout: datetime.timedelta) -> dict:
    """Under torchrun, a store namespace of this attempt's own.

    torchrun restarts workers (--max-restarts) against the same agent store, where the dead
    attempt's keys remain: gloo's rendezvous could read a dead worker's address ("Gloo
    connectFullMesh failed ... Connection refused", seen in about 1 of 4 restarts here).
    Prefixing every key with the restart count keeps the attempts apart. Without the agent
    store (multi-node runs: tessel.launch.rendezvous.SEPARATE_STORE_ENV) rank 0 of every
    attempt starts a store of its own, so there is nothing to keep apart, and the restart count
    must not be used: it is each node's own, and a node that joins a running elastic job starts
    at 0 while the others are at 1 or more (their workers would never meet).
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "MASTER_ADDR" not in os.environ:
        return {}
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), info.world_size,
        is_master=not agent_store and info.rank == 0, timeout=timeout,
        multi_tenant=not agent_store,
    )
    prefix = f"tessel/attempt-{attempt}" if agent_store else "tessel"
    return {"store": dist.PrefixStore(prefix, store),
            "rank": info.rank, "world_size": info.world_size}


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End this process with `code`, through `os._exit` once its output is flushed: the
    interpreter's last step, the teardown of every module and the objects they hold, is
    skipped. What comes before it depends on whether the process started a process group.

    With one (destroyed since or not), the group is destroyed and nothing else runs. Why:
    gloo's worker threads belong to C++ process-group objects that Python may still reference
    (meshes, FSDP and pipeline state) when the interpreter shuts down; destroying them during
    finalization sometimes aborts the process ("terminate called without an active
    exception", SIGABRT) after training succeeded, which torchrun then reports as a failed job
    (and, with --max-restarts, restarts).

    Without one, what a plain exit does first still happens, in the interpreter's order: the
    non-daemon threads are waited for and every exit handler runs (logging's flush, temporary
    directories' clean-up, a coverage tool's save). Why skip the teardown: it cost 0.5-1 s of
    CPU per command once torch is loaded (`import tessel.train.trainer`, then a plain exit:
    3.0-3.3 s of CPU, against 2.1-2.2 s without the teardown) and shared the CPU with any
    daemon thread still working in native code (the BPE training a signal abandoned, see
    `tessel.data.tokenizer`: 1 s from Ctrl-C to the exit on an idle 2-core machine, 4 s on a
    loaded one, against 0.04 s and 0.14 s without it).

    Either way, everything tessel writes is complete and fsynced before this point, so the
    skipped teardown loses nothing.
    """
    if dist.is_initialized() or _GROUP_STARTED:
        shutdown()
    else:
        import atexit
        import threading

        # What the interpreter's finalization calls first, in this order: private names, but
        # its own entry points, the same in every Python 3 tessel supports.
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said anyway
            pass
    os._exit(code)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over every rank (no-op in a single process)."""
    if dist.is_initialized():
        dist.all_reduce(t)
    return t


def broadcast_from_main(t: torch.Tensor) -> torch.Tensor:
    """Rank 0's `t` on every rank, in place (no-op in a single process)."""
    if dist.is_initialized():
        dist.broadcast(t, src=0)
    return t
