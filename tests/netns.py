"""Nodes for multi-node tests: Linux network namespaces on this machine, each with its own
address on a private bridge (veth pairs), made by the test and removed afterwards.

    with nodes(2) as (a, b):          # a.addr == "10.231.0.1", b.addr == "10.231.0.2"
        proc = a.popen([...], env)     # runs inside a's network stack
        b.kill_all()                   # every process of node b, as a lost machine

Names carry a random suffix, so concurrent test sessions never share a namespace, bridge or
interface (their addresses may repeat: each bridge is a network of its own, with no address
on the host). Where namespaces cannot be made (not root, no `ip`), the test is skipped with
one line; under CI=true it fails instead, so CI never passes by skipping them.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import system_packages

SUBNET = "10.231.0"
"""The test's own private range (10.231.0.0/24): node i is SUBNET.(i+1)."""


@dataclass(frozen=True)
class Node:
    """One namespace: its name, its address and the interface that holds it."""

    name: str
    addr: str
    ifname: str

    def command(self, cmd: list[str]) -> list[str]:
        """`cmd` run inside this node's network stack."""
        return ["ip", "netns", "exec", self.name, *cmd]

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment for processes of this node: gloo binds to the node's interface (by
        default it takes the address the host name resolves to, which no namespace has)."""
        return {**(os.environ if base is None else base), "GLOO_SOCKET_IFNAME": self.ifname}

    def popen(self, cmd: list[str], env: dict[str, str] | None = None,
              **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(cmd), env=self.env(env), **kwargs)

    def pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def kill_all(self) -> list[int]:
        """SIGKILL every process in this node (a machine that is lost); the pids killed."""
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode:
        raise OSError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None. A root machine with apt-get and no `ip`
    gets iproute2 installed first (tests/system_packages.py)."""
    system_packages.ensure("iproute2")
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "not root"
    return None


def skip_or_fail(reason: str) -> None:
    """Skip the test with one line, but fail it under CI=true (CI must run it)."""
    msg = f"network namespaces unavailable ({reason}): multi-node test not run"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(msg + " (CI=true: must run)", pytrace=False)
    pytest.skip(msg)


@contextlib.contextmanager
def nodes(n: int) -> Iterator[list[Node]]:
    """`n` namespaces on one bridge, removed (with every process left in them) on exit."""
    reason = unavailable()
    if reason:
        skip_or_fail(reason)
    tag = secrets.token_hex(3)
    bridge = f"tb{tag}"
    made: list[Node] = []
    # A SIGTERM (a CI time limit) would end the process without running `finally`: turned into
    # SystemExit while the namespaces exist, so they are removed.
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_term) if main else None
    try:
        try:
            _ip("link", "add", bridge, "type", "bridge")
            _ip("link", "set", bridge, "up")
            for i in range(n):
                node = Node(f"tessel-{tag}-{i}", f"{SUBNET}.{i + 1}", f"tn{tag}{i}")
                _ip("netns", "add", node.name)
                made.append(node)
                host_side = f"tv{tag}{i}"
                _ip("link", "add", host_side, "type", "veth", "peer", "name", node.ifname)
                _ip("link", "set", node.ifname, "netns", node.name)
                _ip("link", "set", host_side, "master", bridge)
                _ip("link", "set", host_side, "up")
                inside = ("netns", "exec", node.name, "ip")
                _ip(*inside, "addr", "add", f"{node.addr}/24", "dev", node.ifname)
                _ip(*inside, "link", "set", node.ifname, "up")
                _ip(*inside, "link", "set", "lo", "up")
        except OSError as exc:
            skip_or_fail(str(exc))
        yield made
    finally:
        for node in made:
            node.kill_all()
            # deleting the namespace removes its end of the veth pair, and with it the other
            subprocess.run(["ip", "netns", "del", node.name], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)
        if main:
            signal.signal(signal.SIGTERM, previous)


def _exit_on_term(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)
