"""One node of a cluster job: start this node's training processes and see them through.

    python -m tessel.launch.node --nproc-per-node P --master-addr HOST --master-port PORT \\
        [--nnodes N --node-rank R] -- TRAIN_ARGS...

The SLURM script (`tessel launch slurm`) runs this on every node instead of torchrun, for two
reasons measured on a real SLURM: torchrun, once it receives the scheduler's SIGTERM itself,
exits 1 with a traceback whatever its workers did (so a job that checkpointed cleanly ends
FAILED and is not requeued), and it kills its workers 30 s after the signal, which a large
checkpoint may need. Here a stop signal (SIGTERM, SIGUSR1, SIGINT) is passed to every worker
once and the launcher waits for them however long the save takes; the workers rendezvous
through MASTER_ADDR:MASTER_PORT (torch's env:// initialisation) as under torchrun.

Exit code: the workers' own when they agree (0: finished); EXIT_REQUEUE (75) when a SIGTERM or
SIGUSR1 stopped them before the run's last step and each saved its checkpoint (the workers
say so with that code: STOPPED_EXIT_ENV), so the job script requeues itself, but 0 when the
signal came after the last step (the run is done); otherwise the first failing worker's code
(128 + S if a signal S killed it), after the others had `_FAILURE_GRACE_S` seconds to notice
(their collectives fail) and were then killed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time

# EX_TEMPFAIL: "try again later". The job script requeues itself on it.
EXIT_REQUEUE = 75
# Read by tessel.train.control.exit_code_for: what a worker exits with when a stop signal
# ended its run early, after the checkpoint.
STOPPED_EXIT_ENV = "TESSEL_STOPPED_EXIT_CODE"
_FAILURE_GRACE_S = 60.0
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="python -m tessel.launch.node")
    if "--" not in argv:  # argparse's own one-line usage error, exit 2
        p.error("the training arguments must follow '--': OPTIONS -- TRAIN_ARGS")
    cut = argv.index("--")
    p.add_argument("--nproc-per-node", type=int, required=True)
    p.add_argument("--nnodes", type=int, default=int(os.environ.get("SLURM_NNODES", "1")))
    p.add_argument("--node-rank", type=int, default=int(os.environ.get("SLURM_NODEID", "0")))
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, required=True)
    return p.parse_args(argv[:cut]), argv[cut + 1:]


def worker_env(local_rank: int, a: argparse.Namespace) -> dict[str, str]:
    """The environment torchrun would give worker `local_rank` of this node."""
    world = a.nnodes * a.nproc_per_node
    # torchrun sets 1 for several processes; the cores this node's task was given, shared
    # out, keep CPU jobs from oversubscribing and use what SLURM allotted (--cpus-per-task)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (cores or 1) // a.nproc_per_node))
    return {**os.environ, "OMP_NUM_THREADS": threads,
            "RANK": str(a.node_rank * a.nproc_per_node + local_rank),
            "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(a.nproc_per_node), "GROUP_RANK": str(a.node_rank),
            "MASTER_ADDR": a.master_addr, "MASTER_PORT": str(a.master_port),
            STOPPED_EXIT_ENV: str(EXIT_REQUEUE)}


def main(argv: list[str] | None = None) -> int:
    a, train_args = _parse(sys.argv[1:] if argv is None else argv)
    workers: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, _frame: object) -> None:
        for w in workers:
            with contextlib.suppress(ProcessLookupError):
                w.send_signal(signum)

    # Installed before any worker exists, so no signal can slip between start and wait.
    previous = {sig: signal.signal(sig, forward) for sig in _STOP_SIGNALS}
    try:
        cmd = [sys.executable, "-m", "tessel", "train", *train_args]
        # Blocked while the workers start: they inherit the mask, and a stop signal that
        # arrives before tessel's handlers exist stays pending until `tessel train` installs
        # them (train.control.catch_early_signals) instead of killing the worker. Here it is
        # delivered once every worker is in the list it is forwarded to.
        blocked = {signal.SIGTERM, signal.SIGUSR1}
        signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        try:
            for local_rank in range(a.nproc_per_node):
                # their own session: a terminal's Ctrl-C reaches them once, through us
                workers.append(subprocess.Popen(cmd, env=worker_env(local_rank, a),
                                                start_new_session=True))
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
        codes = _wait(workers)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    failed = [c for c in codes if c not in (0, EXIT_REQUEUE)]
    if failed:
        code = failed[0]
        return code if code > 0 else 128 - code
    if EXIT_REQUEUE in codes:  # stopped early, saved (a signal after the last step: 0)
        print("tessel: stopped by the scheduler's signal after saving a checkpoint; "
              f"exiting {EXIT_REQUEUE} so the job requeues itself", file=sys.stderr, flush=True)
        return EXIT_REQUEUE
    return 0


def _wait(workers: list[subprocess.Popen[bytes]]) -> list[int]:
    """Every worker's exit code; once one fails, the others are killed after a grace."""
    failed_at: float | None = None
    while True:
        codes = [w.poll() for w in workers]
        if all(c is not None for c in codes):
            return [int(c) for c in codes if c is not None]
        if failed_at is None and any(c not in (None, 0, EXIT_REQUEUE) for c in codes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > _FAILURE_GRACE_S:
            for w in workers:
                if w.poll() is None:
                    w.kill()
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
