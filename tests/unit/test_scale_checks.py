"""`tessel scale` refuses what cannot work before it measures or runs anything (counts this
machine or the batch cannot hold, --over ep on a dense model, an output directory holding an
earlier sweep, output files that cannot be written), prints its results even when the page
cannot be written, and its gloo probe leaves no process behind, whatever ends it."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tessel.cli import main
from tessel.errors import TesselError
from tessel.scaling import compare, gloo
from tessel.scaling import measure as measure_mod

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/tiny.toml")  # global batch 16, dense


def tessel(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def nothing_measured(monkeypatch):
    """Fails the test if the machine's probe or any run starts."""
    monkeypatch.setattr(compare, "machine_profile", lambda *a, **k: pytest.fail("probed"))
    monkeypatch.setattr(measure_mod, "run_logged", lambda *a, **k: pytest.fail("ran"))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)


@pytest.mark.parametrize("args, needle", [
    (["--nproc", "1,1000"], "--nproc 1000: too many processes for this machine"),
    (["--nproc", "1,32", "--over", "tp"], "too many processes for this machine"),
    (["--nproc", "1,8", "--train.global_batch_size=4", "--train.micro_batch_size=4"],
     "splits the global batch of 4 sequences over 8 data-parallel ranks"),
    (["--nproc", "1,2", "--over", "ep"], "--over ep spreads the processes over the experts"),
])
def test_counts_that_cannot_run_are_refused_before_the_probe(tmp_path, nothing_measured,
                                                             monkeypatch, args, needle):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)  # 2 cores
    code, out, err = tessel("scale", TINY, "--measure", *args, "--out", str(tmp_path / "o"))
    assert (code, out) == (2, "")
    [line] = err.strip().splitlines()
    assert line.startswith("tessel: error: ") and needle in line, line
    assert list(tmp_path.iterdir()) == []


def test_an_earlier_sweeps_directory_is_refused_before_the_probe(tmp_path, nothing_measured):
    (tmp_path / "nproc-1").mkdir()
    code, _, err = tessel("scale", TINY, "--measure", "--nproc", "1", "--out", str(tmp_path))
    assert code == 2 and "exists (an earlier sweep's)" in err and len(err.splitlines()) == 1


def test_an_output_directory_that_cannot_be_made_is_refused_before_the_probe(nothing_measured):
    code, _, err = tessel("scale", TINY, "--measure", "--nproc", "1", "--out", "/proc/sweep")
    assert code == 2 and "cannot create the output directory '/proc/sweep'" in err


@pytest.mark.parametrize("flag", ["--html", "--save-hardware"])
def test_an_output_file_in_a_directory_nobody_writes_is_refused_first(tmp_path, monkeypatch,
                                                                      nothing_measured, flag):
    monkeypatch.chdir(tmp_path)
    if flag == "--html":
        argv = ["scale", TINY, "--measure", "--nproc", "1", "--html", "/proc/x.html"]
    else:
        monkeypatch.setattr("tessel.cli.plan.calibrated", lambda *a: pytest.fail("calibrated"))
        argv = ["plan", TINY, "--gpus", "1", "--calibrate", "x.json",
                "--save-hardware", "/proc/hw.toml"]
    code, out, err = tessel(*argv)
    assert (code, out) == (2, "")
    [line] = err.strip().splitlines()
    assert line.startswith(f"tessel: error: {flag} '/proc/") and "cannot write in '/proc'" in line
    assert list(tmp_path.iterdir()) == []


def test_the_results_are_printed_even_when_the_page_cannot_be_written(tmp_path, monkeypatch):
    def disk_full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", str(path.parent / ".x.html.tmp"))

    monkeypatch.setattr("tessel.fileio.write_text_atomic", disk_full)
    page = tmp_path / "x.html"
    code, out, err = tessel("scale", TINY, "--gpus", "1,2", "--html", str(page))
    assert code == 2 and "efficiency" in out.lower()  # the table is there
    [line] = err.strip().splitlines()
    assert line.startswith(f"tessel: error: --html {str(page)!r}: cannot write it (No space")
    assert ".tmp" not in line


def test_the_gloo_probe_leaves_no_process_when_a_start_fails(monkeypatch):
    started: list[subprocess.Popen] = []
    real = subprocess.Popen

    def popen(*args, **kwargs):
        if len(started) == 2:
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        started.append(real(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(gloo.subprocess, "Popen", popen)
    try:
        with pytest.raises(OSError, match="Resource temporarily unavailable"):
            gloo.measure_gloo(3, timeout_s=600)
        # the two that started (waiting for their third peer) were killed and reaped
        assert [p.poll() for p in started] == [-signal.SIGKILL] * 2
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_check_counts_leaves_a_slurm_sweep_to_its_nodes():
    from tessel.config import Config

    cfg = Config.load(TINY, {})
    measure_mod.check_counts(cfg, [1, 16], "dp", strong=True, local=False)
    with pytest.raises(TesselError, match="over 17 data-parallel ranks"):
        measure_mod.check_counts(cfg, [1, 17], "dp", strong=True, local=False)
    measure_mod.check_counts(cfg, [1, 17], "dp", strong=False, local=False)  # weak: batch grows


def test_a_stopped_run_gives_torchrun_time_to_end_its_workers():
    """measure.stop's SIGKILL must come after torchrun's own SIGKILL of its workers, or the
    workers (each in its own session) outlive it."""
    import inspect

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    torchrun_wait = inspect.signature(LocalElasticAgent).parameters["shutdown_timeout"].default
    assert measure_mod.STOP_GRACE_S > torchrun_wait
