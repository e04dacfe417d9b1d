"""`tessel train --nproc P --nnodes N|MIN:MAX --rdzv-endpoint HOST:PORT`: this machine's part of
a multi-node run, through torchrun's c10d rendezvous (run the same command on every node).

With MIN:MAX the run is elastic: torchrun's rendezvous admits between MIN and MAX nodes; when
a node is lost the survivors' workers fail, torchrun restarts them (up to --max-restarts
times) with the nodes still there, and `--auto-resume` continues the run from its latest
checkpoint at the new world size (tessel/launch/elastic.py re-plans the batch split). A
node that comes back (the same command started on it again) is taken in at the next round:
the running agents stop their workers (a checkpoint, as on preemption) and all restart at
the larger world size (SEPARATE_STORE_ENV says what that needs from torchrun;
docs/parallelism.md#elastic-world-size).

The node whose address is HOST hosts the rendezvous (decided here by binding to HOST, not by
comparing host names, which namespaces and containers share), and each node announces the
address it reaches HOST from (`--local-addr`), so workers meet on the network the endpoint
is on.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from dataclasses import dataclass

from tessel.errors import TesselError
from tessel.numbers import whole_number

ELASTIC_ENV = "TESSEL_NNODES"
"""Set (to MIN:MAX) in the workers of an elastic run: they re-plan the micro-batch for the
data-parallel size they find (tessel/launch/elastic.py)."""
SEPARATE_STORE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""torchrun's agents, by default, hand their workers the rendezvous's own TCP store, and each
agent looks up where that store is only at its first rendezvous. A node that joins a later
round (one coming back, or any node of a round whose membership changed) then waits for the
store's address in the new round's keys, which the other agents never write again, while they
wait for its rank keys: both time out after 60 s (torch 2.13, seen on two network namespaces;
pytorch/pytorch#147064 is the same failure). With this set, every round publishes a fresh
address and the workers start their own store, as torch did before 2.4."""
SEPARATE_STORE_EXPORT = "\n".join(f'export {k}="${{{k}:-{v}}}"' for k, v in SEPARATE_STORE_ENV.items())
"""The same for a job script that runs torchrun itself (Kubernetes pods), in bash."""
LAST_CALL_S = 5
"""Seconds the rendezvous waits for more nodes once MIN have joined (torchrun's default is
30: every shrink would wait that long)."""


