"""Reading and writing Hugging Face model directories: config.json, model.safetensors (or
shards + model.safetensors.index.json) and the tokenizer files, tensor by tensor.

Reading opens each safetensors file lazily and returns one tensor at a time (memory-mapped
by safetensors), so a conversion holds one tensor, not the model. Writing fills one shard at
a time (HF's layout: model-00001-of-00003.safetensors + an index above the shard size) into a
temporary directory that is renamed into place when everything is written.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tessel.checkpoint.errors import check_finite
from tessel.checkpoint.hf_arch import HFError
from tessel.fileio import atomic_directory
from tessel.fileio import read_json as read_json_file

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DEFAULT_SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size


def read_json(path: Path) -> dict[str, Any]:
    data = read_json_file(path, "HF file")  # missing, not UTF-8, not JSON, too deep: one line
    if not isinstance(data, dict):
        raise HFError(f"{str(path)!r} does not hold a JSON object")
    return data


def _open(file: Path):  # noqa: ANN202
    try:
        return safe_open(str(file), framework="pt")
    except Exception as exc:  # SafetensorError: damaged or not safetensors at all
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise HFError(f"{str(file)!r} is not a readable safetensors file ({first})") from None


class HFReader:
    """The tensors of an HF model directory, by name, one at a time."""

    def __init__(self, root: Path):
        self.root = root
        self.config = read_json(root / "config.json")
        if (root / INDEX).is_file():
            weight_map = read_json(root / INDEX).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise HFError(f"{str(root / INDEX)!r} has no weight_map")
            for f in set(weight_map.values()):
                # A shard is a file of this directory: a crafted index must not make tessel
                # read files elsewhere (`../other/model.safetensors`, an absolute path).
                if not isinstance(f, str) or Path(f).name != f or f in (".", ".."):
                    raise HFError(
                        f"{str(root / INDEX)!r} names the shard {f!r}, which is not a file of "
                        f"{str(root)!r}; a weight_map lists file names inside the model directory"
                    )
            self.files = {name: root / f for name, f in weight_map.items()}
        elif (root / SINGLE).is_file():
            self.files = {name: root / SINGLE for name in _open(root / SINGLE).keys()}
        else:
            raise HFError(f"{str(root)!r} has neither {SINGLE} nor {INDEX}; tessel reads "
                          "safetensors weights (save with safe_serialization=True)")
        self._open: dict[Path, Any] = {}

    def names(self) -> set[str]:
        return set(self.files)

    def get(self, name: str, *alternatives: str) -> torch.Tensor:
        """Tensor `name`, or else the first of `alternatives` (other names the same tensor
        is saved under) that the checkpoint has."""
        for candidate in (name, *alternatives):
            file = self.files.get(candidate)
            if file is not None:
                if not file.is_file():
                    raise HFError(f"{str(file)!r} (holding {candidate!r}) does not exist")
                if file not in self._open:
                    self._open[file] = _open(file)
                try:
                    tensor = self._open[file].get_tensor(candidate)
                except Exception as exc:  # safetensors' own error types
                    raise HFError(f"{str(file)!r}: cannot read tensor {candidate!r} "
                                  f"({str(exc).splitlines()[0] if str(exc) else exc})") from None
                return check_finite(tensor, candidate, repr(str(file)))
        raise HFError(f"{str(self.root)!r}: tensor {name!r} is missing from the checkpoint")

    def close(self) -> None:
        self._open.clear()


def write_hf(out: Path, config: dict[str, Any], tensors: Iterable[tuple[str, torch.Tensor]],
             tokenizer_files: dict[str, str], max_shard_bytes: int = DEFAULT_SHARD_BYTES,
             dtype: torch.dtype | None = None) -> tuple[int, int]:
    """Write an HF model directory at `out` atomically; returns (tensors, bytes). `tensors`
    is consumed one at a time; a shard is written as soon as it is full."""
    with atomic_directory(out) as tmp:
        current: dict[str, torch.Tensor] = {}
        size = total = count = 0
        written: list[tuple[str, list[str]]] = []

        def flush() -> None:
            nonlocal current, size
            if current:
                name = f".shard-{len(written):05d}.safetensors"
                save_file(current, str(tmp / name), metadata={"format": "pt"})
                written.append((name, list(current)))
                current, size = {}, 0

        for name, tensor in tensors:
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            tensor = check_finite(tensor.contiguous(), name, f"the export to {str(out)!r}")
            nbytes = tensor.numel() * tensor.element_size()
            if current and size + nbytes > max_shard_bytes:
                flush()
            current[name] = tensor
            size += nbytes
            total += nbytes
            count += 1
        flush()
        weight_map: dict[str, str] = {}
        if len(written) == 1:
            os.replace(tmp / written[0][0], tmp / SINGLE)
        else:
            for i, (name, names) in enumerate(written, 1):
                final = f"model-{i:05d}-of-{len(written):05d}.safetensors"
                os.replace(tmp / name, tmp / final)
                weight_map.update({n: final for n in names})
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX).write_text(json.dumps(index, indent=2))
        config = {**config, "torch_dtype": str(dtype or torch.float32).removeprefix("torch.")}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for fname, text in tokenizer_files.items():
            (tmp / fname).write_text(text)
    return count, total

