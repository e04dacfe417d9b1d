"""A fire drill (TESSEL_FAULT) the run cannot carry out is bad input like any other: one line,
exit 2, no run directory, and the same command trains once the drill is fixed."""

from __future__ import annotations

import pytest
from test_cli import assert_one_line_error, tessel_here, train_args


@pytest.mark.parametrize(("fault", "needle"), [
    ("slow:seconds=-1", "seconds must be a number above 0"),  # time.sleep(-1) inside the loop
    ("netdelay:seconds=inf", "seconds must be a number above 0"),  # inside every collective
    ("kill:step=2:rank=1", "names rank 1, but the run has 1 process"),  # never fires
])
def test_a_bad_fire_drill_is_refused_before_the_run_directory_exists(
        tmp_path, corpus, monkeypatch, fault, needle):
    run = tmp_path / "run"
    args = train_args(run, corpus, "--train.steps=2", "--checkpoint.interval=0")
    monkeypatch.setenv("TESSEL_FAULT", fault)
    assert_one_line_error(tessel_here(*args), needle)
    assert not run.exists()
    monkeypatch.setenv("TESSEL_FAULT", "slow:seconds=0.01")  # fixed: the same command trains
    out = tessel_here(*args)
    assert out.returncode == 0, out.stderr
    assert "step 2/2 | loss" in out.stdout


def test_nproc_refuses_a_rank_the_job_does_not_have_before_torchrun(tmp_path, corpus, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv("TESSEL_FAULT", "netdelay:seconds=0.05:rank=5")
    out = tessel_here(*train_args(run, corpus, "--nproc", "2", "--train.steps=2"))
    assert_one_line_error(out, "names rank 5, but the run has 2 processes (ranks 0 to 1)")
    assert not run.exists()
