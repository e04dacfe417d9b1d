"""What an input file is, from its content first and its name second.

Compression is recognised by its magic bytes (gzip, zstd, bzip2, xz), whatever the file is
called; the container inside by its magic too (Parquet `PAR1`, Arrow IPC file `ARROW1`, Arrow
IPC stream as Hugging Face `datasets` writes it) and otherwise by the name left once the
compression suffix is dropped (`.jsonl`/`.json`: JSON lines; anything else: text). A file that
is recognisably binary but none of these (a zip, an executable, token ids, a NumPy array:
NUL bytes in its first block) is refused in one line naming it and the accepted formats,
never read as text: decoding binary as UTF-8 "succeeds" with replacement characters and
would put garbage into the training data.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tessel.errors import DataError

ACCEPTED = ("JSON lines (.jsonl/.json), text, Parquet, Arrow (including Hugging Face "
            "`save_to_disk` directories), each optionally compressed with gzip, zstd, bzip2 "
            "or xz (Parquet and Arrow: uncompressed)")

# Magic bytes at the start of a compressed file.
_COMPRESSION_MAGIC = (
    (b"\x1f\x8b", "gzip"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"BZh", "bzip2"),
    (b"\xfd7zXZ\x00", "xz"),
)
_COMPRESSION_SUFFIXES = {".gz": "gzip", ".gzip": "gzip", ".zst": "zstd", ".zstd": "zstd",
                         ".bz2": "bzip2", ".xz": "xz"}
# Binary formats users hand over by mistake, named so the refusal can say what the file is.
_BINARY_MAGIC = (
    (b"MMIDIDX\x00\x00", "a Megatron index (.idx); name its prefix in data.paths instead"),
    (b"TESSELIX", "a tessel index (.idx); name its prefix in data.paths instead"),
    (b"PK\x03\x04", "a zip archive; unpack it"),
    (b"\x7fELF", "an executable"),
    (b"\x93NUMPY", "a NumPy array"),
    (b"\x89PNG", "an image"),
    (b"%PDF", "a PDF; extract its text first"),
    (b"SQLite format 3\x00", "an SQLite database"),
)
_SNIFF = 8192  # bytes looked at to tell text from binary


@dataclass(frozen=True)
class FileFormat:
    kind: str
    """`jsonl`, `text`, `parquet` or `arrow`."""
    compression: str | None
    """`gzip`, `zstd`, `bzip2`, `xz` or None."""


def _magic_compression(head: bytes) -> str | None:
    return next((name for magic, name in _COMPRESSION_MAGIC if head.startswith(magic)), None)


def open_decompressed(path: Path, compression: str | None) -> IO[bytes]:
    """`path` opened for reading, decompressed as it streams (the caller closes it)."""
    if compression == "gzip":
        return gzip.open(path, "rb")
    if compression == "bzip2":
        return bz2.open(path, "rb")
    if compression == "xz":
        return lzma.open(path, "rb")
    if compression == "zstd":
        try:
            import zstandard
        except ImportError:  # a dependency of tessel; only a broken install lacks it
            raise DataError(f"{path}: reading zstd needs the zstandard package; "
                            "pip install zstandard") from None
        return io.BufferedReader(_ZstdFrames(path, zstandard), 1 << 20)
    return open(path, "rb")


class _ZstdFrames(io.RawIOBase):
    """A zstd file decompressed as it is read, frame after frame (shards are often many
    frames), and an error, not a short read, when it ends inside a frame (truncated): the
    zstandard package's own stream reader returns what it has and says nothing."""

    def __init__(self, path: Path, zstandard: Any) -> None:
        self._file = open(path, "rb")
        self._zstd = zstandard
        self._frame = zstandard.ZstdDecompressor().decompressobj()
        self._in_frame = False
        self._pending, self._pos = b"", 0  # decompressed, not yet read

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while self._pos == len(self._pending):
            chunk = self._file.read(1 << 20)
            if not chunk:
                if self._in_frame:
                    raise EOFError("the file ends inside a zstd frame (truncated)")
                return 0
            out = []
            while chunk:
                self._in_frame = True
                out.append(self._frame.decompress(chunk))
                if not self._frame.eof:
                    break
                chunk = self._frame.unused_data  # the next frame starts here
                self._frame = self._zstd.ZstdDecompressor().decompressobj()
                self._in_frame = False
            self._pending, self._pos = b"".join(out), 0
        n = min(len(buffer), len(self._pending) - self._pos)
        buffer[:n] = self._pending[self._pos:self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self._file.close()
        super().close()


def _decompress_errors() -> tuple[type[BaseException], ...]:
    errors: tuple[type[BaseException], ...] = (EOFError, OSError, zlib.error, lzma.LZMAError,
                                               gzip.BadGzipFile)
    try:
        import zstandard

        errors += (zstandard.ZstdError,)
    except ImportError:
        pass
    return errors


# What the decompressors raise on a damaged or truncated stream (computed once).
DECOMPRESS_ERRORS = _decompress_errors()


def bad_compressed(path: Path, compression: str | None, exc: BaseException) -> DataError:
    """The one-line refusal of a damaged or truncated compressed file."""
    return DataError(f"{path}: not a valid {compression} file ({exc}); "
                     "re-compress or decompress it")


def _inner_suffix(path: Path) -> str:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in _COMPRESSION_SUFFIXES:
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes else ""


def detect(path: Path) -> FileFormat:
    """The format of `path` (see the module docstring); DataError for what tessel cannot
    read, naming the file and what it looks like."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError as exc:
        raise DataError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    compression = _magic_compression(head)
    named = _COMPRESSION_SUFFIXES.get(path.suffix.lower())
    if named is not None and compression is None:
        raise DataError(f"{path}: not a valid {named} file (no {named} header: the file is "
                        "damaged or misnamed); rename or re-compress it")
    if compression is not None:
        try:
            with open_decompressed(path, compression) as f:
                inner = f.read(_SNIFF)
        except DECOMPRESS_ERRORS as exc:
            raise bad_compressed(path, compression, exc) from None
    else:
        with open(path, "rb") as f:
            inner = f.read(_SNIFF)
    suffix = _inner_suffix(path)
    if inner.startswith(b"PAR1") or suffix == ".parquet":
        kind = "parquet"
    elif inner.startswith(b"ARROW1") or inner.startswith(b"\xff\xff\xff\xff") \
            or suffix == ".arrow":
        kind = "arrow"
    elif suffix in (".jsonl", ".json"):
        kind = "jsonl"
    else:
        kind = "text"
    if kind in ("parquet", "arrow") and compression is not None:
        raise DataError(f"{path}: {compression}-compressed {kind.capitalize()} is not supported; "
                        f"decompress it ({kind.capitalize()} compresses its columns itself)")
    if kind in ("jsonl", "text"):
        _refuse_binary(path, inner)
    return FileFormat(kind, compression)


def _refuse_binary(path: Path, inner: bytes) -> None:
    what = next((name for magic, name in _BINARY_MAGIC if inner.startswith(magic)), None)
    if what is None and _magic_compression(inner) is not None:
        what = "compressed twice"
    if what is None and b"\x00" in inner:
        what = "binary data (NUL bytes), e.g. token ids or an archive"
    if what is not None:
        raise DataError(f"{path}: looks like {what}, not text; tessel reads {ACCEPTED}")


def check_decoded(path: Path, text: str, replaced: int, where: str = "") -> None:
    """Refuse a document that is mostly not UTF-8 (binary read as text, or a whole text in
    another encoding): more than 8 replaced characters making up more than half of it.
    Anything less (a mangled name, a Latin-1 file's accents, Python's own KOI8-R test module
    at 42%) is let through, the bytes replaced by U+FFFD and the document counted."""
    if replaced > 8 and replaced > 0.5 * len(text):
        raise DataError(f"{path}{where}: {replaced} of {len(text)} characters are not UTF-8; "
                        "this is binary data or another encoding: convert it to UTF-8 "
                        f"(tessel reads {ACCEPTED})")
