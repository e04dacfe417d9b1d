"""Atomic, sharded checkpoints through torch.distributed.checkpoint (DCP).

Layout of `RUN/checkpoints/`:

    step_00000200/  __0_0.distcp ... .metadata  state.json
    latest -> step_00000200

Every rank writes its own shards of the model and optimizer state (DCP), keyed by the
parameter's name in the whole model; DCP records which slice of each global tensor every
file holds, so a checkpoint saved under one layout loads under any other (tp2 x pp2 -> dp4,
8 ranks -> 1): each rank reads exactly the slices it now owns. Optimizer state is saved
flattened by parameter name, so it reshards the same way.

A save writes everything into `.tmp-step_...`, then rank 0 writes `state.json` last (the
loader position, config, and each file's size), renames the directory into place and
repoints `latest`. A crash at any moment leaves either the old set of checkpoints or the old
set plus a complete new one. Every read goes through `safe_load`, which parses DCP's pickles
(the `.metadata` file and non-tensor values) without running anything they name.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
import shutil
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from tessel.checkpoint import checksum, safe_load
from tessel.checkpoint.errors import CheckpointError, short
from tessel.checkpoint.pending import (
    PendingSave,
    failed_save_is_one_line,
    then,
)
from tessel.checkpoint.state_file import (
    FORMAT_VERSION,
    MOVE_ASIDE,
    STATE_DIGEST,
    digests,
    state_digest,
)
from tessel.fileio import fsync_dir
from tessel.models.lora import is_adapter
from tessel.parallel.fp8 import plain_tensor


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """DCP warns when no process group exists; one process is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
        yield

_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)
_MODEL_LOAD = StateDictOptions(strict=False)


def _model_state(m: nn.Module) -> dict[str, Any]:
    """The module's state dict (a LoRA model's: its adapters and buffers only) with each
    shared tensor once: a tied output projection
    (`output.weight`, the embedding itself) is saved and loaded as `tok_embeddings.weight`
    only, on every pipeline stage that holds it. Checkpoints of earlier versions hold both
    names; the second is then simply not read."""
    sd = get_model_state_dict(m)
    names = [n for n, _ in m.named_parameters()]
    if any(is_adapter(n) for n in names):
        # A LoRA model: only the adapters are trained and saved; the frozen base comes from
        # model.init_from every time (tessel.checkpoint.lora fingerprints it).
        for n, p in m.named_parameters():
            if not p.requires_grad:
                sd.pop(n, None)
    emb, out = getattr(m, "tok_embeddings", None), getattr(m, "output", None)
    if emb is not None and out is not None and out.weight is emb.weight:
        sd.pop("output.weight", None)
    return {k: plain_tensor(v) for k, v in sd.items()}


def _optimizer_state(m: nn.Module, o: Any) -> dict[str, Any]:
    """The optimizer's flattened state dict, its tensors plain (`plain_tensor`)."""
    sd = get_optimizer_state_dict(m, o, options=_OPTIM)
    return {k: plain_tensor(v) for k, v in sd.items()}
