"""The Debian packages the suite runs for real: slurm-wlm and munge (a real SLURM cluster),
chromium (`tessel report`'s page in a browser) and iproute2 (network namespaces for the
multi-node tests).

On a root machine with apt-get, what the collected tests need and the machine lacks is
installed once per test session, in the background from collection on: `apt-get update`, the
downloads and the unpacking mostly wait on the network and the disk, so they overlap the
first tests, which keep both cores busy, instead of coming before them or in the middle of a
test. A test that needs a package calls `ensure`, which waits for that install.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

COMMANDS = {"slurm-wlm": ("slurmctld",), "munge": ("munged",), "iproute2": ("ip",),
            "chromium": ("chromium", "chromium-browser", "google-chrome")}
"""Each package, and the commands on PATH that show it is installed (any one: another browser
does for the browser tests)."""
BROWSERS = COMMANDS["chromium"]
USERS = {
    "tests/integration/test_slurm.py": ("slurm-wlm", "munge", "iproute2"),
    "tests/integration/test_report.py": ("chromium",),
    "tests/integration/test_scale_page.py": ("chromium",),
    "tests/distributed/test_multinode.py": ("iproute2",),
    "tests/unit/test_elastic.py": ("iproute2",),
}
"""The test modules that run a package, by path: what a collection needs installed."""
TIMEOUT_S = 900.0
"""The longest the install may take (apt-get's downloads included)."""
LOCK = ("-o", "DPkg::Lock::Timeout=300")
"""apt-get waits for another apt-get's lock (another test session's install, say) instead of
failing at once."""

RUN_ID = "TESSEL_TEST_RUN_ID"
"""The test session's id (conftest sets it: xdist's testrunuid, which every worker shares)."""


def installed(package: str) -> bool:
    return any(shutil.which(command) for command in COMMANDS[package])


def can_install() -> bool:
    return os.geteuid() == 0 and shutil.which("apt-get") is not None


def _state_dir() -> Path:
    run_id = os.environ.setdefault(RUN_ID, uuid.uuid4().hex)
    return Path(tempfile.gettempdir()) / f"tessel-test-apt-{run_id}"


def _apt_get(missing: list[str]) -> list[list[str]]:
    """The commands that install `missing`: apt-get waits for another apt-get's lock."""
    return [["apt-get", "update", "-q", *LOCK],
            ["apt-get", "install", "-y", "-q", *LOCK, "--no-install-recommends", *missing]]


def start(nodeids: list[str]) -> None:
    """Start installing, in the background, what the tests `nodeids` need and this machine
    lacks, once per session (every xdist worker collects the same tests: the first to get
    here starts it)."""
    needed = {p for module, packages in USERS.items()
              if any(n.startswith(module) for n in nodeids) for p in packages}
    missing = sorted(p for p in needed if not installed(p))
    if not missing or not can_install():
        return
    state = _state_dir()
    try:
        state.mkdir()  # atomic: one starter per session
    except FileExistsError:
        return
    rc, done = shlex.quote(str(state / "rc.tmp")), shlex.quote(str(state / "rc"))
    script = f"{' && '.join(map(shlex.join, _apt_get(missing)))}; echo $? > {rc} && mv {rc} {done}"
    with open(state / "log", "w") as log:
        subprocess.Popen(["sh", "-c", script], stdout=log, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, start_new_session=True,
                         env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


def ensure(*packages: str) -> str | None:
    """Wait for the session's background install, and install what is still missing (a test
    run on its own, or on a machine where the background install failed); None when every
    package is there, else why not, in one line."""
    missing = [p for p in packages if not installed(p)]
    if not missing:
        return None
    state = _state_dir()
    deadline = time.monotonic() + TIMEOUT_S
    while state.is_dir() and not (state / "rc").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    missing = [p for p in packages if not installed(p)]
    if not missing:
        return None
    if not can_install():
        return f"{' '.join(missing)} not installed (apt-get install {' '.join(missing)})"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in _apt_get(missing):
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        if out.returncode != 0:
            return f"{' '.join(cmd)} failed: {out.stderr.strip()[-300:]}"
    return None
