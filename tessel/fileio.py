"""Durable, atomic file writes shared by checkpoints, datasets and run directories, and the
reading of JSON and TOML files whose damage (not UTF-8, not JSON or TOML, nested too deep)
is one line, not a traceback."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tessel.errors import TesselError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def fsync_dir(path: Path) -> None:
    """Make renames in `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Write via a temporary sibling and a rename: readers see the old file or the new one,
    never a partial one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_directory(out: Path) -> Iterator[Path]:
    """Fill a temporary sibling of `out` (yielded) and, if the block succeeds, make it `out`
    in one rename, replacing a previous `out`: readers see the old directory or the whole new
    one, never a partial one; on failure nothing of it is left."""
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        for f in tmp.iterdir():
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        fsync_dir(tmp)
        if out.exists():  # replace a previous one in one rename, then drop it
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
        fsync_dir(out.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_text(path: Path, what: str) -> str:
    """The UTF-8 text of `path`, or one line (a TesselError) naming `what` ("hardware file",
    ...) and the file when it is missing, unreadable or not UTF-8 text."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TesselError(f"{what} {str(path)!r} does not exist") from None
    except UnicodeDecodeError as exc:
        raise TesselError(f"{what} {str(path)!r} is not UTF-8 text (byte {exc.start}: "
                          f"{exc.reason}); pass the text file itself") from None
    except OSError as exc:
        raise TesselError(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}") from None


def read_json(path: Path, what: str) -> Any:
    """The JSON value in `path`; one line naming `what` and the file when it cannot be read,
    is not JSON, or nests too deep for Python's parser."""
    return _parsed(path, what, json.loads, json.JSONDecodeError, "JSON")


def read_toml(path: Path, what: str) -> dict[str, Any]:
    """The TOML tables in `path`; one line as `read_json` says."""
    return _parsed(path, what, tomllib.loads, tomllib.TOMLDecodeError, "TOML")


def _parsed(path: Path, what: str, parse: Callable[[str], Any], error: type[Exception],
            kind: str) -> Any:
    text = read_text(path, what)
    try:
        return parse(text)
    except error as exc:
        raise TesselError(f"{what} {str(path)!r} is not valid {kind}: {exc}") from None
    except RecursionError:
        raise TesselError(f"{what} {str(path)!r} nests its arrays or tables too deep to read "
                          f"(beyond {sys.getrecursionlimit()} levels); no file tessel reads "
                          "needs that") from None
