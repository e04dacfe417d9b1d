"""`tessel train --nproc N` on this machine: the run's processes started through torchrun
(tessel.launch.torchrun), with Ctrl-C and SIGTERM passed on to them.

Every launcher ends in the same worker command, `python -m tessel train ARGS`, so a run
behaves the same however it was started (the cluster job files: slurm.py, k8s.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

from tessel.errors import TesselError

# torchrun sets these in every worker; seeing one means we are already a launched worker.
_TORCHRUN_ENV = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")


def split_nproc(argv: list[str]) -> tuple[int | None, list[str]]:
    """(N from `--nproc N` / `--nproc=N`, or None; the other arguments unchanged)."""
    nproc: int | None = None
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--nproc" or arg.startswith("--nproc="):
            if "=" in arg:
                value = arg.split("=", 1)[1]
            elif i + 1 < len(argv):
                i += 1
                value = argv[i]
            else:
                value = ""
            try:
                nproc = int(value)
            except ValueError:
                nproc = 0
            if nproc < 1:
                raise TesselError(f"--nproc needs a whole number >= 1 (got {value!r}), e.g. --nproc 2")
        else:
            rest.append(arg)
        i += 1
    if nproc is not None and launched_by_torchrun():
        raise TesselError("--nproc starts processes itself; drop it when launching with torchrun")
    return nproc, rest


def launched_by_torchrun() -> bool:
    """Whether this process is already a launched worker (torchrun sets these in each)."""
    return any(os.environ.get(name) for name in _TORCHRUN_ENV)


def torchrun_command(nproc: int, train_args: list[str]) -> list[str]:
    """The command that runs `tessel train TRAIN_ARGS` as `nproc` processes on this machine.

    torchrun is run as a module of this Python so it is the torch tessel was installed with,
    whatever is on PATH; --standalone gives a private rendezvous on a free local port.
    """
    return [sys.executable, "-m", "tessel.launch.torchrun", "--standalone",
            "--nproc-per-node", str(nproc), "-m", "tessel", "train", *train_args]


def run_local(nproc: int, train_args: list[str]) -> int:
    """Run `tessel train TRAIN_ARGS` as `nproc` local processes; the exit code of torchrun.

    torchrun runs in its own process group, so a Ctrl-C in the terminal reaches only us and
    each worker sees exactly one SIGINT (torchrun forwards what it gets to the workers, which
    save a checkpoint). SIGINT and SIGTERM sent to us are passed on to that group.

    torchrun runs inside tessel (tessel.launch.torchrun), which ends with the workers' own
    exit code rather than torchrun's traceback and exit 1; after a Ctrl-C we return 130 if
    that code is not 0, as `tessel train` does in one process.
    """
    return run_torchrun(torchrun_command(nproc, train_args))


def run_torchrun(command: list[str], env: dict[str, str] | None = None) -> int:
    """Run a torchrun `command` (this machine's part of the run) in its own process group,
    passing SIGINT and SIGTERM on, as `run_local` describes; torchrun's exit code."""
    child: subprocess.Popen[bytes] | None = None
    forwarded: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        forwarded.append(signum)
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signum)

    # Installed before the child exists so that no signal can slip between start and wait.
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        child = subprocess.Popen(command, start_new_session=True, env=env)
        while True:
            # A timed wait, not one blocking waitpid: a signal that the kernel hands to another
            # thread (torch starts some) must still get our handler run promptly.
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = child.wait(timeout=0.5)
                break
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code != 0 and signal.SIGINT in forwarded:
        return 130
    return code if code >= 0 else 128 - code  # killed by signal S: 128 + S, like a shell
