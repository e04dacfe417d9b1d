"""Reading a DCP checkpoint without running anything it contains.

A DCP checkpoint holds two kinds of pickle: the `.metadata` file (plain `pickle.dump` of
DCP's metadata dataclasses) and, inside the `.distcp` shards, the non-tensor values of the
state dict (optimizer hyper-parameters) as `torch.save` blobs. Stock DCP reads the first with
`pickle.load` and the second with `torch.load(weights_only=False)`: either runs code from a
crafted file. Every read tessel makes goes through `dcp_load` / `read_metadata` below, which
replace both:

- `.metadata` is parsed once, here, by an unpickler that resolves exact (module, name) pairs
  from a fixed list and nothing else: no whole modules, no dotted names (pickle protocol 4
  resolves "os.system" under any module through getattr). PyTorch's own weights-only
  unpickler cannot be used for this file: it does not accept the FRAME opcode of protocol 4,
  which `pickle.dump` writes. The parsed object is handed to DCP, so DCP never unpickles the
  file itself (a check followed by a second, unguarded read would let a "stealth" payload run).
- Non-tensor values are read with `torch.load(weights_only=True)` (PyTorch's weights-only
  unpickler: primitives, containers, tensors) before DCP sees them.
- Every file the metadata points at must be a plain file name inside the checkpoint
  directory, so a crafted `.metadata` cannot read `../../etc/passwd` into a tensor.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from tessel.checkpoint import checksum
from tessel.errors import TesselError

METADATA_FILE = ".metadata"


class UnsafeCheckpointError(TesselError):
    """A checkpoint file names something a checkpoint never holds; nothing was run."""


class DamagedCheckpointError(TesselError):
    """A checkpoint file is truncated or garbled."""


def _allowed_globals() -> dict[tuple[str, str], Any]:
    """Exact (module, name) -> object: the only globals a DCP `.metadata` pickle may name.
    Each entry is a class or a pure look-up function; none can reach the OS."""
    from torch.distributed.checkpoint import filesystem as dcp_fs

    objs: list[Any] = [
        dcp_metadata.Metadata, dcp_metadata.MetadataIndex, dcp_metadata.StorageMeta,
        dcp_metadata.TensorProperties, dcp_metadata.TensorStorageMetadata,
        dcp_metadata.BytesStorageMetadata, dcp_metadata.ChunkStorageMetadata,
        dcp_metadata._MEM_FORMAT_ENCODING,  # an Enum: calling it looks a member up
        dcp_fs._StorageInfo,
        torch.Size,
    ]
    table = {(o.__module__, o.__qualname__): o for o in objs}
    # Path objects record where the checkpoint was written (StorageMeta.checkpoint_id);
    # constructing one touches no file.
    for cls in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath,
                pathlib.PureWindowsPath):
        table[("pathlib", cls.__name__)] = cls
    # torch.layout objects are pickled as a call to this look-up by name
    table[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for name in dir(torch):  # dtypes and memory formats are pickled as torch.<name>
        obj = getattr(torch, name, None)
        if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            table[("torch", name)] = obj
    return table


class _MetadataUnpickler(pickle.Unpickler):
    _globals: dict[tuple[str, str], Any] | None = None

    def find_class(self, module: str, name: str) -> Any:
        # Never super().find_class: it imports `module` and walks dotted `name`s.
        if _MetadataUnpickler._globals is None:
            _MetadataUnpickler._globals = _allowed_globals()
        try:
            return _MetadataUnpickler._globals[(module, name)]
        except KeyError:
            raise UnsafeCheckpointError(
                f"it names {module}.{name}, which a checkpoint never holds"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError("it holds a persistent reference, which a checkpoint never holds")


def read_metadata(path: Path, digests: dict[str, str] | None = None) -> dcp_metadata.Metadata:
    """The checkpoint's DCP metadata, parsed without running code, with every storage file
    checked to be a file of this checkpoint; `digests`: the checksums from state.json.
    Raises UnsafeCheckpointError / DamagedCheckpointError (one line each) or OSError."""
    meta_file = path / METADATA_FILE
    data = meta_file.read_bytes()
    expected = (digests or {}).get(METADATA_FILE)
    if expected is not None and checksum.bytes_digest(data) != expected:
        raise DamagedCheckpointError(
            f"{METADATA_FILE} does not match its checksum (the file changed after it was saved)"
        )
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"refusing to load {str(meta_file)!r}: {exc}") from None
    except Exception as exc:  # truncated or garbled: pickle raises many types
        raise DamagedCheckpointError(
            f"{str(meta_file)!r} is damaged ({type(exc).__name__}: {exc})"
        ) from None
    if not isinstance(md, dcp_metadata.Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise DamagedCheckpointError(f"{str(meta_file)!r} is damaged: it holds no DCP metadata")
    for info in (md.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or rel in ("", ".", "..") or "/" in rel or "\\" in rel:
            raise UnsafeCheckpointError(
                f"refusing to load {str(meta_file)!r}: it points at {rel!r}, outside the "
                "checkpoint directory"
            )
        if getattr(info, "transform_descriptors", None):
            raise UnsafeCheckpointError(
                f"refusing to load {str(meta_file)!r}: it asks for storage transforms "
                f"{list(info.transform_descriptors)}, which tessel never writes"
            )
    return md


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader with the metadata parsed by `read_metadata` (never `pickle.load`);
    `metadata`: already parsed by the caller, so it is not read twice."""

    def __init__(self, path: Path, metadata: dcp_metadata.Metadata | None = None,
                 digests: dict[str, str] | None = None) -> None:
        super().__init__(str(path))
        self._metadata = metadata
        self._digests = digests or {}
        self._verified: set[str] = set()
        self.damaged: str | None = None

    def read_data(self, plan: Any, planner: Any) -> Any:
        """Each file this rank reads is checked against its checksum first (once)."""
        files = {self.storage_data[item.storage_index].relative_path for item in plan.items}
        for name in sorted(files - self._verified):
            try:
                checksum.check(Path(self.path) / name, self._digests.get(name))
            except checksum.ChecksumMismatch as exc:
                self.damaged = str(exc)  # DCP wraps what a reader raises: keep our line
                raise DamagedCheckpointError(self.damaged) from None
            self._verified.add(name)
        return super().read_data(plan, planner)

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        md = self._metadata if self._metadata is not None else read_metadata(Path(self.path))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = dcp_metadata.StorageMeta()
        md.storage_meta.load_id = self.load_id  # as FileSystemReader does
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, except that non-tensor values pass PyTorch's weights-only
    unpickler first: stock DCP reads them with `torch.load(weights_only=False)`."""

    refused: str | None = None

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
            why = next((ln for ln in lines if "unsupported" in ln.lower()),
                       lines[0] if lines else "")
            # DCP wraps what a planner raises in its own multi-line exception: keep our line
            self.refused = (
                f"refusing value {read_item.dest_index.fqn!r}: it is not plain data ({why})"
            )
            raise UnsafeCheckpointError(self.refused) from None
        # The same bytes, now known to name only weights-only-safe globals, go to DCP's own
        # code, which places the value in the (possibly flattened) state dict.
        value.seek(0)
        super().load_bytes(read_item, value)


def dcp_load(state_dict: dict[str, Any], path: Path,
             metadata: dcp_metadata.Metadata | None = None, no_dist: bool = False,
             digests: dict[str, str] | None = None) -> None:
    """`torch.distributed.checkpoint.load` of checkpoint `path` into `state_dict`, through
    the safe reader and planner. `metadata`: from `read_metadata(path)`, when the caller has
    it. `no_dist`: this process alone reads; `digests`: the files' checksums (state.json).
    Raises UnsafeCheckpointError (nothing run), DamagedCheckpointError or DCP's own errors."""
    planner = SafeLoadPlanner()
    reader = SafeFileSystemReader(path, metadata, digests)
    try:
        dcp.load(state_dict, storage_reader=reader, planner=planner, no_dist=no_dist)
    except (Exception, CheckpointException):  # DCP's CheckpointException is a BaseException
        if planner.refused is not None:
            raise UnsafeCheckpointError(planner.refused) from None
        if reader.damaged is not None:
            raise DamagedCheckpointError(reader.damaged) from None
        raise
