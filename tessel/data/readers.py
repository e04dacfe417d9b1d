"""Raw documents from files, streamed one at a time (memory does not grow with the corpus).

Inputs are paths, directories or glob patterns. Each file's format comes from its name:

- `*.jsonl`, `*.json`: one JSON object per line, one document per line, the text under
  `json_key`; blank lines are skipped; a line that is not a JSON object holding a string
  under that key is a `DataError` naming `file:line`.
- `*.parquet`: the string column `json_key`, read in row batches (needs `pyarrow`).
- anything else: a text file, the whole file one document.
- `*.gz`: any of the above, gzip-compressed (`corpus.jsonl.gz`, `book.txt.gz`).

Directories are walked recursively in sorted order (hidden files and directories, such as
`.git`, are skipped), so the document order, and with it every dataset made from it, is
deterministic. Bytes that are not UTF-8 are replaced (U+FFFD) and the documents where that
happened are counted; empty documents are skipped and counted (`ReadStats`).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tessel.errors import DataError

_GLOB_CHARS = frozenset("*?[")
_PARQUET_BATCH_ROWS = 1024
"""Rows per Parquet read: enough to amortise Arrow's per-batch cost, small enough that a
batch of long documents stays a few MB."""

InputPath = str | os.PathLike[str]


@dataclass
class ReadStats:
    """Counters filled in while `iter_documents` streams (read them once it is exhausted)."""

    files: int = 0
    """Files opened."""
    documents: int = 0
    """Documents yielded (not counting the skipped empty ones)."""
    bytes_read: int = 0
    """Uncompressed bytes read from the inputs (JSON syntax included for JSONL)."""
    empty_skipped: int = 0
    """Empty documents ("" after decoding), skipped."""
    invalid_utf8: int = 0
    """Yielded documents in which bytes that are not UTF-8 were replaced by U+FFFD."""


def resolve_inputs(inputs: InputPath | Sequence[InputPath]) -> list[Path]:
    """The files `inputs` name, in the order they will be read.

    Each input is a file, a directory (all its files, recursively, sorted; hidden entries
    skipped) or, when no such path exists, a glob pattern (`**` allowed), whose matches are
    sorted. Raises `DataError` for a path that does not exist, a pattern that matches nothing,
    or inputs that hold no files at all.
    """
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    if not inputs:
        raise DataError("no inputs given; pass files, directories or glob patterns")
    files: list[Path] = []
    for raw in inputs:
        path = Path(raw)
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files.extend(_walk(path))
        elif _GLOB_CHARS & set(str(raw)):
            matches = sorted(glob.glob(str(raw), recursive=True))
            if not matches:
                raise DataError(f"input pattern {str(raw)!r} matches no files")
            for match in matches:
                m = Path(match)
                files.extend(_walk(m) if m.is_dir() else [m] if m.is_file() else [])
        else:
            raise DataError(f"input {str(raw)!r} does not exist; pass existing files or directories")
    if not files:
        raise DataError(f"inputs {[str(i) for i in inputs]} hold no files")
    return files


def _walk(root: Path) -> list[Path]:
    """Every non-hidden file under `root`, sorted by path (deterministic on every filesystem)."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]  # prune .git and friends
        found.extend(Path(dirpath, f) for f in filenames if not f.startswith("."))
    return sorted(found, key=lambda p: p.relative_to(root).parts)


def file_format(path: Path) -> tuple[str, bool]:
    """(format, gzipped) from the file name: format is `jsonl`, `parquet` or `text`."""
    suffixes = [s.lower() for s in path.suffixes]
    gz = bool(suffixes) and suffixes[-1] == ".gz"
    inner = suffixes[-2] if gz and len(suffixes) > 1 else (suffixes[-1] if suffixes and not gz else "")
    if inner in (".jsonl", ".json"):
        return "jsonl", gz
    if inner == ".parquet":
        return "parquet", gz
    return "text", gz


def iter_documents(
    inputs: InputPath | Sequence[InputPath],
    json_key: str = "text",
    stats: ReadStats | None = None,
) -> Iterator[str]:
    """Stream the non-empty documents of `inputs` (see the module docstring for formats).

    The inputs are resolved now, so a missing path raises here, before anything is read;
    the documents are read lazily as the iterator is consumed. Pass a `ReadStats` to count
    files, bytes, empty and invalid-UTF-8 documents.
    """
    files = resolve_inputs(inputs)
    for path in files:  # fail before reading anything, not after the first files
        fmt, gz = file_format(path)
        if fmt == "parquet" and gz:
            raise DataError(f"{path}: gzip-compressed Parquet is not supported; decompress it "
                            "(Parquet compresses its columns itself)")
        if fmt == "parquet":
            _require_pyarrow(path)
    return _documents(files, json_key, stats if stats is not None else ReadStats())


