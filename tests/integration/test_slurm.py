"""`tessel launch slurm` against a real SLURM: Debian's slurm-wlm and munge, a one-node
cluster (slurmctld + slurmd as children of this test, in a temporary directory, stopped at
the end).

The scripts are submitted exactly as `tessel launch slurm` prints them. Each scenario's losses
are compared with a local `tessel train --nproc 2` of the same config: the job completes
unedited; preemption by a higher-priority partition (SIGTERM, a grace time, requeue), a
SIGTERM to the job's steps, a SIGTERM to every process of the job (`scancel --signal=TERM
--full`) and the time limit's warning each make the job save, requeue itself and finish with
bit-identical losses; two jobs on one node both finish.

The packages are installed when missing and this process may (root, apt-get); elsewhere the
module is skipped with the reason, except under CI=true, where it fails.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import write_corpus

from tessel.config import read_saved
from tessel.observe.metrics import read_metrics

pytestmark = pytest.mark.slurm

STEPS = 400
# Jobs that must be stopped while they train run each step 0.1 s late (TESSEL_FAULT, which
# leaves the losses unchanged), so that a signal, or the time limit's warning (sent 5-35 s
# into a one-minute job by this SLURM), lands mid-run.
SLOW = {"TESSEL_FAULT": "slow:seconds=0.1"}
SIGNALLED = {"TESSEL_FAULT": "slow:seconds=0.05"}  # signalled after 20 steps: less is enough
GRACE = 60  # seconds between a preemption's SIGTERM and its SIGKILL
CONFIG = f"""
[model]
preset = "tiny"
[data]
source = "files"
paths = ["corpus"]
tokenizer = "bytes"
split = "90,10"
[train]
steps = {STEPS}
seq_len = 32
micro_batch_size = 4
global_batch_size = 8
eval_interval = 0
[optim]
lr = 3e-3
warmup_steps = 2
[checkpoint]
interval = 0
[metrics]
log_interval = 1
tensorboard = false
[run]
dir = "run"
sample_tokens = 0
"""


def _unavailable(why: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"a real SLURM is needed under CI=true: {why}")
    pytest.skip(why)


def _install() -> None:
    if shutil.which("slurmctld") and shutil.which("munged"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        _unavailable("slurm-wlm and munge are not installed (apt-get install slurm-wlm munge)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"],
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", "slurm-wlm",
                 "munge"]):
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            _unavailable(f"{' '.join(cmd)} failed: {out.stderr.strip()[-300:]}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """A one-node SLURM in `root`; `run(...)` runs its client commands."""

    def __init__(self, root: Path):
        self.root = root
        self.host = socket.gethostname()
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        for d in ("state", "spool"):
            (root / d).mkdir()
        cpus = os.cpu_count() or 2
        self.conf.write_text("\n".join([
            # addresses given: the machine's name need not resolve (containers, CI)
            "ClusterName=tessel-test", f"SlurmctldHost={self.host}(127.0.0.1)",
            "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge",
            f"StateSaveLocation={root / 'state'}", f"SlurmdSpoolDir={root / 'spool'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}", f"SlurmdPidFile={root / 'slurmd.pid'}",
            f"SlurmctldLogFile={root / 'slurmctld.log'}", f"SlurmdLogFile={root / 'slurmd.log'}",
            f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
            # process tracking and CPU binding as on a typical cluster without cgroups
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/affinity",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "MpiDefault=none",
            "ReturnToService=2", "SchedulerType=sched/backfill", "JobRequeue=1",
            "KillWait=30",
            "MinJobAge=600", "InactiveLimit=0",
            # The backfill scheduler, which preempts, runs every 2 s (not every 30 s).
            "SchedulerParameters=bf_interval=2",
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
            # Preemption as clusters with scavenger queues set it up: a job in `urgent`
            # preempts `batch` jobs, which get SIGTERM, GRACE seconds, then are requeued.
            "PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE",
            f"PartitionName=batch Nodes={self.host} Default=YES MaxTime=INFINITE State=UP "
            f"PriorityTier=1 PreemptMode=REQUEUE GraceTime={GRACE}",
            f"PartitionName=urgent Nodes={self.host} MaxTime=INFINITE State=UP PriorityTier=10 "
            "PreemptMode=OFF",
        ]) + "\n")
        if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode != 0:
            Path("/run/munge").mkdir(parents=True, exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            # --force: a log file left by another munged (e.g. one started as root) is only
            # a warning then; --syslog: nothing to own in /var/log
            out = subprocess.run(["runuser", "-u", "munge", "--", "munged", "--force",
                                  "--syslog"], capture_output=True, text=True)
            if out.returncode != 0:
                _unavailable(f"munged did not start: {out.stderr.strip()[-300:]}")
        self.daemons = [
            subprocess.Popen(["slurmctld", "-D", "-f", str(self.conf)], env=self.env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
            subprocess.Popen(["slurmd", "-D", "-f", str(self.conf)], env=self.env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
        ]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = self.run("sinfo", "-h", "-o", "%T", check=False)
            if out.returncode == 0 and out.stdout.strip() in ("idle", "idle\nidle"):
                return
            time.sleep(0.5)
        raise RuntimeError(f"SLURM did not come up: {(root / 'slurmctld.log').read_text()[-2000:]}")

    def run(self, *cmd: str, check: bool = True, cwd: Path | None = None
            ) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(cmd, env=self.env, capture_output=True, text=True, cwd=cwd,
                             timeout=60)
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

    def wait(self, job_id: str, until, timeout: float = 240, what: str = "") -> dict[str, str]:
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


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    _install()
    c = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield c
    finally:
        c.stop()


def _workdir(tmp_path_factory, name: str) -> Path:
    d = tmp_path_factory.mktemp(name)
    write_corpus(d / "corpus", n_docs=8, words_per_doc=300)
    (d / "cfg.toml").write_text(CONFIG)
    return d


def _losses(run: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(run / "metrics.jsonl") if "loss" in m}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The same config trained locally by `tessel train --nproc 2`."""
    d = _workdir(tmp_path_factory, "reference")
    out = subprocess.run([sys.executable, "-m", "tessel", "train", "cfg.toml", "--nproc", "2",
                          "--quiet"], cwd=d, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    losses = _losses(d / "run")
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def _submit(cluster: Cluster, d: Path, *launch_args: str, sbatch: tuple[str, ...] = (),
            env: dict[str, str] | None = None) -> str:
    """`tessel launch slurm` into job.sbatch (as the README shows), then `sbatch job.sbatch`
    (which passes this environment, and `env`, to the job)."""
    script = subprocess.run(
        [sys.executable, "-m", "tessel", "launch", "slurm", "cfg.toml", "--nodes", "1",
         "--gpus-per-node", "0", "--nproc-per-node", "2", *launch_args],
        cwd=d, capture_output=True, text=True, check=True).stdout
    (d / "job.sbatch").write_text(script)
    out = subprocess.run(["sbatch", "--parsable", *sbatch, "job.sbatch"], cwd=d,
                         env={**cluster.env, **(env or {})}, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _steps_logged(d: Path) -> int:
    path = d / "run" / "metrics.jsonl"
    return len(read_metrics(path)) if path.is_file() else 0


def _finished(cluster: Cluster, job_id: str, d: Path) -> dict[str, str]:
    info = cluster.wait(job_id, lambda j: j["JobState"] in ("COMPLETED", "FAILED", "CANCELLED"),
                        what="finished")
    log = "\n".join(p.read_text() for p in (d / "logs").glob("*.out"))
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-3000:]
    return info


@pytest.mark.budget(90)  # seconds on the reference machine: measured, +~40%
def test_the_generated_script_completes_unedited_with_the_local_losses(cluster, reference,
                                                                       tmp_path_factory):
    d = _workdir(tmp_path_factory, "plain")
    job = _submit(cluster, d)
    info = _finished(cluster, job, d)
    assert info["Restarts"] == "0"
    assert _losses(d / "run") == reference


@pytest.mark.budget(90)  # seconds on the reference machine: measured, +~40%
@pytest.mark.parametrize("how", ["--signal=TERM", "--signal=TERM --full"])
def test_a_signalled_job_saves_requeues_itself_and_resumes_exactly(cluster, reference,
                                                                   tmp_path_factory, how):
    """`scancel --signal=TERM JOB` reaches the job's steps only; `--full` reaches every
    process of the job, srun included."""
    d = _workdir(tmp_path_factory, "full" if "full" in how else "steps")
    job = _submit(cluster, d, env=SIGNALLED)
    cluster.wait(job, lambda j: _steps_logged(d) >= 20, what="trained 20 steps")
    cluster.run("scancel", *how.split(), job)
    cluster.wait(job, lambda j: j["Restarts"] != "0", what="requeued")
    stopped_at = _steps_logged(d)
    _finished(cluster, job, d)
    assert _losses(d / "run") == reference
    # checkpoint.interval = 0: only the stop itself saved, so resuming from it lost nothing
    assert 20 <= stopped_at < STEPS


@pytest.mark.budget(120)  # seconds on the reference machine: measured, +~40%
def test_preemption_by_a_higher_priority_partition_requeues_and_resumes_exactly(
        cluster, reference, tmp_path_factory):
    """Real preemption (partition_prio, PreemptMode=REQUEUE, a grace time): a job submitted
    to the `urgent` partition needs every CPU the training job holds; SLURM sends the job
    SIGTERM, tessel saves and exits, the job is requeued and, once the urgent job is done,
    resumes with bit-identical losses."""
    d = _workdir(tmp_path_factory, "preempted")
    job = _submit(cluster, d, env=SLOW)
    cluster.wait(job, lambda j: _steps_logged(d) >= 20, what="trained 20 steps")
    urgent = cluster.run("sbatch", "--parsable", "--partition=urgent",
                         f"--ntasks={os.cpu_count() or 2}", f"--output={d / 'urgent.out'}",
                         "--wrap", "sleep 2", cwd=d).stdout.strip()
    cluster.wait(job, lambda j: j["Restarts"] != "0", what="preempted and requeued")
    stopped_at = _steps_logged(d)
    done = cluster.wait(urgent, lambda j: j["JobState"] == "COMPLETED", what="ran (urgent)")
    info = _finished(cluster, job, d)
    assert _losses(d / "run") == reference
    # The urgent job needed every CPU the training job held: it ran in the middle of it.
    assert done["EndTime"] < info["EndTime"]
    log = "\n".join(p.read_text() for p in (d / "logs").glob("*.out"))
    assert log.count("stopped by the scheduler's signal after saving a checkpoint") == 1
    assert 20 <= stopped_at < STEPS  # checkpoint.interval = 0: the stop itself saved


@pytest.mark.budget(120)  # seconds on the reference machine: measured, +~40%
def test_the_time_limit_saves_and_requeues_until_done(cluster, reference, tmp_path_factory):
    d = _workdir(tmp_path_factory, "timelimit")
    # a one-minute limit with the warning 55 s before it: SIGTERM 5-35 s into every
    # attempt (SLURM checks time limits periodically), each attempt trains a little
    job = _submit(cluster, d, "--time", "00:01:00", "--signal-grace", "55", env=SLOW)
    info = _finished(cluster, job, d)
    assert int(info["Restarts"]) >= 1
    assert _losses(d / "run") == reference


@pytest.mark.budget(45)  # seconds on the reference machine: measured, +~40%
def test_two_jobs_on_one_node_both_finish(cluster, reference, tmp_path_factory):
    dirs = [_workdir(tmp_path_factory, f"pair{i}") for i in range(2)]
    # The jobs of the tests before (still completing, or requeued) may hold CPUs: start from
    # an empty queue, so that only SLURM or the script could keep the two apart.
    deadline = time.monotonic() + 120
    while cluster.run("squeue", "-h", check=False).stdout.strip() and time.monotonic() < deadline:
        time.sleep(0.5)
    jobs = [_submit(cluster, d, "--nproc-per-node", "1") for d in dirs]
    both = lambda _j: all(cluster.job(j)["JobState"] == "RUNNING" for j in jobs)  # noqa: E731
    cluster.wait(jobs[0], both, what=f"ran beside job {jobs[1]}")  # the same node, at once
    for job, d in zip(jobs, dirs):
        _finished(cluster, job, d)
        assert sorted(_losses(d / "run")) == list(range(1, STEPS + 1))


def test_hostile_paths_and_values_reach_the_job_intact(cluster, tmp_path_factory):
    """The script `tessel launch slurm` writes for a config, a log directory, an interpreter
    and overrides full of shell syntax, quotes, '#', '%' and spaces runs unedited under the
    real sbatch: the log lands in its directory (sbatch's own quoting of #SBATCH lines), the
    run in its, every value arrives as it was given, and nothing hidden in them runs."""
    d = _workdir(tmp_path_factory, "hostile")
    nasty = "q'\"$(touch F) `touch F`; touch F && $HOME * ?[x] # %j %% ~ {a,b} é"
    (d / nasty).mkdir()
    shutil.copy(d / "cfg.toml", d / nasty / "cfg.toml")
    python = d / f"venv {nasty}" / "python"  # this interpreter, under a hostile path
    python.parent.mkdir()
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    log_dir = f"logs {nasty}"
    script = subprocess.run(
        [sys.executable, "-m", "tessel", "launch", "slurm", f"{nasty}/cfg.toml", "--nodes", "1",
         "--gpus-per-node", "0", "--nproc-per-node", "2", "--python", str(python),
         "--output-dir", log_dir, "--train.steps=10", f"--run.dir=run {nasty}",
         "--run.sample_prompt", nasty],
        cwd=d, capture_output=True, text=True, check=True).stdout
    (d / "job.sbatch").write_text(script)
    job = cluster.run("sbatch", "--parsable", "job.sbatch", cwd=d).stdout.strip()
    info = cluster.wait(job, lambda j: j["JobState"] in ("COMPLETED", "FAILED", "CANCELLED"),
                        what="finished")
    log = d / log_dir / f"tessel-cfg-{job}.out"  # the directory's '%' is not a pattern
    assert info["JobState"] == "COMPLETED", log.read_text()[-3000:] if log.is_file() else info
    run = d / f"run {nasty}"
    assert sorted(_losses(run)) == list(range(1, 11))
    assert read_saved(run / "config.toml")["run"]["sample_prompt"] == nasty
    assert not list(d.rglob("F")), "the job ran a command hidden in a value"
