"""Raw documents from files, streamed one at a time (memory does not grow with the corpus).

Inputs are paths, directories or glob patterns. Each file's format is recognised by its
content first (`tessel.data.formats`): gzip/zstd/bzip2/xz compression by its magic bytes,
Parquet and Arrow by theirs; otherwise the name decides:

- `*.jsonl`, `*.json`: one JSON object per line, one document per line, the text under
  `json_key`; blank lines are skipped; a line that is not a JSON object holding a string
  under that key is a `DataError` naming `file:line`.
- Parquet, Arrow (IPC file or stream, as Hugging Face `datasets` writes): the string column
  `json_key`, read in record batches (needs `pyarrow`).
- anything else: a text file, the whole file one document.

A Hugging Face `save_to_disk` directory (its `state.json` lists `data-*.arrow` files) is read
as those Arrow files in their order. Other directories are walked recursively in sorted order
(hidden files and directories, such as `.git`, are skipped), so the document order, and with
it every dataset made from it, is deterministic. Binary files that are none of these are
refused, not read as text. A few bytes that are not UTF-8 are replaced (U+FFFD) and the
documents where that happened are counted; a document that is mostly not UTF-8 is refused.
Empty documents are skipped and counted (`ReadStats`).
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessel.data.formats import (
    DECOMPRESS_ERRORS,
    bad_compressed,
    check_decoded,
    detect,
    open_decompressed,
)
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
            files.extend(_hf_saved(path) or _walk(path))
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


def _hf_saved(root: Path) -> list[Path] | None:
    """The Arrow files of a Hugging Face `save_to_disk` directory, in its order (None: not
    one). A DatasetDict directory (one sub-directory per split) is refused: name the split."""
    if (root / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in root.iterdir() if (p / "state.json").is_file())
        raise DataError(f"{root} is a Hugging Face DatasetDict; name one split's directory, "
                        f"e.g. {root / (splits[0] if splits else 'train')}")
    state = root / "state.json"
    if not (state.is_file() and (root / "dataset_info.json").is_file()):
        return None
    try:
        listed = json.loads(state.read_text())["_data_files"]
        names = [entry["filename"] for entry in listed]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{state}: not a Hugging Face dataset state file ({exc!r}); "
                        "re-save the dataset with save_to_disk") from None
    files = []
    for name in names:
        if not isinstance(name, str) or Path(name).name != name or name.startswith("."):
            raise DataError(f"{state}: data file {name!r} is not a plain file name in {root}")
        if not (root / name).is_file():
            raise DataError(f"{state}: lists {name}, which is missing from {root}")
        files.append(root / name)
    return files


def _walk(root: Path) -> list[Path]:
    """Every non-hidden file under `root`, sorted by path (deterministic on every filesystem)."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]  # prune .git and friends
        found.extend(Path(dirpath, f) for f in filenames if not f.startswith("."))
    return sorted(found, key=lambda p: p.relative_to(root).parts)


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
    # Every file's format is settled before any is read: a bad one fails now, not after hours.
    formats = {path: detect(path) for path in files}
    if any(f.kind in ("parquet", "arrow") for f in formats.values()):
        _require_pyarrow(next(p for p, f in formats.items() if f.kind in ("parquet", "arrow")))
    return _documents(files, formats, json_key, stats if stats is not None else ReadStats())


def _documents(files: list[Path], formats: dict[Path, Any], json_key: str,
               stats: ReadStats) -> Iterator[str]:
    for path in files:
        stats.files += 1
        fmt = formats[path]
        if fmt.kind in ("parquet", "arrow"):
            docs = _columnar_documents(path, fmt.kind, json_key, stats)
        elif fmt.kind == "jsonl":
            docs = _jsonl_documents(path, fmt.compression, json_key, stats)
        else:
            docs = _text_document(path, fmt.compression, stats)
        for doc in docs:
            if doc:
                stats.documents += 1
                yield doc
            else:
                stats.empty_skipped += 1


def _decode(raw: bytes, path: Path, stats: ReadStats, where: str = "") -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        check_decoded(path, text, text.count("\ufffd") - raw.count("\ufffd".encode()), where)
        stats.invalid_utf8 += 1
        return text


def _text_document(path: Path, compression: str | None, stats: ReadStats) -> Iterator[str]:
    # One file is one document, so memory is bounded by the largest file, not the corpus.
    try:
        with open_decompressed(path, compression) as f:
            raw = f.read()
    except DECOMPRESS_ERRORS as exc:
        raise bad_compressed(path, compression, exc) from None
    stats.bytes_read += len(raw)
    yield _decode(raw, path, stats)


def _jsonl_documents(path: Path, compression: str | None, json_key: str,
                     stats: ReadStats) -> Iterator[str]:
    try:
        with open_decompressed(path, compression) as f:
            for lineno, line in enumerate(f, 1):
                stats.bytes_read += len(line)
                if line.isspace():
                    continue  # blank lines (often one at the end) hold no document
                yield _json_text(line, path, lineno, json_key, stats)
    except DECOMPRESS_ERRORS as exc:
        if isinstance(exc, OSError) and not compression:
            raise
        raise bad_compressed(path, compression, exc) from None


