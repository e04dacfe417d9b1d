"""`tessel scale --measure` inside a SLURM allocation of several nodes: which allocation this
is, how many nodes each point spreads over, and the srun command of a point. (Run for real on
a two-node SLURM: tests/integration/test_slurm.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tessel.errors import TesselError
from tessel.scaling import allocation
from tessel.scaling.allocation import Allocation


@pytest.mark.parametrize(("nproc", "nodes", "spread"), [
    (1, 4, 1), (2, 4, 2), (4, 4, 4), (8, 4, 4), (6, 4, 3), (3, 2, 1), (5, 4, 1), (4, 1, 1)])
def test_a_point_spreads_over_the_most_nodes_that_share_it_equally(nproc, nodes, spread):
    assert allocation.nodes_for(nproc, nodes) == spread


def test_a_point_runs_one_node_launcher_per_node_meeting_at_the_first():
    alloc = Allocation("1234", ("n0", "n1", "n2"))
    args = ["cfg.toml", "--quiet", "--run.dir=x y"]
    cmd = allocation.command_for(alloc, python="/venv/bin/python")(4, args)
    cut = cmd.index("/venv/bin/python")
    assert cmd[:cut] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1",
                         "--nodelist=n0,n1", "--kill-on-bad-exit=1", "--cpus-per-task=2"]
    port = cmd[cmd.index("--master-port") + 1]
    assert cmd[cut:] == ["/venv/bin/python", "-m", "tessel.launch.node", "--nproc-per-node",
                         "2", "--nnodes", "2", "--master-addr", "n0", "--master-port", port,
                         "--", *args]
    # every point of a sweep, and every job, its own rendezvous port
    ports = {allocation.command_for(Allocation(j, alloc.hosts))(n, args)[-len(args) - 2]
             for j in ("1234", "1235") for n in (1, 2, 3, 4)}
    assert len(ports) == 8 and all(20000 <= int(p) < 60000 for p in ports)
    gpu = allocation.command_for(alloc, gpus=True)(6, args)
    assert "--nodes=3" in gpu and "--gpus-per-node=2" in gpu
    assert gpu[gpu.index("--master-addr") + 1] == "n0"
    assert allocation.command_for(alloc)(1, args)[1:5] == [
        "--nodes=1", "--ntasks=1", "--ntasks-per-node=1", "--nodelist=n0"]


def _scontrol(tmp_path: Path, monkeypatch, body: str) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\n" + body)
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_the_allocation_is_read_from_slurms_environment(tmp_path: Path, monkeypatch):
    _scontrol(tmp_path, monkeypatch, '[ "$*" = "show hostnames n[0-1]" ] && echo n0 && echo n1\n')
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n[0-1]", "SLURM_JOB_NUM_NODES": "2"}
    assert allocation.current(env) == Allocation("77", ("n0", "n1"))
    # no job, or a job of one node: the sweep runs on this machine
    assert allocation.current({}) is None
    assert allocation.current({**env, "SLURM_JOB_NUM_NODES": "1"}) is None


def test_an_allocation_whose_hosts_cannot_be_listed_is_one_line(tmp_path: Path, monkeypatch):
    _scontrol(tmp_path, monkeypatch, "echo 'scontrol: error: bad list' >&2; exit 1\n")
    with pytest.raises(TesselError, match=r"^inside SLURM job 5, `scontrol show hostnames n\[0-1\]` "
                                          "failed: scontrol: error: bad list$"):
        allocation.current({"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n[0-1]"})
