"""Run by torchrun in the distributed tests: trains the runs a JSON spec lists, one after
another in one process group (starting a process group costs seconds on two cores).

spec = {"runs": [{"overrides": {...}, "resume": false}, ...],
        "hang": {"rank": 1, "step": 2},        # optional: that rank stops responding
        "sigterm": {"rank": 0, "step": 2},     # optional: only that rank gets SIGTERM
        "slow_async_save": {"rank": 1}}        # optional: that rank's async saves lag
Each run's metrics and checkpoints land in its run.dir; errors print one line and exit 2/3,
like the CLI.
"""

from __future__ import annotations

import faulthandler
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tessel.config import Config
from tessel.errors import TesselError
from tessel.parallel.dist import exit_process
from tessel.train import Trainer


def _install_faults(spec: dict) -> None:
    rank = int(os.environ["RANK"])
    original = Trainer._train_step

    def faulty(self):  # noqa: ANN001, ANN202
        hang, term = spec.get("hang"), spec.get("sigterm")
        if hang and hang["rank"] == rank and self.step == hang["step"]:
            time.sleep(3600)
        if term and term["rank"] == rank and self.step == term["step"]:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self)

    Trainer._train_step = faulty  # type: ignore[method-assign]
    slow = spec.get("slow_async_save")
    if slow and slow["rank"] == rank:
        from tessel.checkpoint import PendingSave

        # This rank's background writer never reports done before it is waited for.
        PendingSave.done = lambda self: False  # type: ignore[method-assign]


def _copy_run(src: Path, dst: Path, step: int) -> None:
    """Rank 0 makes `dst` the run `src` was after checkpoint `step` (metrics left out)."""
    if int(os.environ["RANK"]) == 0:
        dst.mkdir(parents=True)
        for name in ("config.toml", "tokenizer.json"):
            shutil.copy(src / name, dst / name)
        name = f"step_{step:08d}"
        shutil.copytree(src / "checkpoints" / name, dst / "checkpoints" / name)
    dist.barrier()  # the process group exists: an earlier run of the spec started it


def main() -> int:
    faulthandler.enable(all_threads=True)  # as `tessel` does: a native abort shows the stacks
    spec = json.loads(open(sys.argv[1]).read())
    torch.set_num_threads(1)
    _install_faults(spec)
    try:
        for run in spec["runs"]:
            cfg = Config.load(None, run["overrides"])
            if "copy_from" in run:
                _copy_run(Path(run["copy_from"]), Path(cfg.run.dir), run["copy_step"])
            Trainer(cfg, resume=run.get("resume", False), console=False).train()
    except TesselError as exc:
        print(f"tessel: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 2)
    return 0


if __name__ == "__main__":
    exit_process(main())  # as `tessel` itself leaves a torchrun worker
