"""torchrun inside a tessel process: `python -m tessel.launch.torchrun TORCHRUN_ARGS`, what
`tessel train --nproc N` and `--nnodes` start (tessel/launch/local.py).

It is torchrun's own launcher (`torch.distributed.run`), whose ending is made tessel's:
torchrun ends every failure with a traceback and exit 1, losing the codes that
docs/exit-codes.md promises. Here the exit code is

- the workers' own when they failed (torchrun's ChildFailedError): the first failed worker's
  code (6: diverged, 5: an alert's stop, ...; 128 + S when signal S killed it), with no
  traceback: the worker said why on its own;
- after a signal S that torchrun passed on to the workers (SIGTERM, SIGINT): the first
  non-zero code the workers exited with (143 when stopped while preparing the data, 130
  after a Ctrl-C), 0 when each exited 0 (it saved its checkpoint), 128 + S when they had
  not started;
- 3 with one line naming the endpoint and the timeout when the rendezvous could not be
  reached or did not complete in time (`RendezvousError`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

EXIT_RENDEZVOUS = 3
"""A rendezvous that could not be reached or completed: docs/exit-codes.md's 3 ("a collective
failed or timed out")."""
READ_TIMEOUT_S = 60
JOIN_TIMEOUT_S = 600
"""torchrun's defaults for `--rdzv-conf read_timeout` (connecting to the rendezvous's store)
and `join_timeout` (the nodes joining)."""


def signal_code(code: int) -> int:
    """A process's return code as a shell reports it (killed by signal S: 128 + S)."""
    return code if code >= 0 else 128 - code


def workers_after_signal(codes: list[int | None], sig: int) -> int:
    """The exit code of a launch stopped by signal `sig`, from the codes its workers exited
    with (None: still running when torchrun gave up on it)."""
    done = [signal_code(c) for c in codes if c is not None]
    if not done or len(done) < len(codes):
        return 128 + sig
    return next((c for c in done if c != 0), 0)


def rendezvous_line(exc: BaseException, endpoint: str, conf: dict[str, str]) -> str:
    """One line for a rendezvous that failed: where it was, and how long it was waited for."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    if isinstance(exc, RendezvousConnectionError):
        wait = conf.get("read_timeout", str(READ_TIMEOUT_S))
        cause = str(exc.__cause__ or exc).strip().splitlines() or [type(exc).__name__]
        return (f"cannot reach the rendezvous at {endpoint} (waited up to {wait} s, "
                f"--rdzv-timeout; {cause[0][:200]}): start the node whose address it is, or "
                "check the address, the port (another program may hold it) and the firewall")
    wait = conf.get("join_timeout", str(JOIN_TIMEOUT_S))
    return (f"the rendezvous at {endpoint} did not complete within {wait} s (--rdzv-timeout; "
            f"{type(exc).__name__}): start the same command on every node of --nnodes, or "
            "raise --rdzv-timeout")


def _watch_closes(codes: dict[int, int | None]) -> Callable[[], None]:
    """Record, in `codes`, the exit code of every worker torchrun closes (after a signal it
    passes on the workers' codes are otherwise lost); returns the undo."""
    from torch.distributed.elastic.multiprocessing import api

    original = api.SubprocessContext._close

    def close(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        for rank, handler in getattr(self, "subprocess_handlers", {}).items():
            codes[rank] = handler.proc.poll()

    api.SubprocessContext._close = close
    return lambda: setattr(api.SubprocessContext, "_close", original)


def _quiet_failure_logs() -> None:
    """Drop torchrun's log lines about its workers' ending ("failed (exitcode: 6) ...",
    "Sending process ... closing signal", "Received 15 death signal"): the workers said why
    themselves, in one line."""
    import logging

    chatter = ("failed (exitcode", "Sending process", "Closing process", "Received %s death")
    for name in ("multiprocessing.api", "agent.server.api"):
        logging.getLogger(f"torch.distributed.elastic.{name}").addFilter(
            lambda record: not str(record.msg).startswith(chatter))


def main(argv: list[str] | None = None) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    args = torchrun.parse_args(sys.argv[1:] if argv is None else argv)
    codes: dict[int, int | None] = {}
    _quiet_failure_logs()
    undo = _watch_closes(codes)
    try:
        torchrun.run(args)
    except ChildFailedError as exc:
        _, failure = exc.get_first_failure()
        return signal_code(failure.exitcode)
    except SignalException as exc:
        return workers_after_signal([codes[r] for r in sorted(codes)], int(exc.sigval))
    except RendezvousError as exc:
        conf = dict(item.partition("=")[::2] for item in
                    filter(None, (args.rdzv_conf or "").split(",")))
        print(f"tessel: error: {rendezvous_line(exc, args.rdzv_endpoint, conf)}",
              file=sys.stderr, flush=True)
        return EXIT_RENDEZVOUS
    except KeyboardInterrupt:  # a Ctrl-C before the workers started (torchrun's own handler)
        return 130
    finally:
        undo()
    return 0


if __name__ == "__main__":
    sys.exit(main())