# `no_dist` on async_save (where this torch has it): one process saves without a process group, and
# its writer thread then does not warn about it.
_ASYNC_NO_DIST = "no_dist" in inspect.signature(dcp.async_save).parameters


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Every published checkpoint directory under `root` (step_N), complete or not, oldest
    first. A save cut short is never among them: it stays `.tmp-step_N` until its state.json
    is written, and only then is it renamed into place."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and child.is_dir():
            found.append((int(m.group(1)), child))
    return sorted(found)


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first."""
    return [(step, path) for step, path in _step_dirs(root) if (path / "state.json").is_file()]


def latest_checkpoint(root: Path) -> Path | None:
    """The newest checkpoint under `root` (None when there is none). A newer step directory
    without state.json was complete when it was published and damaged since: refused
    (CheckpointError naming it) rather than passed over for an older checkpoint, since
    which one to resume from is for a person to decide."""
    found = _step_dirs(root)
    if not found:
        return None
    newest = found[-1][1]
    if not (newest / "state.json").is_file():
        raise missing_state(newest)
    return newest


def missing_state(path: Path) -> CheckpointError:
    """The error for published checkpoint `path` whose state.json is gone."""
    return CheckpointError(
        f"checkpoint {str(path)!r} is damaged: its state.json is missing (the checkpoint was "
        f"complete when saved); {MOVE_ASIDE}"
    )


# A run directory keeps its checkpoints here (tessel.train.run_dir.RunDir names it too).
CHECKPOINTS_DIR = "checkpoints"


def find_checkpoint(path: Path) -> Path | None:
    """The checkpoint `path` means: a checkpoint directory itself, or a run directory's
    latest complete checkpoint; None when it is neither (or the run has none yet)."""
    if (path / "state.json").is_file():
        return path
    if _STEP_DIR.match(path.name) and path.is_dir():  # a checkpoint directory, damaged
        raise missing_state(path)
    return latest_checkpoint(path / CHECKPOINTS_DIR)


# ---- save -------------------------------------------------------------------------------


Models = nn.Module | Sequence[nn.Module]
Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None


def _as_list(x: Any) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _state_dict(models: Models, optimizers: Optimizers) -> dict[str, Any]:
    """{"model": name -> tensor, "optim": flattened name -> state} over this rank's parts.
    Tensors may be DTensors (their global shape and this rank's slice are both recorded)."""
    ms, opts = _as_list(models), _as_list(optimizers)
    sd: dict[str, Any] = {"model": {}}
    for m in ms:
        sd["model"].update(_model_state(m))
    if opts:
        sd["optim"] = {}
        for m, o in zip(ms, opts):
            sd["optim"].update(_optimizer_state(m, o))
    return sd


def save_checkpoint(
    root: Path,
    step: int,
    models: Models,
    optimizers: Optimizers,
    state: dict[str, Any],
    tensors: dict[str, torch.Tensor] | None = None,
    keep_last: int = 3,
    async_save: bool = False,
    async_group: dist.ProcessGroup | None = None,
) -> Path | PendingSave:
    """Write checkpoint `step` atomically from every rank; returns its directory, or with
    `async_save` a PendingSave whose `finish()` publishes it once all ranks have written.

    `state` (JSON) is written by rank 0 only; `tensors` (e.g. RNG states) are saved as
    replicated tensors. An asynchronous save runs collectives from a background thread while
    training runs its own: give it a process group of its own (`async_group`, gloo)."""
    name = step_dir_name(step)
    tmp = root / f".tmp-{name}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(root)
        tmp.mkdir()
    _barrier()
    sd = _state_dict(models, optimizers)
    sd["extra"] = dict(tensors or {})

    def hash_share() -> None:
        checksum.hash_share(tmp, _rank(), _world())

    def publish() -> Path:
        final = root / name
        if _rank() == 0:
            # Content checksums (each rank hashed its share), verified whenever a file is
            # read back: a shard with flipped bytes but the right size is never trained on.
            shares = checksum.gather_shares(tmp, _world())
            files = [f for f in sorted(tmp.iterdir()) if f.is_file()]
            sizes = {f.name: f.stat().st_size for f in files}
            meta = {"format": FORMAT_VERSION, "step": step, "files": sizes,
                    checksum.DIGEST_KEY: shares, **state}
            meta[STATE_DIGEST] = state_digest(meta)  # state.json vouches for itself too
            _write_json(tmp / "state.json", meta)  # written last: its presence marks completeness
            fsync_dir(tmp)
            if final.exists():  # same step saved before (e.g. a timeline we went back from)
                trash = root / f".trash-{name}-{os.getpid()}"
                final.rename(trash)
                tmp.rename(final)
                shutil.rmtree(trash)
            else:
                tmp.rename(final)
            fsync_dir(root)
            _point_latest(root, name)
            _prune(root, keep_last)
        return final

    if async_save:
        # Tensors are staged to host memory before this returns; writing continues in the
        # background. Only rank 0 publishes, once its future (which waits for all) is done.
        single = {"no_dist": True} if not dist.is_initialized() and _ASYNC_NO_DIST else {}
        with failed_save_is_one_line(tmp, step), quiet_single_process():
            # the background thread warns too unless no_dist says it is one process
            future = dcp.async_save(sd, checkpoint_id=str(tmp), process_group=async_group,
                                    **single)
        # hashing this rank's share runs in the background too, once DCP has written
        return PendingSave(then(future, hash_share), publish, tmp, step)
    with failed_save_is_one_line(tmp, step):
        with quiet_single_process():
            dcp.save(sd, checkpoint_id=str(tmp))
        hash_share()
        _barrier()  # every rank's share of the checksums is written
        path = publish()
    _barrier()  # nobody reads `latest` before it points at the new checkpoint
    return path


# ---- load -------------------------------------------------------------------------------


def _metadata(path: Path) -> Any:
    """The checkpoint's DCP metadata, parsed without running code (see safe_load)."""
    try:
        return safe_load.read_metadata(path, digests(path))
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is damaged: its .metadata file is missing"
        ) from None
    except OSError as exc:
        raise CheckpointError(f"checkpoint {str(path)!r} is unreadable: {exc}") from None
    except safe_load.UnsafeCheckpointError as exc:
        raise CheckpointError(str(exc)) from None
    except safe_load.DamagedCheckpointError as exc:
        raise CheckpointError(f"checkpoint {str(path)!r} is damaged: {exc}; {MOVE_ASIDE}") from None