def _json_text(line: bytes, path: Path, lineno: int, json_key: str, stats: ReadStats) -> str:
    """The document of one JSONL line; `DataError` naming file:line when there is none."""
    try:
        text = line.decode("utf-8")
        replaced = False
    except UnicodeDecodeError:
        text, replaced = line.decode("utf-8", errors="replace"), True
    obj = _json_object(text, path, lineno)
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
        check_decoded(path, doc, doc.count("\ufffd") - line.count("\ufffd".encode()),
                      f":{lineno}")
        stats.invalid_utf8 += 1
    return doc


def _json_object(text: str, path: Path, lineno: int) -> dict[str, Any]:
    """The JSON object of one JSONL line; `DataError` naming file:line when it is not one."""
    try:
        obj: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno}); "
                        "JSONL inputs need one JSON object per line") from None
    except RecursionError:  # Python's parser recurses once per level
        raise DataError(f"{path}:{lineno}: JSON nested too deeply to read (more than about "
                        f"{sys.getrecursionlimit()} levels); JSONL inputs need one JSON object "
                        "per line") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}; "
                        "JSONL inputs need one object per line")
    return obj


def _is_utf8_clean(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _require_pyarrow(path: Path) -> None:
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise DataError(f"{path}: reading Parquet or Arrow needs pyarrow; pip install pyarrow") from None


def _open_columnar(path: Path, kind: str) -> tuple[Any, Callable[[list[str] | None], Iterator[Any]]]:
    """(schema, batches(columns)) of a Parquet or Arrow (IPC file or stream) file: its record
    batches, of `columns` only where the format reads columns alone (Parquet; None: all)."""
    _require_pyarrow(path)
    import pyarrow as pa
    import pyarrow.ipc as ipc
    import pyarrow.parquet as pq

    try:
        if kind == "parquet":
            pf = pq.ParquetFile(path)
            return pf.schema_arrow, lambda columns: pf.iter_batches(
                batch_size=_PARQUET_BATCH_ROWS, columns=columns)
        source = pa.memory_map(str(path))  # Arrow's own zero-copy reading
        try:
            reader: Any = ipc.open_file(source)
        except pa.ArrowInvalid:
            source.seek(0)
            reader = ipc.open_stream(source)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: not a readable {kind.capitalize()} file ({exc})") from None
    if isinstance(reader, ipc.RecordBatchFileReader):
        return reader.schema, lambda _: (reader.get_batch(i)
                                         for i in range(reader.num_record_batches))
    return reader.schema, lambda _: iter(reader)


def _columnar_documents(path: Path, kind: str, json_key: str, stats: ReadStats) -> Iterator[str]:
    """The `json_key` column of a Parquet or Arrow (IPC file or stream) file, batch by batch."""
    import pyarrow as pa

    schema, batches = _open_columnar(path, kind)
    if json_key not in schema.names:
        raise DataError(f"{path}: no column {json_key!r} (columns: {', '.join(schema.names)}); "
                        "set the JSON key to the column that holds the text")
    # Parquet reads the one column (index 0 of its batches); Arrow's batches hold them all
    column = 0 if kind == "parquet" else schema.get_field_index(json_key)
    value_type = schema.field(json_key).type
    binary = pa.types.is_binary(value_type) or pa.types.is_large_binary(value_type)
    if not (binary or pa.types.is_string(value_type) or pa.types.is_large_string(value_type)):
        raise DataError(f"{path}: column {json_key!r} is {value_type}, not a string column")
    row = 0
    try:
        for batch in batches([json_key]):
            for value in batch.column(column).to_pylist():
                if value is None:
                    raise DataError(f"{path}: row {row}: {json_key!r} is null; drop or fill such rows")
                if binary:  # raw bytes: decode like a text file
                    stats.bytes_read += len(value)
                    yield _decode(value, path, stats, f": row {row}")
                else:  # Arrow strings are valid UTF-8 by construction
                    stats.bytes_read += len(value.encode("utf-8"))
                    yield value
                row += 1
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: damaged after row {row} ({exc})") from None


def _columnar_records(path: Path, kind: str, stats: ReadStats) -> Iterator[tuple[str, dict[str, Any]]]:
    """("file: row N", the row as a dict) for every row of a Parquet or Arrow file (a Hugging
    Face `save_to_disk` directory's files too): fine-tuning records in columns, nested ones
    (conversations: lists of {role, content}) as the lists and dicts JSON would give.
    Arrow strings are valid UTF-8 by construction; what a record holds is checked by its
    reader (a null or a wrong type is that record's one-line error)."""
    import pyarrow as pa

    _, batches = _open_columnar(path, kind)
    row = 0
    try:
        for batch in batches(None):
            stats.bytes_read += batch.nbytes
            for obj in batch.to_pylist():
                stats.documents += 1
                yield f"{path}: row {row}", obj
                row += 1
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: damaged after row {row} ({exc})") from None


def iter_json_records(inputs: InputPath | Sequence[InputPath],
                      stats: ReadStats | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """("file:line", object) for every JSON object line of the JSONL `inputs` (compressed
    ones too, decided by their magic bytes as for `iter_documents`); blank lines are
    skipped. Parquet and Arrow inputs (Hugging Face `save_to_disk` directories too) give
    ("file: row N", the row as a dict) instead (`_columnar_records`). A line that is not a
    JSON object, or an input in another format, is a `DataError` naming it. The inputs are
    resolved and their formats checked before the first record is read.

    Text that is not UTF-8 is handled as `iter_documents` handles it, string by string:
    bytes that are not UTF-8 (and lone surrogates such as a JSON "\\ud800", which no
    tokenizer takes) are replaced by U+FFFD and the record is counted in `stats.invalid_utf8`;
    a string where more than 8 characters, and more than half of them, are not UTF-8 is
    refused (binary data or another encoding)."""
    files = resolve_inputs(inputs)
    formats = {path: detect(path) for path in files}
    for path, fmt in formats.items():
        if fmt.kind not in ("jsonl", "parquet", "arrow"):
            raise DataError(f"{path}: not JSON lines, Parquet or Arrow ({fmt.kind}); fine-tuning "
                            "records are JSONL (.jsonl, optionally .gz/.zst, one record per "
                            "line), Parquet, Arrow or a Hugging Face save_to_disk directory")
        if fmt.kind in ("parquet", "arrow"):
            _require_pyarrow(path)
    return _json_records(files, formats, stats if stats is not None else ReadStats())


def _json_records(files: list[Path], formats: dict[Path, Any],
                  stats: ReadStats) -> Iterator[tuple[str, dict[str, Any]]]:
    for path in files:
        stats.files += 1
        if formats[path].kind in ("parquet", "arrow"):
            yield from _columnar_records(path, formats[path].kind, stats)
            continue
        compression = formats[path].compression
        try:
            with open_decompressed(path, compression) as f:
                for lineno, line in enumerate(f, 1):
                    stats.bytes_read += len(line)
                    if line.isspace():
                        continue
                    yield f"{path}:{lineno}", _json_record(line, path, lineno, stats)
        except DECOMPRESS_ERRORS as exc:
            if isinstance(exc, OSError) and not compression:
                raise
            raise bad_compressed(path, compression, exc) from None


def _json_record(line: bytes, path: Path, lineno: int, stats: ReadStats) -> dict[str, Any]:
    try:
        text, dirty = line.decode("utf-8"), b"\\ud" in line or b"\\uD" in line
    except UnicodeDecodeError:  # the bad bytes become U+DC80..U+DCFF, put right below
        text, dirty = line.decode("utf-8", errors="surrogateescape"), True
    obj = _json_object(text, path, lineno)
    if dirty and _clean_strings(obj, path, f":{lineno}"):
        stats.invalid_utf8 += 1
    stats.documents += 1
    return obj


SURROGATE = re.compile("[\ud800-\udfff]")
"""A UTF-16 surrogate code point: in a Python string, a lone JSON escape such as \\ud800 or a
byte that was not UTF-8 (surrogateescape); no tokenizer takes either."""
_NOT_AN_ESCAPED_BYTE = re.compile("[\ud800-\udc7f\udd00-\udfff]")


def _clean_strings(obj: dict[str, Any], path: Path, where: str) -> bool:
    """Replace, in place, what is not UTF-8 in every string of `obj` (keys too); whether
    anything was. Iterative: the object may be nested as deep as the JSON parser allows."""
    replaced = False

    def clean(s: str) -> str:
        nonlocal replaced
        if s.isascii() or not SURROGATE.search(s):
            return s
        # lone surrogates (JSON escapes) first, then the escaped bytes decoded as
        # `iter_documents` decodes a line (one U+FFFD per invalid sequence)
        fixed, count = _NOT_AN_ESCAPED_BYTE.subn("\ufffd", s)
        decoded = fixed.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        count += decoded.count("\ufffd") - fixed.count("\ufffd")
        check_decoded(path, decoded, count, where)
        replaced = True
        return decoded

    stack: list[Any] = [obj]
    while stack:
        node = stack.pop()
        items = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
        renamed = False
        for key, value in items:
            if isinstance(value, str):
                node[key] = clean(value)
            elif isinstance(value, (dict, list)):
                stack.append(value)
            if isinstance(key, str) and clean(key) is not key:
                renamed = True
        if renamed:  # rebuilt in order with the keys cleaned
            cleaned = [(clean(k), v) for k, v in node.items()]
            node.clear()
            node.update(cleaned)
    return replaced
