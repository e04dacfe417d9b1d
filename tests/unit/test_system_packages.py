"""tests/system_packages.py without apt-get: which packages a selection of tests gets
installed, once per session, and the background script's quoting."""

from __future__ import annotations

import shlex

import pytest
import system_packages


@pytest.fixture
def started(monkeypatch, tmp_path):
    """The scripts `start` would run (nothing runs), with slurm-wlm and chromium missing."""
    scripts: list[str] = []
    monkeypatch.setattr(system_packages, "installed", lambda p: p not in ("slurm-wlm", "chromium"))
    monkeypatch.setattr(system_packages, "can_install", lambda: True)
    monkeypatch.setattr(system_packages.tempfile, "gettempdir", lambda: str(tmp_path / "a dir"))
    (tmp_path / "a dir").mkdir()
    monkeypatch.setenv(system_packages.RUN_ID, "session-1")
    monkeypatch.setattr(system_packages.subprocess, "Popen",
                        lambda args, **kw: scripts.append(args[2]))
    return scripts


def test_only_what_the_selected_tests_need_and_the_machine_lacks_is_installed_once(started):
    system_packages.start(["tests/unit/test_config.py::test_x"])  # needs nothing
    assert started == []
    slurm = "tests/integration/test_slurm.py::test_two_jobs_on_one_node_both_finish"
    system_packages.start([slurm, "tests/distributed/test_multinode.py::test_y"])
    system_packages.start([slurm])  # the other xdist worker: the session's install is started
    assert len(started) == 1
    words = shlex.split(started[0].split(";")[0])
    assert words[-1] == "slurm-wlm" and "munge" not in words and "iproute2" not in words
    assert "chromium" not in words  # no browser test selected


def test_the_background_script_quotes_its_paths(started, tmp_path):
    system_packages.start(["tests/integration/test_report.py::test_z"])
    (script,) = started
    assert shlex.quote(str(tmp_path / "a dir" / "tessel-test-apt-session-1" / "rc")) in script
    assert shlex.split(script.split(";")[0])[-1] == "chromium"