def _dcp_load(path: Path, sd: dict[str, Any], no_dist: bool = False,
              metadata: Any = None) -> None:
    """`no_dist`: this process alone reads (e.g. rank 0 exporting while the others wait)."""
    if metadata is None:
        metadata = _metadata(path)
    try:
        with quiet_single_process():
            safe_load.dcp_load(sd, path, metadata=metadata, no_dist=no_dist,
                               digests=digests(path))
    except safe_load.UnsafeCheckpointError as exc:
        raise CheckpointError(f"checkpoint {str(path)!r}: {exc}") from None
    except safe_load.DamagedCheckpointError as exc:
        raise CheckpointError(f"checkpoint {str(path)!r} is damaged: {exc}; {MOVE_ASIDE}") from None
    except (Exception, CheckpointException) as exc:  # DCP wraps per-rank failures (as a
        # BaseException); keep the last line
        first = str(exc).strip().splitlines()
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not match this model: "
            f"{short(first[-1] if first else type(exc).__name__)}"
        ) from None


def checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Global shape of every saved model tensor, from the checkpoint's metadata."""
    return _model_shapes(_metadata(path))


def _model_shapes(meta: Any) -> dict[str, tuple[int, ...]]:
    out = {}
    for key, md in meta.state_dict_metadata.items():
        if key.startswith("model.") and hasattr(md, "size"):
            out[key.removeprefix("model.")] = tuple(md.size)
    return out


def read_full(path: Path, section: str, skip: set[str] = frozenset(),
              only: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors saved under `section` ("model", "optim" or "extra"), unsharded, read by
    this process alone (e.g. to consolidate, export or compare checkpoints of any layout):
    all of them, or just the names in `only` (DCP then reads only their files' bytes)."""
    meta = _metadata(path)
    prefix = section + "."
    templates = {}
    for key, md in meta.state_dict_metadata.items():
        name = key.removeprefix(prefix)
        if not key.startswith(prefix) or not hasattr(md, "size") or name in skip:
            continue
        if only is None or name in only:
            templates[name] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    if only is not None and only - set(templates):
        missing = sorted(only - set(templates))[0]
        raise CheckpointError(f"checkpoint {str(path)!r} has no tensor {missing!r}")
    holder = {section: templates}
    _dcp_load(path, holder, no_dist=True, metadata=meta)
    return holder[section]


def load_model(path: Path, models: Models) -> None:
    """Load the checkpointed weights into `models` (a model, or this rank's stages/shards of
    one), whatever layout the checkpoint was saved under."""
    parts = _as_list(models)
    meta = _metadata(path)
    saved = _model_shapes(meta)
    for m in parts:
        sd = _model_state(m)
        missing = sorted(set(sd) - set(saved))
        if missing:
            raise CheckpointError(
                f"checkpoint {str(path)!r} does not match the model: missing {missing[:3]}"
            )
        for name, t in sd.items():
            if tuple(t.shape) != saved[name]:
                vocab = name in ("tok_embeddings.weight", "output.weight")
                raise CheckpointError(
                    f"checkpoint tensor {name!r} has shape {saved[name]}, the model expects "
                    f"{tuple(t.shape)}" + ("; its rows are the padded vocabulary: set "
                    "model.vocab_pad_to to the run's (1 for runs saved before that setting)"
                    if vocab else "")
                )
        holder = {"model": sd}
        _dcp_load(path, holder, metadata=meta)
        # Not strict: a tied output projection is absent and takes the embedding's values.
        set_model_state_dict(m, holder["model"], options=_MODEL_LOAD)


def load_optimizer(path: Path, models: Models, optimizers: Optimizers) -> None:
    """Load optimizer state saved under any layout into this rank's optimizers."""
    for m, o in zip(_as_list(models), _as_list(optimizers)):
        holder = {"optim": _optimizer_state(m, o)}
        _dcp_load(path, holder)
        set_optimizer_state_dict(m, o, holder["optim"], options=_OPTIM)


def load_tensors(path: Path, templates: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replicated extra tensors (RNG states) saved with the checkpoint, shaped like
    `templates`; keys absent from the checkpoint are left out."""
    saved = {k.removeprefix("extra.") for k in _metadata_keys(path) if k.startswith("extra.")}
    holder = {"extra": {k: v.clone() for k, v in templates.items() if k in saved}}
    if holder["extra"]:
        _dcp_load(path, holder)
    return holder["extra"]


def _metadata_keys(path: Path) -> list[str]:
    return list(_metadata(path).state_dict_metadata)


# ---- internals --------------------------------------------------------------------------


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with path.open("w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _point_latest(root: Path, name: str) -> None:
    link = root / "latest"
    tmp = root / f".latest-{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(name, tmp)
    os.replace(tmp, link)  # atomic swap of the symlink


def _prune(root: Path, keep_last: int) -> None:
    for _, path in list_checkpoints(root)[:-keep_last]:
        # Rename first: a kill during the delete then leaves a hidden leftover (swept by the
        # next save), never a step directory with state.json but missing tensors.
        trash = root / f".trash-{path.name}-{os.getpid()}"
        path.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)


def _remove_stale_temporaries(root: Path) -> None:
    for child in root.iterdir():
        if child.name.startswith((".tmp-", ".trash-")) and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