def _documents(files: list[Path], json_key: str, stats: ReadStats) -> Iterator[str]:
    for path in files:
        stats.files += 1
        fmt, gz = file_format(path)
        if fmt == "parquet":
            docs = _parquet_documents(path, json_key, stats)
        else:
            docs = _jsonl_documents(path, gz, json_key, stats) if fmt == "jsonl" else \
                _text_document(path, gz, stats)
        for doc in docs:
            if doc:
                stats.documents += 1
                yield doc
            else:
                stats.empty_skipped += 1


def _open(path: Path, gz: bool) -> IO[bytes]:
    return gzip.open(path, "rb") if gz else open(path, "rb")  # closed by the caller


def _decode(raw: bytes, stats: ReadStats) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        stats.invalid_utf8 += 1
        return raw.decode("utf-8", errors="replace")


def _text_document(path: Path, gz: bool, stats: ReadStats) -> Iterator[str]:
    # One file is one document, so memory is bounded by the largest file, not the corpus.
    try:
        with _open(path, gz) as f:
            raw = f.read()
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise DataError(f"{path}: not a valid gzip file ({exc}); re-compress or decompress it") from None
    stats.bytes_read += len(raw)
    yield _decode(raw, stats)


def _jsonl_documents(path: Path, gz: bool, json_key: str, stats: ReadStats) -> Iterator[str]:
    try:
        with _open(path, gz) as f:
            for lineno, line in enumerate(f, 1):
                stats.bytes_read += len(line)
                if line.isspace():
                    continue  # blank lines (often one at the end) hold no document
                yield _json_text(line, path, lineno, json_key, stats)
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise DataError(f"{path}: not a valid gzip file ({exc}); re-compress or decompress it") from None


def _json_text(line: bytes, path: Path, lineno: int, json_key: str, stats: ReadStats) -> str:
    """The document of one JSONL line; `DataError` naming file:line when there is none."""
    try:
        text = line.decode("utf-8")
        replaced = False
    except UnicodeDecodeError:
        text, replaced = line.decode("utf-8", errors="replace"), True
    try:
        obj: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno}); "
                        "JSONL inputs need one JSON object per line") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}; "
                        "JSONL inputs need one object per line")
    if json_key not in obj:
        keys = ", ".join(map(repr, list(obj)[:8])) or "none"
        raise DataError(f"{path}:{lineno}: no {json_key!r} key (keys: {keys}); set the JSON key "
                        "to the field that holds the text")
    doc = obj[json_key]
    if not isinstance(doc, str):
        raise DataError(f"{path}:{lineno}: {json_key!r} holds a {type(doc).__name__}, not a string")
    # A JSON escape like "\udc80" decodes to a lone surrogate, which is not UTF-8 either and
    # which the tokenizer cannot take; the substring test keeps the common case free.
    if (b"\\ud" in line or b"\\uD" in line) and not _is_utf8_clean(doc):
        doc, replaced = doc.encode("utf-8", errors="replace").decode("utf-8"), True
    if replaced and doc:
        stats.invalid_utf8 += 1
    return doc


def _is_utf8_clean(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _require_pyarrow(path: Path) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow; pip install pyarrow") from None
    return pq


def _parquet_documents(path: Path, json_key: str, stats: ReadStats) -> Iterator[str]:
    pq = _require_pyarrow(path)
    import pyarrow as pa

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from None
    if json_key not in pf.schema_arrow.names:
        raise DataError(f"{path}: no column {json_key!r} (columns: {', '.join(pf.schema_arrow.names)}); "
                        "set the JSON key to the column that holds the text")
    kind = pf.schema_arrow.field(json_key).type
    binary = pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
    if not (binary or pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"{path}: column {json_key!r} is {kind}, not a string column")
    row = 0
    for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[json_key]):
        for value in batch.column(0).to_pylist():
            if value is None:
                raise DataError(f"{path}: row {row}: {json_key!r} is null; drop or fill such rows")
            row += 1
            if binary:  # raw bytes: decode like a text file
                stats.bytes_read += len(value)
                yield _decode(value, stats)
            else:  # Arrow strings are valid UTF-8 by construction
                stats.bytes_read += len(value.encode("utf-8"))
                yield value
