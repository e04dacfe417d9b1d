"""Content checksums of checkpoint files: written at save, verified whenever a file is read.

The checksum is the standard CRC-32 of the whole file (zlib's, as in gzip and zip; the
`crc32` command prints the same value). It guards against damage (flipped bits, a partly
overwritten shard), not against a forger: whoever can rewrite a shard can rewrite state.json.
A cryptographic hash would cost more than the save itself can spare (SHA-256 runs at ~1.5
GB/s against CRC-32's ~3.5 GB/s per core, see benchmarks/checkpoint_save.py).

Speed comes from spreading the work: each rank hashes its share of the checkpoint's files
(not rank 0 all of them), and within a rank the file is cut into blocks hashed on a thread
pool (zlib releases the GIL) whose CRCs are joined with zlib's crc32_combine algorithm.
"""

from __future__ import annotations

import functools
import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# state.json key of the per-file checksums ({file name: 8 hex digits}).
DIGEST_KEY = "crc32"

_BLOCK = 32 << 20  # bytes per block hashed by one thread
_POLY = 0xEDB88320  # CRC-32's reflected polynomial


class ChecksumMismatch(ValueError):
    """A file's content does not match the checksum written at save."""


def _gf2_times(mat: list[int] | tuple[int, ...], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


@functools.lru_cache(maxsize=64)
def _shift_operator(length: int) -> tuple[int, ...]:
    """The GF(2) matrix that advances a CRC-32 over `length` zero bytes (zlib's
    crc32_combine, with the squarings done once per length instead of per call)."""
    op = [_POLY] + [1 << (n - 1) for n in range(1, 32)]  # one zero bit
    result = [1 << n for n in range(32)]  # identity
    for _ in range(3):  # one zero byte = eight zero bits
        op = [_gf2_times(op, v) for v in op]
    while length:
        if length & 1:
            result = [_gf2_times(op, v) for v in result]
        length >>= 1
        if length:
            op = [_gf2_times(op, v) for v in op]
    return tuple(result)


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A+B from CRC-32(A), CRC-32(B) and len(B)."""
    return _gf2_times(_shift_operator(len2), crc1) ^ crc2


def _block_crc(path: Path, offset: int, length: int) -> int:
    with path.open("rb") as f:
        f.seek(offset)
        crc, left = 0, length
        while left:
            chunk = f.read(min(left, 8 << 20))
            if not chunk:
                raise OSError(f"{path.name} shrank while it was being checked")
            crc = zlib.crc32(chunk, crc)
            left -= len(chunk)
    return crc


def _pool_size() -> int:
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else os.cpu_count() or 1))


def file_digests(paths: list[Path]) -> dict[str, str]:
    """{file name: CRC-32 as 8 hex digits} of `paths`, their blocks hashed in parallel."""
    jobs = []
    for p in paths:
        size = p.stat().st_size
        jobs.append((p, [(off, min(_BLOCK, size - off)) for off in range(0, size, _BLOCK)]))
    with ThreadPoolExecutor(_pool_size()) as pool:
        futures = [(p, [(n, pool.submit(_block_crc, p, off, n)) for off, n in blocks])
                   for p, blocks in jobs]
        out = {}
        for p, parts in futures:
            crc = 0
            for n, fut in parts:
                crc = crc32_combine(crc, fut.result(), n)
            out[p.name] = f"{crc:08x}"
    return out


def bytes_digest(data: bytes) -> str:
    return f"{zlib.crc32(data):08x}"


# Files already found to match, by (path, size, mtime, checksum): a restore reads the same
# shard for the model, the optimizer and the RNG states, and it is hashed once, not thrice.
_VERIFIED: set[tuple[str, int, int, str]] = set()


def check(path: Path, expected: str | None) -> None:
    """Raise ChecksumMismatch when `path` does not have checksum `expected` (None: written
    before checksums existed; nothing to check). A file unchanged since it last matched (same
    size and modification time) is not read again."""
    if expected is None:
        return
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, expected)
    if key in _VERIFIED:
        return
    if file_digests([path])[path.name] != expected:
        raise ChecksumMismatch(
            f"{path.name} does not match its checksum (the file changed after it was saved)"
        )
    _VERIFIED.add(key)


# ---- at save: each rank hashes its share, rank 0 gathers them ----------------------------

_SHARE = ".crc32-rank{}.json"


def _data_files(tmp: Path) -> list[Path]:
    """The files DCP wrote (never the share files ranks are writing beside them)."""
    return sorted(f for f in tmp.iterdir()
                  if f.is_file() and (f.name == ".metadata" or f.name.endswith(".distcp")))


def hash_share(tmp: Path, rank: int, world: int) -> None:
    """Hash this rank's share of the finished DCP files in `tmp` and write it beside them.

    Every rank lists the same files (DCP returns only once all have been written); sorted by
    size, file i goes to rank i % world, so the biggest are spread first."""
    files = sorted(_data_files(tmp), key=lambda f: (-f.stat().st_size, f.name))
    share = file_digests(files[rank::world])
    tmp_share = tmp / (_SHARE.format(rank) + ".part")
    tmp_share.write_text(json.dumps(share))
    tmp_share.rename(tmp / _SHARE.format(rank))


def gather_shares(tmp: Path, world: int) -> dict[str, str]:
    """Rank 0, after every rank's `hash_share`: all the checksums (share files removed)."""
    digests: dict[str, str] = {}
    for r in range(world):
        f = tmp / _SHARE.format(r)
        digests.update(json.loads(f.read_text()))
        f.unlink()
    missing = {f.name for f in _data_files(tmp)} - set(digests)
    if missing:
        raise OSError(f"no checksum was written for {sorted(missing)}")
    return digests
