"""Run by torchrun in the distributed tests: trains the runs a JSON spec lists, one after
another in one process group (starting a process group costs seconds on two cores).

spec = {"runs": [{"overrides": {...}, "resume": false,
                  "fault": "hang:rank=1:step=2",   # optional: TESSEL_FAULT for that run
                  "slow_async_save": {"rank": 1}, # optional: that rank's async saves lag
                                                   # (that run's alone)
                  "weights_in_memory": true},      # optional: its one save (at the end) is
                 ...],                             # the full weights, not a DCP checkpoint
        "measure_memory": true}                # optional: memory-rank*.json per run (planner)
Each run's metrics and checkpoints land in its run.dir; errors print one line and exit 2/3,
like the CLI. Faults of the run (a rank that hangs, gets SIGTERM, is killed, a slow network)
are TESSEL_FAULT's (tessel/train/faults.py), the hooks a fire drill uses; only the lagging
background writer of `slow_async_save`, which no drill has, is patched in here.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from tessel.checkpoint.init_from import load_config
from tessel.errors import TesselError
from tessel.parallel.dist import exit_process
from tessel.train import Trainer


@contextlib.contextmanager
def _slow_saves(run: dict) -> Iterator[None]:
    """With run["slow_async_save"] naming this rank: its background writer never reports
    done before it is waited for, during this run (the other runs of the job save as usual)."""
    slow = run.get("slow_async_save")
    if not (slow and slow["rank"] == int(os.environ["RANK"])):
        yield
        return
    from tessel.checkpoint import PendingSave

    done = PendingSave.done
    PendingSave.done = lambda self: False  # type: ignore[method-assign]
    try:
        yield
    finally:
        PendingSave.done = done  # type: ignore[method-assign]


@contextlib.contextmanager
def _weights_in_memory(run: dict) -> Iterator[None]:
    """With run["weights_in_memory"] (a run nothing resumes from): each save of the run (with
    checkpoint.interval = 0 the one at its end; otherwise the last one wins) writes each
    rank's model weights, whole (shards gathered), to final-weights-rankR.pt in the run
    directory instead of a DCP checkpoint of weights and optimizer state. The layout's final
    weights are still compared with the reference's (test_layouts.final_weights reads these
    files); what it no longer does is the checkpoint round trip, which the resumed and
    resharded runs keep (the issue's "keep full weights in memory for runs nothing resumes
    from"). Saves were ~20% of a short layout's time on two cores."""
    if not run.get("weights_in_memory"):
        yield
        return
    from torch.distributed.tensor import DTensor

    from tessel.checkpoint.manager import CheckpointManager
    from tessel.checkpoint.store import _model_state  # the tensors a checkpoint would hold

    def in_memory(self, step: int, state: dict, device: torch.device) -> None:  # noqa: ANN001
        models = self.models if isinstance(self.models, (list, tuple)) else [self.models]
        weights = {}
        for m in models:  # (in the same order on every rank of a mesh: full_tensor gathers)
            for name, t in _model_state(m).items():
                t = t.full_tensor() if isinstance(t, DTensor) else t
                weights[name] = t.detach().cpu().clone()
        out = Path(self.root).parent / f"final-weights-rank{os.environ['RANK']}.pt"
        torch.save({"step": step, "weights": weights}, out)
        self.last_saved_step = step

    save = CheckpointManager.save
    CheckpointManager.save = in_memory  # type: ignore[method-assign]
    try:
        yield
    finally:
        CheckpointManager.save = save  # type: ignore[method-assign]


def _install_meter(spec: dict) -> None:
    """With spec["measure_memory"]: the second step of each fresh run counts the bytes
    autograd saves for backward (peak, tests/saved_memory.py), for the planner's check. Not
    the first: PyTorch's pipeline stages infer shapes there with an extra real forward."""
    if not spec.get("measure_memory"):
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from saved_memory import SavedTensorMeter, meter_selective_checkpointing

    meter_selective_checkpointing()

    original = Trainer.run_step

    def measured(self):  # noqa: ANN001, ANN202
        if self.step != 1:
            return original(self)
        meter = SavedTensorMeter.for_modules(self.model.inner)
        with meter.measuring():
            result = original(self)
        self.measured_saved_peak = meter.peak
        return result

    Trainer.run_step = measured  # type: ignore[method-assign]


def _record_memory(trainer: Trainer) -> None:
    """What this rank holds (local shards): parameter, AdamW-state and Muon-momentum elements, and the
    saved-activation peak of the second step, next to its pipeline rank."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> int:
        return (t.to_local() if isinstance(t, DTensor) else t).numel()

    mesh = trainer.train_step.mesh
    record = {
        "params": sum(local(p) for p in trainer.model.parameters()),
        "exp_avg": sum(local(s["exp_avg"]) for o in trainer.optimizers for s in o.state.values()
                       if "exp_avg" in s),
        "momentum": sum(local(s["momentum_buffer"]) for o in trainer.optimizers
                        for s in o.state.values() if "momentum_buffer" in s),  # Muon's
        "saved_peak": getattr(trainer, "measured_saved_peak", None),
        "pp_rank": mesh["pp"].get_local_rank() if mesh is not None and trainer.dims.pp > 1 else 0,
    }
    rank = int(os.environ["RANK"])
    (Path(trainer.cfg.run.dir) / f"memory-rank{rank}.json").write_text(json.dumps(record))


def _copy_run(src: Path, dst: Path, step: int) -> None:
    """Rank 0 makes `dst` the run `src` was after checkpoint `step` (metrics left out)."""
    if int(os.environ["RANK"]) == 0:
        dst.mkdir(parents=True)
        for name in ("config.toml", "tokenizer.json"):
            shutil.copy(src / name, dst / name)
        name = f"step_{step:08d}"
        shutil.copytree(src / "checkpoints" / name, dst / "checkpoints" / name)
    dist.barrier()  # the process group exists: an earlier run of the spec started it


def _one_mesh_per_shape() -> None:
    """Every run of this job with the same mesh shape gets the same DeviceMesh, and with it the
    same process groups (its flattened groups are kept on it too). `tessel train` builds one
    mesh per process; this job trains dozens of runs, and each new mesh's gloo groups stay
    alive (destroying them is not possible: DTensor's caches hand later runs meshes equal to
    theirs), each with 3 threads polling its sockets: 200 groups took ~17% of a core per
    process, idle, and a 4-process job reached ~280."""
    import tessel.parallel.dims as dims

    made: dict[tuple, object] = {}
    build = dims.init_device_mesh

    def cached(device_type, shape, mesh_dim_names=None, **kw):  # noqa: ANN001, ANN003, ANN202
        key = (device_type, tuple(shape), tuple(mesh_dim_names or ()), tuple(sorted(kw.items())))
        if key not in made:
            made[key] = build(device_type, shape, mesh_dim_names=mesh_dim_names, **kw)
        return made[key]

    dims.init_device_mesh = cached


def main() -> int:
    faulthandler.enable(all_threads=True)  # as `tessel` does: a native abort shows the stacks
    spec = json.loads(open(sys.argv[1]).read())
    torch.set_num_threads(1)
    _install_meter(spec)
    _one_mesh_per_shape()
    try:
        for run in spec["runs"]:
            cfg = load_config(None, run["overrides"])  # shape from model.init_from, if set
            if "copy_from" in run:
                _copy_run(Path(run["copy_from"]), Path(cfg.run.dir), run["copy_step"])
            if "fault" in run:  # read when the Trainer is built: this run's alone
                os.environ["TESSEL_FAULT"] = run["fault"]
            trainer = Trainer(cfg, resume=run.get("resume", False), console=False)
            if "fault" in run:
                del os.environ["TESSEL_FAULT"]
            with _slow_saves(run), _weights_in_memory(run):
                trainer.train()
            if spec.get("measure_memory"):
                _record_memory(trainer)
    except TesselError as exc:
        print(f"tessel: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 2)
    return 0


if __name__ == "__main__":
    exit_process(main())  # as `tessel` itself leaves a torchrun worker
