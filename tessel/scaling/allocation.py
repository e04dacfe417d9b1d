"""`tessel scale --measure` inside a SLURM allocation of several nodes: each point's processes
are spread over the allocation's nodes, so a sweep measures the cluster's network as well as
its devices.

A point of N processes runs on K nodes, K the largest divisor of N that is at most the
allocation's node count (N/K processes on each): `srun` starts one `python -m
tessel.launch.node` per node (the launcher the `tessel launch slurm` script runs), which
starts that node's processes; they meet at the allocation's first node. The commands are
pure (`command_for`), so that tests can check them without a cluster.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from tessel.errors import TesselError
from tessel.numbers import whole_number
from tessel.scaling.measure import CommandFor


@dataclass(frozen=True)
class Allocation:
    """The SLURM job this process runs in: its id and its nodes' host names, in order."""

    job_id: str
    hosts: tuple[str, ...]


def current(env: Mapping[str, str] | None = None) -> Allocation | None:
    """The allocation of several nodes this process runs inside (`sbatch`, `salloc`), or None
    (no SLURM job, or a job of one node: the sweep runs on this machine as elsewhere)."""
    env = os.environ if env is None else env
    job, nodelist = env.get("SLURM_JOB_ID"), env.get("SLURM_JOB_NODELIST")
    if not job or not nodelist or env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES")) == "1":
        return None
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TesselError(f"inside SLURM job {job}, `scontrol show hostnames` could not run "
                          f"({exc}); put SLURM's commands on PATH") from None
    hosts = tuple(out.stdout.split())
    if out.returncode != 0 or not hosts:
        raise TesselError(f"inside SLURM job {job}, `scontrol show hostnames {nodelist}` "
                          f"failed: {out.stderr.strip() or 'no host names'}")
    return Allocation(job, hosts) if len(hosts) > 1 else None


def nodes_for(nproc: int, nodes: int) -> int:
    """How many nodes a point of `nproc` processes spreads over: the most, at most `nodes`,
    that take an equal share."""
    return max(k for k in range(1, min(nproc, nodes) + 1) if nproc % k == 0)


def command_for(alloc: Allocation, gpus: bool = False, python: str | None = None) -> CommandFor:
    """(N, `tessel train` arguments) -> the srun command that runs them as N processes over
    `nodes_for(N, ...)` of the allocation's nodes. `gpus`: each process takes a GPU of its
    node. The rendezvous port is the job's own and the point's (jobs sharing a node, and the
    points of one sweep, never share one)."""

    def command(nproc: int, train_args: list[str]) -> list[str]:
        k = nodes_for(nproc, len(alloc.hosts))
        per_node = nproc // k
        job = whole_number(alloc.job_id)
        port = 20000 + (job * 64 + nproc) % 40000 if job is not None else 29500 + nproc % 1000
        return ["srun", f"--nodes={k}", f"--ntasks={k}", "--ntasks-per-node=1",
                f"--nodelist={','.join(alloc.hosts[:k])}", "--kill-on-bad-exit=1",
                f"--cpus-per-task={per_node}",  # under CPU binding one core per process
                *([f"--gpus-per-node={per_node}"] if gpus else []),
                python or sys.executable, "-m", "tessel.launch.node",
                "--nproc-per-node", str(per_node), "--nnodes", str(k),
                "--master-addr", alloc.hosts[0], "--master-port", str(port),
                "--", *train_args]

    return command
