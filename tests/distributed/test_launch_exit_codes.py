"""`tessel train --nproc N` and `--nnodes` end with the workers' own exit code and at most one
line (docs/exit-codes.md), not torchrun's traceback and exit 1: a worker's documented code, the
codes the workers exited with after a signal, a rendezvous that failed (exit 3)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import write_corpus

from tessel.launch import local
from tessel.launch.torchrun import workers_after_signal

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs/tiny.toml")
# A stand-in worker: says it is ready (a file named after its local rank in argv[1]), then
# exits with argv[2] (local rank 0) or argv[3] (the others) on SIGTERM or SIGINT; with
# argv[4] = "now", local rank 0 exits at once.
WORKER = """\
import os, pathlib, signal, sys, time
rank = os.environ["LOCAL_RANK"]
code = int(sys.argv[2] if rank == "0" else sys.argv[3])
if rank == "0" and sys.argv[4:] == ["now"]:
    sys.exit(code)
for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *a: sys.exit(code))
pathlib.Path(sys.argv[1], rank).touch()
time.sleep(300)
"""


def _torchrun(tmp_path: Path, *codes: str) -> list[str]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    (tmp_path / "ready").mkdir()
    return [sys.executable, "-m", "tessel.launch.torchrun", "--standalone",
            "--nproc-per-node", "2", str(script), str(tmp_path / "ready"), *codes]


def _no_traceback(err: str) -> None:
    assert "Traceback" not in err and "ChildFailedError" not in err, err
    assert "SignalException" not in err and "failed (exitcode" not in err, err
    assert "death signal" not in err and "closing signal" not in err, err


def test_workers_after_signal():
    assert workers_after_signal([0, 0], signal.SIGTERM) == 0
    assert workers_after_signal([0, 143], signal.SIGTERM) == 143
    assert workers_after_signal([-9, 0], signal.SIGTERM) == 137
    assert workers_after_signal([0, None], signal.SIGTERM) == 143  # one never seen to end
    assert workers_after_signal([], signal.SIGINT) == 130  # none had started


@pytest.mark.budget(60)
def test_a_workers_own_code_is_the_launchs_without_a_traceback(tmp_path: Path):
    # local rank 0 stops with 5 (an alert's stop) while the other still runs
    done = subprocess.run(_torchrun(tmp_path, "5", "0", "now"), capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 5, done.stderr
    _no_traceback(done.stderr)


@pytest.mark.budget(60)
@pytest.mark.parametrize("sig, codes, want", [
    (signal.SIGTERM, ("0", "143"), 143),  # one was still preparing the data
    (signal.SIGTERM, ("0", "0"), 0),  # both saved a checkpoint
    (signal.SIGINT, ("130", "130"), 130),
])
def test_a_signal_ends_the_launch_with_the_workers_codes(tmp_path: Path, capfd, sig, codes,
                                                         want: int):
    command = _torchrun(tmp_path, *codes)
    ready = tmp_path / "ready"

    def signal_us_when_ready() -> None:
        deadline = time.monotonic() + 240
        while len(list(ready.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        signal.raise_signal(sig)  # handled by the main thread, inside run_torchrun

    threading.Thread(target=signal_us_when_ready, daemon=True).start()
    assert local.run_torchrun(command) == want
    _no_traceback(capfd.readouterr().err)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tessel", "train", CONFIG, *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def _one_line(done: subprocess.CompletedProcess[str], code: int) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == code and len(lines) == 1, done.stderr
    assert lines[0].startswith("tessel: error: "), lines
    return lines[0]


@pytest.mark.budget(60)
def test_a_rendezvous_the_other_nodes_never_join_is_one_line_and_exit_3(tmp_path: Path):
    endpoint = f"127.0.0.1:{_free_port()}"  # loopback only: this node hosts it, alone
    line = _one_line(_train("--nnodes", "2", "--rdzv-endpoint", endpoint, "--rdzv-timeout",
                            "3", cwd=tmp_path), 3)
    assert f"the rendezvous at {endpoint} did not complete within 3 s" in line
    assert not (tmp_path / "runs").exists()


@pytest.mark.budget(60)
def test_a_rendezvous_port_another_program_holds_is_one_line_and_exit_3(tmp_path: Path):
    with socket.socket() as other:  # listens, never answers
        other.bind(("127.0.0.1", 0))
        other.listen(1)
        endpoint = f"127.0.0.1:{other.getsockname()[1]}"
        line = _one_line(_train("--nnodes", "2", "--rdzv-endpoint", endpoint,
                                "--rdzv-timeout", "3", cwd=tmp_path), 3)
    assert f"cannot reach the rendezvous at {endpoint} (waited up to 3 s" in line
    assert "address already in use" in line


@pytest.mark.budget(120)
def test_a_nan_stop_under_nproc_exits_6_with_the_workers_line(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("TESSEL_FAULT", "nan:batch=2")
    # a small corpus of files, byte tokens: the config's stdlib corpus would first train a
    # tokenizer and tokenize the standard library (minutes on two cores), which this does not test
    corpus = write_corpus(tmp_path / "corpus")
    done = _train("--nproc", "2", "--quiet", "--train.steps=4", f"--run.dir={tmp_path / 'run'}",
                  "--data.source=files", f"--data.paths=['{corpus}']", "--data.tokenizer=bytes",
                  cwd=tmp_path)
    assert done.returncode == 6, done.stderr
    _no_traceback(done.stderr)
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("tessel: error: ") and "training diverged" in last, last


def test_rdzv_timeout_sets_how_long_torchrun_waits_for_the_rendezvous(capsys, monkeypatch):
    from tessel.cli import main

    calls: list[list[str]] = []
    monkeypatch.setattr(local, "run_torchrun", lambda cmd, env=None: calls.append(cmd) or 0)
    assert main(["train", CONFIG, "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29511",
                 "--rdzv-timeout", "7"]) == 0
    cmd, = calls
    assert cmd[1:3] == ["-m", "tessel.launch.torchrun"]  # the workers' exit codes, one line
    conf = dict(kv.split("=") for kv in cmd[cmd.index("--rdzv-conf") + 1].split(","))
    assert conf["read_timeout"] == conf["join_timeout"] == "7"
    assert main(["train", CONFIG, "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29511",
                 "--rdzv-timeout", "0"]) == 2
    assert "--rdzv-timeout needs whole seconds >= 1" in capsys.readouterr().err
