"""A real SLURM for the tests: Debian's slurm-wlm and munge, a cluster of `n` nodes on this
machine, each node a Linux network namespace (tests/netns.py) with its own address, host name
and /etc/hosts (its own UTS and mount namespaces), running its own slurmd; slurmctld runs on
the first node. Every daemon is a child of the test, its files in a temporary directory.

    with slurm_cluster(root, 2) as cluster:   # nodes "tnode0" (10.231.0.1), "tnode1"
        cluster.run("sbatch", "--parsable", "job.sbatch", cwd=d)

Client commands (`run`) are run in the first node's network namespace, where the controller's
address is. The packages are installed when missing and this process may (root, apt-get);
elsewhere the test is skipped in one line, except under CI=true, where it fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import system_packages
from netns import Node, nodes

GRACE = 60
"""Seconds between a preemption's SIGTERM and its SIGKILL (the `batch` partition's GraceTime)."""
CPUS = 2
"""CPUs each node offers (the nodes share this machine's cores)."""


def unavailable(why: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"a real SLURM is needed under CI=true: {why}", pytrace=False)
    pytest.skip(why)


def install() -> None:
    """slurm-wlm and munge, installed when missing (root with apt-get: tests/system_packages.py),
    else a skip."""
    why = system_packages.ensure("slurm-wlm", "munge")
    if why:
        unavailable(why)


def _munge_answers() -> bool:
    """Whether a munged answers on its socket (not `pgrep munged`: in a container whose first
    process reaps no orphans, a munged that died stays a zombie that pgrep still finds, and
    SLURM's daemons then time out on every message)."""
    return subprocess.run(["munge", "-n"], stdin=subprocess.DEVNULL, capture_output=True,
                          timeout=30).returncode == 0


def _start_munge() -> None:
    if _munge_answers():
        return
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    # --force: a log file left by another munged (e.g. one started as root) is only a warning
    # then; --syslog: nothing to own in /var/log. Its socket is a file: every namespace sees it.
    out = subprocess.run(["runuser", "-u", "munge", "--", "munged", "--force", "--syslog"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        unavailable(f"munged did not start: {out.stderr.strip()[-300:]}")
    deadline = time.monotonic() + 10
    while not _munge_answers():
        if time.monotonic() > deadline:
            unavailable("munged started but does not answer on /run/munge/munge.socket.2")
        time.sleep(0.2)


class Cluster:
    """A SLURM whose nodes are `hosts` (namespace, host name); `run(...)` runs its clients."""

    def __init__(self, root: Path, hosts: list[tuple[Node, str]]):
        self.root = root
        self.hosts = hosts
        self.names = [name for _, name in hosts]
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        (root / "state").mkdir()
        for name in self.names:
            (root / f"spool-{name}").mkdir()
        # every node resolves every node's name, as on a cluster (the job script's rendezvous
        # host, and gloo, which binds to the address its host name resolves to)
        (root / "hosts").write_text("127.0.0.1 localhost\n" + "".join(
            f"{node.addr} {name}\n" for node, name in hosts))
        head, every = hosts[0], ",".join(self.names)
        self.conf.write_text("\n".join([
            "ClusterName=tessel-test", f"SlurmctldHost={head[1]}({head[0].addr})",
            "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge",
            f"StateSaveLocation={root / 'state'}", f"SlurmdSpoolDir={root}/spool-%n",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}", f"SlurmdPidFile={root}/slurmd-%n.pid",
            f"SlurmctldLogFile={root / 'slurmctld.log'}", f"SlurmdLogFile={root}/slurmd-%n.log",
            # each daemon has a network stack of its own: the standard ports are free there
            "SlurmctldPort=6817", "SlurmdPort=6818",
            # process tracking and CPU binding as on a typical cluster without cgroups
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/affinity",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "MpiDefault=none",
            "ReturnToService=2", "SchedulerType=sched/backfill", "JobRequeue=1",
            "KillWait=30", "MinJobAge=600", "InactiveLimit=0",
            # The backfill scheduler, which preempts, runs every 2 s (not every 30 s).
            "SchedulerParameters=bf_interval=2",
            *[f"NodeName={name} NodeAddr={node.addr} CPUs={CPUS} State=UNKNOWN"
              for node, name in hosts],
            # Preemption as clusters with scavenger queues set it up: a job in `urgent`
            # preempts `batch` jobs, which get SIGTERM, GRACE seconds, then are requeued.
            "PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE",
            f"PartitionName=batch Nodes={every} Default=YES MaxTime=INFINITE State=UP "
            f"PriorityTier=1 PreemptMode=REQUEUE GraceTime={GRACE}",
            f"PartitionName=urgent Nodes={every} MaxTime=INFINITE State=UP PriorityTier=10 "
            "PreemptMode=OFF",
        ]) + "\n")
        _start_munge()
        self.daemons = [subprocess.Popen(self._on(0, ["slurmctld", "-D", "-f", str(self.conf)]),
                                         env=self.env, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL)]
        self.daemons += [subprocess.Popen(self._on(i, ["slurmd", "-D", "-f", str(self.conf)]),
                                          env=self.env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL)
                         for i in range(len(hosts))]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = self.run("sinfo", "-h", "-N", "-o", "%T", check=False)
            states = out.stdout.split()
            if out.returncode == 0 and states and all(s == "idle" for s in states) \
                    and len(states) == 2 * len(hosts):  # each node in both partitions
                return
            time.sleep(0.5)
        logs = [(root / "slurmctld.log"), *(root / f"slurmd-{n}.log" for n in self.names)]
        raise RuntimeError("SLURM did not come up: " + " | ".join(
            p.read_text()[-1000:] for p in logs if p.is_file()))

    def _on(self, i: int, cmd: list[str]) -> list[str]:
        """`cmd` on node i: its network namespace (nsenter, not `ip netns exec`, which mounts
        a /sys of its own without the cgroup file systems slurmd looks for), its host name and
        its /etc/hosts."""
        node, name = self.hosts[i]
        inner = f'hostname {name} && mount --bind {self.root / "hosts"} /etc/hosts && exec "$@"'
        return ["nsenter", f"--net=/run/netns/{node.name}", "unshare", "--uts", "--mount",
                "sh", "-c", inner, "sh", *cmd]

    def run(self, *cmd: str, check: bool = True, cwd: Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """A client command (sbatch, scontrol, ...) on the first node; `env` adds to ours."""
        out = subprocess.run(self._on(0, list(cmd)), env={**self.env, **(env or {})},
                             capture_output=True, text=True, cwd=cwd, timeout=60)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip()}")
        return out

    def stop(self) -> None:
        self.run("scancel", "--user=root", check=False)
        for d in self.daemons:
            d.terminate()
        for d in self.daemons:
            try:
                d.wait(timeout=30)
            except subprocess.TimeoutExpired:
                d.kill()

    def job(self, job_id: str) -> dict[str, str]:
        text = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(f.split("=", 1) for f in text.split() if "=" in f)

    def wait(self, job_id: str, until: Callable[[dict[str, str]], bool], timeout: float = 240,
             what: str = "") -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if until(info):
                return info
            if info["JobState"] == "PENDING" and info.get("Reason") == "BeginTime":
                # A requeued job waits 2 minutes before it may start again: not here. But not
                # at once either: slurmd refuses a launch in the same second as the revocation
                # of the killed instance's credential ("Job credential revoked").
                time.sleep(3)
                self.run("scontrol", "update", f"jobid={job_id}", "StartTime=now", check=False)
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} never {what}: {self.job(job_id)}")


@contextlib.contextmanager
def slurm_cluster(root: Path, n: int) -> Iterator[Cluster]:
    """A running `n`-node cluster in `root`, its daemons stopped and namespaces removed on exit."""
    install()
    missing = [cmd for cmd in ("nsenter", "unshare") if shutil.which(cmd) is None]
    if missing:
        unavailable(f"{' and '.join(missing)} (util-linux) not found")
    with nodes(n) as made:
        cluster = Cluster(root, [(node, f"tnode{i}") for i, node in enumerate(made)])
        try:
            yield cluster
        finally:
            cluster.stop()