@dataclass(frozen=True)
class NodeRange:
    """How many nodes a run takes: exactly `low` (low == high), or elastic, low to high."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str, flag: str = "--nnodes") -> NodeRange:
        low, _, high = text.partition(":")
        lo, hi = whole_number(low) or 0, whole_number(high or low) or 0
        if lo < 1 or hi < lo:
            raise TesselError(f"{flag} needs N or MIN:MAX with 1 <= MIN <= MAX (got {text!r}), "
                              f"e.g. {flag} 2 or {flag} 1:4")
        return cls(lo, hi)

    @property
    def elastic(self) -> bool:
        return self.high > self.low

    def counts(self) -> range:
        return range(self.low, self.high + 1)

    def __str__(self) -> str:
        return f"{self.low}:{self.high}" if self.elastic else str(self.low)


@dataclass(frozen=True)
class Rendezvous:
    """The multi-node options of `tessel train`."""

    nodes: NodeRange
    endpoint: str
    run_id: str = "tessel"
    max_restarts: int = 3
    timeout_s: int | None = None
    """--rdzv-timeout: seconds to reach the endpoint and for the nodes to join (None:
    torchrun's 60 and 600)."""

    def host_port(self) -> tuple[str, int]:
        host, sep, text = self.endpoint.rpartition(":")
        host, port = host.strip("[]"), whole_number(text)
        if not sep or not host or port is None or not 1 <= port <= 65535:
            raise TesselError(f"--rdzv-endpoint needs HOST:PORT (got {self.endpoint!r}), "
                              "e.g. --rdzv-endpoint 10.0.0.1:29500 (an address of the first node)")
        return host, port


TAKEN = ("--nproc", "--nnodes", "--rdzv-endpoint", "--rdzv-id", "--max-restarts",
         "--rdzv-timeout")
"""The launch options `tessel train` takes out before the workers get the other arguments."""


def split_launch(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """({option: value} of the TAKEN options, as `--opt V` or `--opt=V`; the other arguments
    unchanged)."""
    taken: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if name in TAKEN:
            if "=" in arg:
                taken[name] = arg.split("=", 1)[1]
            elif i + 1 < len(argv):
                i += 1
                taken[name] = argv[i]
            else:
                taken[name] = ""
        else:
            rest.append(arg)
        i += 1
    return taken, rest


def rendezvous_from(taken: dict[str, str]) -> Rendezvous | None:
    """The Rendezvous the options ask for, or None for a one-machine run; one line if they
    are incomplete."""
    multi = [k for k in TAKEN[1:] if k in taken]
    if not multi:
        return None
    if "--nnodes" not in taken or "--rdzv-endpoint" not in taken:
        raise TesselError("a multi-node run needs --nnodes N (or MIN:MAX) and --rdzv-endpoint "
                          f"HOST:PORT together (got {', '.join(multi)})")
    restarts = whole_number(taken.get("--max-restarts", "3"))
    if restarts is None:
        raise TesselError("--max-restarts needs a whole number >= 0 (got "
                          f"{taken['--max-restarts']!r})")
    run_id = taken.get("--rdzv-id", "tessel")
    if not run_id or not all(c.isalnum() or c in "._-" for c in run_id):
        raise TesselError(f"--rdzv-id {run_id!r} must be letters, digits, '.', '_' or '-'")
    timeout = taken.get("--rdzv-timeout")
    seconds = None if timeout is None else whole_number(timeout)
    if timeout is not None and (seconds is None or seconds < 1):
        raise TesselError(f"--rdzv-timeout needs whole seconds >= 1 (got {timeout!r}), e.g. "
                          "--rdzv-timeout 120")
    rdzv = Rendezvous(NodeRange.parse(taken["--nnodes"]), taken["--rdzv-endpoint"], run_id,
                      restarts, seconds)
    rdzv.host_port()  # checked now
    return rdzv


def is_local(host: str) -> bool:
    """Whether `host` is an address of this machine's network stack (we can bind to it)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    for family, _, _, _, addr in infos:
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((addr[0], 0))
            return True
    return False


def local_address(host: str, port: int) -> str:
    """The address of this machine that packets to HOST:PORT leave from (no packet is sent)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError as exc:
        raise TesselError(f"--rdzv-endpoint {host}:{port} is not reachable from this machine "
                          f"({exc.strerror or exc}); give an address of the first node") from None


def torchrun_env(nodes: NodeRange) -> dict[str, str]:
    """The environment of this node's torchrun: the caller's, plus a separate store for every
    rendezvous round (what the user set wins), plus the node range for elastic workers."""
    env = {**SEPARATE_STORE_ENV, **os.environ}
    if nodes.elastic:
        env[ELASTIC_ENV] = str(nodes)
    return env


def multinode_command(nproc: int, rdzv: Rendezvous, train_args: list[str]) -> list[str]:
    """torchrun for this node's `nproc` workers of the run (the module of this Python, like
    `launch.torchrun_command`). PET_RDZV_CONF (torchrun's own variable for --rdzv-conf) may
    add rendezvous settings; tessel adds is_host, a short last call and --rdzv-timeout. It is
    run through tessel.launch.torchrun, which ends with the workers' exit code and says in
    one line why a rendezvous failed."""
    host, port = rdzv.host_port()
    conf = {"last_call_timeout": str(LAST_CALL_S)}
    for item in filter(None, os.environ.get("PET_RDZV_CONF", "").split(",")):
        key, _, value = item.partition("=")
        conf[key.strip()] = value.strip()
    if rdzv.timeout_s is not None:
        conf["read_timeout"] = conf["join_timeout"] = str(rdzv.timeout_s)
    conf["is_host"] = "1" if is_local(host) else "0"
    return [sys.executable, "-m", "tessel.launch.torchrun", "--nnodes", str(rdzv.nodes),
            "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", rdzv.endpoint, "--rdzv-id", rdzv.run_id,
            "--rdzv-conf", ",".join(f"{k}={v}" for k, v in conf.items()),
            "--local-addr", local_address(host, port),
            "--max-restarts", str(rdzv.max_restarts), "-m", "tessel", "train", *train_args]
