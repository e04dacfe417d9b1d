"""Records in memory (iterables of dicts/strings, `datasets.Dataset`) through the same
preprocessing as files: the same bytes on disk, exact counts, the cache, refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_preprocess import DOCS, _bpe, dataset_docs, write_jsonl

from tessel.data import cached_records, preprocess, preprocess_records
from tessel.data.indexed import IndexedDataset
from tessel.errors import DataError


def _same_dataset(a: Path, b: Path) -> None:
    for ext in (".bin", ".idx", ".tokenizer.json"):
        assert a.with_name(a.name + ext).read_bytes() == b.with_name(b.name + ext).read_bytes(), ext


@pytest.mark.parametrize("workers", [1, 2])
def test_records_give_the_files_bytes_and_counts(tmp_path: Path, workers: int):
    tok = _bpe()
    files = preprocess([write_jsonl(tmp_path / "in.jsonl", DOCS + [""])], tok, tmp_path / "f",
                       append_eod=True, progress=False, workers=workers)
    shapes = {
        "dicts": [{"text": d, "id": i} for i, d in enumerate(DOCS + [""])],
        "strings": DOCS + [""],
        "generator": (d for d in DOCS + [""]),
    }
    for name, records in shapes.items():
        summary = preprocess_records(records, tok, tmp_path / name, append_eod=True,
                                     progress=False, workers=workers)
        _same_dataset(tmp_path / "f", tmp_path / name)
        assert (summary.documents, summary.tokens, summary.empty_skipped) == (
            files.documents, files.tokens, 1)
        assert summary.input_bytes == sum(len(d.encode()) for d in DOCS)
    assert dataset_docs(tmp_path / "dicts") == DOCS


def test_a_datasets_dataset_and_its_cache(tmp_path: Path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"body": DOCS, "n": list(range(len(DOCS)))})
    tok = _bpe()
    prefix = cached_records(ds, tok, json_key="body", cache_dir=tmp_path / "cache")
    assert dataset_docs(prefix) == DOCS
    assert IndexedDataset(prefix).document(0)[-1] == tok.eod_id  # ended, as data.source=files
    # Found again by the dataset's fingerprint (not rebuilt: same files, same mtime) ...
    mtime = (prefix.parent / "data.bin").stat().st_mtime_ns
    assert cached_records(ds, tok, json_key="body", cache_dir=tmp_path / "cache") == prefix
    assert (prefix.parent / "data.bin").stat().st_mtime_ns == mtime
    # ... and a changed dataset is another entry.
    other = ds.map(lambda r: {"body": r["body"] + "!"})
    assert cached_records(other, tok, json_key="body", cache_dir=tmp_path / "cache") != prefix
    with pytest.raises(DataError, match="no column 'text' \\(columns: body, n\\)"):
        preprocess_records(ds, tok, tmp_path / "x")
    with pytest.raises(DataError, match="pass one split, e.g. ds\\['train'\\]"):
        preprocess_records(datasets.DatasetDict({"train": ds}), tok, tmp_path / "x")
    assert not list(tmp_path.glob("x.*"))


def test_lists_and_generators_share_a_cache_entry_by_content(tmp_path: Path):
    tok = _bpe()
    a = cached_records(list(DOCS), tok, cache_dir=tmp_path)
    assert cached_records(iter(DOCS), tok, cache_dir=tmp_path) == a
    assert cached_records(DOCS[:-1], tok, cache_dir=tmp_path) != a
    assert cached_records(DOCS, tok, cache_dir=tmp_path, key="mine") != a
    assert sorted(p.name.startswith("records-") for p in tmp_path.iterdir()) == [True] * 3


@pytest.mark.parametrize(("records", "message"), [
    ([{"text": "ok"}, {"body": "x"}], "record 1 has no 'text'"),
    (["ok", {"text": 3}], "record 1 holds int, not a string, under 'text'"),
    (["ok", 7], "record 1 is not a string or a mapping"),
    ("one string", "not one string"),
    (42, "must be an iterable of records, got int"),
    ([], "hold no documents"),
])
def test_bad_records_are_one_line_and_leave_nothing(tmp_path: Path, records, message: str):
    with pytest.raises(DataError, match=message):
        preprocess_records(records, "bytes", tmp_path / "out", progress=False)
    assert not list(tmp_path.iterdir())


def test_text_that_is_not_unicode_is_replaced_and_counted(tmp_path: Path):
    summary = preprocess_records(["fine", "half \ud800 a surrogate"], "bytes", tmp_path / "o",
                                 progress=False)
    assert summary.invalid_utf8 == 1
    assert dataset_docs(tmp_path / "o") == ["fine", "half \ufffd a surrogate"]


def test_an_existing_dataset_is_replaced_only_with_force(tmp_path: Path):
    preprocess_records(["a"], "bytes", tmp_path / "d", progress=False)
    with pytest.raises(DataError, match="already exists"):
        preprocess_records(["b"], "bytes", tmp_path / "d", progress=False)
    preprocess_records(["b"], "bytes", tmp_path / "d", progress=False, force=True)
    assert dataset_docs(tmp_path / "d") == ["b"]
