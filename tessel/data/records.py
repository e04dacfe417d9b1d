"""Documents already in memory: any iterable of records (dicts or strings) or a Hugging Face
`datasets.Dataset`, tokenized by the same pipeline as files (`encode_documents`: the same
workers, the same index, the same exact counts).

    from tessel.data import preprocess_records, cached_records
    summary = preprocess_records(ds, "tokenizer.json", "data/mine", json_key="text")
    prefix = cached_records(ds, "tokenizer.json")       # built once, then found in the cache
    cfg = Config.load(None, {"data.source": "indexed", "data.paths": [str(prefix)]})

A record is a string (the document) or a mapping holding a string under `json_key`; anything
else is a `DataError` naming the record's index. Empty documents are skipped and counted;
text that is not valid Unicode (lone surrogates) is replaced (U+FFFD) and counted, as bytes
that are not UTF-8 are in files.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from tessel.data.cache import build_once, default_cache_dir
from tessel.data.indexed import normalize_prefix
from tessel.data.preprocess import (
    DEFAULT_BATCH_SIZE,
    PreprocessSummary,
    check_output_free,
    check_settings,
    encode_documents,
)
from tessel.data.readers import SURROGATE, ReadStats
from tessel.data.tokenizer import Tokenizer, load_tokenizer
from tessel.errors import DataError

_ARROW_BATCH_ROWS = 1024


def _is_hf_dataset(records: object) -> bool:
    return hasattr(records, "column_names") and hasattr(records, "iter")


def _check(records: object, json_key: str) -> None:
    if isinstance(records, (str, bytes)):
        raise DataError("records must be an iterable of records, not one string; wrap it in a "
                        "list, or use tessel.data.preprocess for files")
    if isinstance(records, Mapping):
        splits = ", ".join(repr(k) for k in list(records)[:4])
        raise DataError(f"records is a mapping (a DatasetDict? its keys: {splits}); pass one "
                        "split, e.g. ds['train']")
    if not isinstance(records, Iterable):
        raise DataError(f"records must be an iterable of records, got {type(records).__name__}")
    if _is_hf_dataset(records):
        columns = list(records.column_names)  # type: ignore[attr-defined]
        if json_key not in columns:
            raise DataError(f"the dataset has no column {json_key!r} (columns: "
                            f"{', '.join(columns)}); pass json_key=")


def _texts(records: Any, json_key: str) -> Iterator[Any]:
    """Raw values under `json_key`, one per record (Arrow batches for a `datasets.Dataset`)."""
    if _is_hf_dataset(records):
        for batch in records.select_columns([json_key]).iter(batch_size=_ARROW_BATCH_ROWS):
            yield from batch[json_key]
        return
    for record in records:
        yield record if isinstance(record, str) else (
            record.get(json_key, _MISSING) if isinstance(record, Mapping) else _NOT_A_RECORD)


_MISSING, _NOT_A_RECORD = object(), object()


def iter_records(records: Any, json_key: str = "text",
                 stats: ReadStats | None = None) -> Iterator[str]:
    """The documents of `records`, streamed, counted in `stats` (see the module docstring)."""
    _check(records, json_key)
    stats = stats if stats is not None else ReadStats()
    return _documents(records, json_key, stats)


def _documents(records: Any, json_key: str, stats: ReadStats) -> Iterator[str]:
    for i, text in enumerate(_texts(records, json_key)):
        if not isinstance(text, str):
            what = ("is not a string or a mapping" if text is _NOT_A_RECORD else
                    f"has no {json_key!r}" if text is _MISSING else
                    f"holds {type(text).__name__}, not a string, under {json_key!r}")
            raise DataError(f"record {i} {what}; every record must be a document string or "
                            f"hold one under json_key={json_key!r}")
        try:
            stats.bytes_read += len(text.encode("utf-8"))
        except UnicodeEncodeError:  # lone surrogates: not Unicode text the tokenizer takes
            text = SURROGATE.sub("\ufffd", text)
            stats.bytes_read += len(text.encode("utf-8"))
            stats.invalid_utf8 += 1
        if not text:
            stats.empty_skipped += 1
            continue
        stats.documents += 1
        yield text


def preprocess_records(
    records: Any,
    tokenizer: Tokenizer | str,
    output_prefix: str | os.PathLike[str],
    json_key: str = "text",
    workers: int = 1,
    append_eod: bool = False,
    batch_size: int = DEFAULT_BATCH_SIZE,
    progress: bool = True,
    force: bool = False,
    fmt: str = "tessel",
) -> PreprocessSummary:
    """`tessel.data.preprocess` for records in memory: the same arguments, the same output
    and the same refusals (an existing dataset is replaced only with `force`)."""
    check_settings(workers, batch_size)
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    prefix = normalize_prefix(output_prefix)
    check_output_free(prefix, force)
    stats = ReadStats()
    docs = iter_records(records, json_key, stats)
    return encode_documents(docs, stats, tok, prefix, workers=workers, append_eod=append_eod,
                            batch_size=batch_size, progress=progress, fmt=fmt)


def records_key(records: Any, json_key: str = "text") -> str | None:
    """What identifies the content of `records` without tokenizing it: a `datasets.Dataset`'s
    own fingerprint, or a hash of the documents of a collection that can be read twice;
    None for a one-shot iterator (a generator)."""
    if _is_hf_dataset(records) and isinstance(getattr(records, "_fingerprint", None), str):
        return f"datasets:{records._fingerprint}:{json_key}"
    if iter(records) is records:
        return None
    h = hashlib.sha256()
    for text in iter_records(records, json_key):
        h.update(hashlib.sha256(text.encode("utf-8")).digest())
    return f"sha256:{h.hexdigest()}:{json_key}"


def cached_records(
    records: Any,
    tokenizer: Tokenizer | str,
    json_key: str = "text",
    cache_dir: str | os.PathLike[str] | None = None,
    key: str | None = None,
    workers: int = 1,
    append_eod: bool = True,
) -> Path:
    """The prefix of `records` tokenized into the data cache, built on first use: what a
    config's `data.paths` takes (`data.source = "indexed"`). The cache entry is keyed by
    `key`, else `records_key(records)`, with the tokenizer's fingerprint and settings. A
    one-shot iterator with no `key` is tokenized every call (nothing identifies it before),
    and kept under the hash of its documents."""
    _check(records, json_key)
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    content = key if key is not None else records_key(records, json_key)

    def entry(content: str) -> Path:
        settings = [content, tok.fingerprint(), tok.eod_token, append_eod, json_key]
        return cache / f"records-{hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:16]}"

    def build(tmp: Path) -> Path | None:
        docs: Any = records
        hasher = hashlib.sha256()
        if content is None:  # a one-shot iterator: named by the documents it turns out to hold
            docs = (hasher.update(hashlib.sha256(t.encode("utf-8")).digest()) or t
                    for t in iter_records(records, json_key))
        preprocess_records(docs, tok, tmp / "data", json_key=json_key, workers=workers,
                           append_eod=append_eod, progress=False)
        return entry(f"sha256:{hasher.hexdigest()}:{json_key}") if content is None else None

    target = entry(content) if content is not None else None
    return build_once(target, build, cache) / "data"
