"""The data cache (`data.cache_dir`, `$TESSEL_CACHE`, `~/.cache/tessel`): tokenized corpora
built once under a content key and shared by every later run."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

STALE_SECONDS = 24 * 3600.0
"""A temporary build directory untouched for this long is one a killed process left (a build
writes into it all along; the SFT preparation only once its data is ready), removed by the
next build of the same target."""


def default_cache_dir() -> Path:
    env = os.environ.get("TESSEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tessel"


def data_cache_dir(data: Any) -> Path:
    """The cache of a run's `data` config section: data.cache_dir, else the default."""
    return Path(data.cache_dir) if data.cache_dir else default_cache_dir()


def build_once(target: Path | None, build: Callable[[Path], Path | None],
               cache: Path | None = None, marker: str = "data.idx") -> Path:
    """`target`, a directory holding `marker` (`data.idx`) when complete; when absent, `build(tmp)` fills
    a private temporary directory that is then renamed to `target`. A failure leaves nothing
    behind; two processes building at once both succeed and one's result is kept. With
    `target=None` (named by what is built), `build` returns the target once it has built,
    and the temporary directory is made in `cache`."""
    if target is not None and (target / marker).is_file():
        return target
    where = target.parent if target is not None else cache
    assert where is not None, "build_once needs a target or a cache directory"
    where.mkdir(parents=True, exist_ok=True)
    if target is not None:
        _remove_stale(where, f".tmp-{target.name}-")
    # A directory of its own, not one named by the pid: the processes of several machines
    # sharing this cache (a cluster's shared home) may have the same pid.
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name if target else 'build'}-", dir=where))
    try:
        named = build(tmp)
        target = target or named
        assert target is not None, "build must name its target"
        try:
            tmp.rename(target)
        except OSError:  # built concurrently (or earlier, for the same content): use that
            if not (target / marker).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _remove_stale(where: Path, prefix: str) -> None:
    """Remove the temporary directories `where/prefix*` no process has touched for
    `STALE_SECONDS` (another machine's build under way keeps its own fresh)."""
    now = time.time()
    for tmp in where.glob(f"{prefix}*"):
        try:
            if now - tmp.stat().st_mtime > STALE_SECONDS:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:  # removed meanwhile by another process
            pass
