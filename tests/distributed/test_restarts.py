"""Resilience under torchrun (2 gloo processes on CPU): a SIGKILLed rank restarts and
resumes without a human; the watchdog names a hung rank and dumps every rank's stacks.

Faults are injected with TESSEL_FAULT (tessel/train/faults.py), the same hooks a fire drill
on a real cluster uses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_layouts import assert_same_run, base, job_output

from tessel.observe.events import read_events
from tessel.observe.metrics import read_metrics

pytestmark = pytest.mark.slow


def _torchrun(run: Path, corpus: Path, fault: str, *torchrun_args: str, timeout: float = 600,
              **extra) -> subprocess.CompletedProcess:
    overrides = base(run, corpus, **extra)
    args = [f"--{k}={json.dumps(v)}" for k, v in overrides.items()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CI": "true", "TESSEL_FAULT": fault}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         *torchrun_args, "-m", "tessel", "train", "--auto-resume", *args],
        capture_output=True, text=True, timeout=timeout, env=env,
    )


@pytest.mark.budget(40)  # seconds on the reference machine: measured, +~40%
def test_a_killed_rank_restarts_the_job_which_resumes_to_the_same_losses(refs, tmp_path: Path):
    run = tmp_path / "killed"
    # Rank 1 is SIGKILLed as step 3 starts (after the step-2 checkpoint). torchrun sees the
    # dead worker, stops the other, starts both again; --auto-resume continues from step 2.
    proc = _torchrun(run, refs["corpus"], "kill:rank=1:step=3", "--max-restarts=1",
                     **{"parallel.zero": 2})
    assert proc.returncode == 0, job_output(proc)
    # The surviving rank of the first attempt sees its peer's connection reset: one line
    # (exit 3), not a traceback.
    assert "Traceback" not in proc.stderr, job_output(proc)
    kinds = [(e["kind"], e["step"]) for e in read_events(run)]
    assert kinds[0] == ("start", 0) and ("restart", 2) in kinds and kinds[-1][0] == "finish"
    restart = next(e for e in read_events(run) if e["kind"] == "restart")
    assert "torchrun restart 1" in restart["message"]
    logged = [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert logged == [1, 2, 3, 4, 5, 6]
    assert_same_run(run, refs["llama"])


@pytest.mark.budget(40)  # seconds on the reference machine: measured, +~40%
def test_the_watchdog_names_the_hung_rank_and_dumps_every_ranks_stacks(refs, tmp_path: Path):
    run = tmp_path / "hung"
    # Rank 1 stops responding as step 3 starts; rank 0 waits for it in the step boundary's
    # all-reduce. The collective timeout is far away: the watchdog must see it first.
    proc = _torchrun(run, refs["corpus"], "hang:rank=1:step=3", timeout=300,
                     **{"watchdog.timeout_s": 5, "parallel.timeout_s": 120})
    assert proc.returncode != 0
    err = proc.stderr
    assert "watchdog: no progress for" in err, job_output(proc)
    line = next(ln for ln in err.splitlines() if "watchdog: no progress" in ln)
    assert "stuck: rank 1 (step 3, in step boundary)" in line
    assert "waiting for it in a collective: rank(s) 0 (collective: all-reduce of the stop flags" in line
    # No traceback of ours (torchrun itself prints one for any failed worker, afterwards).
    assert "Traceback" not in err.split("watchdog: no progress")[0]
    stacks = {r: (run / "watchdog" / f"rank{r}.txt").read_text() for r in (0, 1)}
    assert "faults.py" in stacks[1] and "at_step" in stacks[1]  # where rank 1 hangs
    assert "in should_stop" in stacks[0]  # where rank 0 waits (StopControl.should_stop)
    assert all("tessel-watchdog" in s or "Thread" in s for s in stacks.values())
    assert [e["kind"] for e in read_events(run)][-1] == "watchdog"
