"""`python -m tessel.parallel.node`: the node launcher's former path, now tessel.launch.node.

SLURM job scripts written by `tessel launch slurm` before the launcher moved to
tessel/launch/ call this path, and a requeued job runs its script again, possibly under a
newer tessel: this runs the launcher they meant, with their arguments and its exit codes.
New scripts call tessel.launch.node. By module name at run time (runpy), not by import:
the launcher sits above this package (tests/unit/test_structure.py's LAYERS).
"""

from __future__ import annotations

import runpy

if __name__ == "__main__":
    runpy.run_module("tessel.launch.node", run_name="__main__", alter_sys=True)
