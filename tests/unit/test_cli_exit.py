"""How the installed `tessel` command leaves a process that started no process group
(tessel.cli.run, tessel.parallel.dist.exit_process)."""

from __future__ import annotations

import subprocess
import sys

_SCRIPT = """\
import atexit, sys, threading, time
atexit.register(lambda: print("exit handler registered before the command"))

class Teardown:
    def __del__(self):
        print("module teardown")

kept = Teardown()  # a module's object: only the interpreter's teardown of the modules deletes it

import torch.distributed  # as every command that trains has (the process starts no group)
import tessel.cli

returned = threading.Event()  # set when the command has returned its exit code
command = tessel.cli.exit_code

def exit_code():
    code = command()
    returned.set()
    return code

tessel.cli.exit_code = exit_code

def late():  # ends only after the command has returned: only a waiting exit lets it print
    returned.wait()
    time.sleep(0.3)
    print("non-daemon thread finished")

threading.Thread(target=late).start()
sys.argv = ["tessel", "--version"]
tessel.cli.run()
"""


def test_the_command_waits_for_threads_and_runs_exit_handlers_but_skips_the_module_teardown():
    """The teardown of the modules cost 0.5-1 s of CPU per command once torch is loaded and
    does nothing a finished command needs; what a plain exit does before it still happens,
    in the interpreter's order, whoever registered it."""
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1:] == [
        "non-daemon thread finished", "exit handler registered before the command"], proc.stdout


def test_the_exit_code_survives_the_fast_exit():
    proc = subprocess.run(
        [sys.executable, "-c", "import sys, torch.distributed; "
                               "sys.argv = ['tessel', 'train', '/nonexistent.toml']; "
                               "from tessel.cli import run; run()"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("tessel: error: "), proc.stderr
