"""Readers and preprocessing: formats, round trips, determinism, counting, refusals."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from tessel.data.indexed import IndexedDataset
from tessel.data.preprocess import preprocess
from tessel.data.readers import ReadStats, iter_documents, resolve_inputs
from tessel.data.tokenizer import Tokenizer, byte_tokenizer, load_tokenizer, train_bpe
from tessel.errors import DataError

DOCS = [
    "Hello, world!\n",
    "  leading spaces, tabs\tand trailing newline\n\n",
    "héllo wörld — naïve café 👋🏽 日本語のテキスト",
    "def f(x):\n    return x ** 2  # code\r\n",
    "emoji-only: 🎉🎉 and \u00a0nbsp, zero\u200bwidth",
    "a",
]


def _bpe() -> Tokenizer:
    return train_bpe(DOCS * 20, 400)


def _gpt2_files(tmp_path: Path) -> Tokenizer:
    vocab, merges = _bpe().hf.model.save(str(tmp_path))
    return load_tokenizer(f"gpt2-files:{vocab},{merges}")


def write_jsonl(path: Path, docs: list[str], key: str = "text", gz: bool = False) -> Path:
    text = "".join(json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(docs))
    if gz:
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text, encoding="utf-8")
    return path


def dataset_docs(prefix: Path) -> list[str]:
    ds = IndexedDataset(prefix)
    tok = ds.tokenizer()
    return [tok.decode(ds.document(i).tolist()) for i in range(ds.n_docs)]


@pytest.mark.parametrize("kind", ["bytes", "bpe", "gpt2-files"])
def test_round_trip_and_token_counts(tmp_path: Path, kind: str):
    tok = {"bytes": byte_tokenizer, "bpe": _bpe, "gpt2-files": lambda: _gpt2_files(tmp_path)}[kind]()
    for doc in DOCS:
        assert tok.decode(tok.encode(doc)) == doc
    src = write_jsonl(tmp_path / "in.jsonl", DOCS)
    summary = preprocess([src], tok, tmp_path / "out" / "d", append_eod=True, progress=False)
    ds = IndexedDataset(tmp_path / "out" / "d")
    assert ds.doc_lengths.tolist() == [len(tok.encode(d)) + 1 for d in DOCS]
    assert (ds.n_docs, ds.n_tokens) == (summary.documents, summary.tokens) == (len(DOCS), ds.doc_offsets[-1])
    assert all(ds.document(i)[-1] == tok.eod_id for i in range(ds.n_docs))
    assert dataset_docs(tmp_path / "out" / "d") == DOCS
    assert ds.tokenizer_fingerprint == tok.fingerprint()


def test_output_is_byte_identical_for_any_worker_count_and_batch_size(tmp_path: Path):
    docs = [f"document {i}: " + "lorem ipsum dolor sit amet " * (i % 7) for i in range(60)]
    src = write_jsonl(tmp_path / "in.jsonl", docs)
    tok = _bpe()
    runs = [(1, 1024), (1, 5), (4, 3), (2, 1)]
    for workers, batch in runs:
        preprocess([src], tok, tmp_path / f"w{workers}b{batch}", workers=workers, batch_size=batch,
                   append_eod=True, progress=False)
    for ext in (".bin", ".idx", ".tokenizer.json"):
        contents = {(tmp_path / f"w{w}b{b}{ext}").read_bytes() for w, b in runs}
        assert len(contents) == 1, ext


def test_text_directory_jsonl_and_gzip_inputs_in_order(tmp_path: Path):
    root = tmp_path / "corpus"
    (root / "b" / "nested").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "a.txt").write_text("file a")
    (root / "b" / "nested" / "c.md").write_text("file c")
    (root / "b" / "b.txt.gz").write_bytes(gzip.compress(b"file b (gzip)"))
    (root / ".hidden.txt").write_text("hidden")
    (root / ".git" / "HEAD").write_text("ref: hidden")
    write_jsonl(tmp_path / "x.jsonl", ["json 1", "json 2"])
    write_jsonl(tmp_path / "y.jsonl.gz", ["gz json"], gz=True)
    write_jsonl(tmp_path / "z.json", ["dot json"], key="content")
    (tmp_path / "single.txt").write_text("single\nfile\n")

    stats = ReadStats()
    docs = list(iter_documents([root, tmp_path / "x.jsonl", tmp_path / "y.jsonl.gz", tmp_path / "single.txt"],
                               stats=stats))
    assert docs == ["file a", "file b (gzip)", "file c", "json 1", "json 2", "gz json", "single\nfile\n"]
    assert (stats.files, stats.documents) == (6, 7)
    assert list(iter_documents([tmp_path / "z.json"], json_key="content")) == ["dot json"]
    # A glob pattern string (as a user might quote it) is expanded, sorted.
    assert list(iter_documents([str(tmp_path / "*.jsonl*")])) == ["json 1", "json 2", "gz json"]
    summary = preprocess([root], "bytes", tmp_path / "d", progress=False)
    assert dataset_docs(tmp_path / "d") == ["file a", "file b (gzip)", "file c"]
    assert summary.input_bytes == len("file a") + len("file b (gzip)") + len("file c")


def test_parquet_input(tmp_path: Path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    docs = [f"parquet row {i} é" for i in range(2500)]  # more than one row batch
    table = pa.table({"body": docs + [""], "n": list(range(len(docs) + 1))})
    pq.write_table(table, tmp_path / "t.parquet")
    stats = ReadStats()
    assert list(iter_documents([tmp_path / "t.parquet"], "body", stats)) == docs
    assert (stats.documents, stats.empty_skipped) == (2500, 1)
    preprocess([tmp_path / "t.parquet"], "bytes", tmp_path / "d", json_key="body", progress=False)
    assert dataset_docs(tmp_path / "d") == docs
    with pytest.raises(DataError, match="no column 'text' \\(columns: body, n\\)"):
        list(iter_documents([tmp_path / "t.parquet"]))


def test_parquet_without_pyarrow_says_how_to_install(tmp_path: Path, monkeypatch):
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow` fail
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match="pip install pyarrow"):
        iter_documents([tmp_path / "t.parquet"])
    assert not (tmp_path / "d.idx").exists()


def test_empty_and_invalid_utf8_documents_are_counted(tmp_path: Path):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))  # b"caf\xe9"
    (tmp_path / "ok.txt").write_text("fine")
    lines = [b'{"text": ""}', b'{"text": "bad \xff byte"}', b'{"text": "lone \\udc80 surrogate"}',
             b'{"text": "pair \\ud83d\\ude00 ok"}', b"", b"   ", b'{"text": "last"}']
    (tmp_path / "mixed.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    summary = preprocess([tmp_path], "bytes", tmp_path / "out" / "d", progress=False)
    assert (summary.documents, summary.empty_skipped, summary.invalid_utf8) == (6, 2, 3)
    assert dataset_docs(tmp_path / "out" / "d") == [
        "caf\ufffd", "bad \ufffd byte", "lone ? surrogate", "pair 😀 ok", "last", "fine"]


@pytest.mark.parametrize("line, message", [
    (b'{"text": "ok"', "bad.jsonl:2: not valid JSON"),
    (b'["text"]', "bad.jsonl:2: expected a JSON object, got list"),
    (b'{"body": "x"}', "bad.jsonl:2: no 'text' key (keys: 'body')"),
    (b'{"text": 3}', "bad.jsonl:2: 'text' holds a int, not a string"),
])
def test_bad_jsonl_lines_name_file_and_line_and_leave_nothing(tmp_path: Path, line: bytes, message: str):
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "first"}\n' + line + b"\n")
    with pytest.raises(DataError, match=message.replace("[", "\\[").replace("(", "\\(").replace(")", "\\)")):
        preprocess([tmp_path / "bad.jsonl"], "bytes", tmp_path / "out" / "d", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_refused_input_keeps_an_existing_dataset(tmp_path: Path):
    write_jsonl(tmp_path / "good.jsonl", ["one", "two"])
    preprocess([tmp_path / "good.jsonl"], "bytes", tmp_path / "d", progress=False)
    before = {p.name: p.read_bytes() for p in tmp_path.glob("d.*")}
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\nnot json\n')
    for workers in (1, 2):
        with pytest.raises(DataError, match="already exists"):  # not replaced unless asked
            preprocess([tmp_path / "good.jsonl"], "bytes", tmp_path / "d", progress=False)
        with pytest.raises(DataError, match="bad.jsonl:2"):  # asked, but the input is bad
            preprocess([tmp_path / "good.jsonl", tmp_path / "bad.jsonl"], "bytes", tmp_path / "d",
                       workers=workers, batch_size=1, progress=False, force=True)
        assert {p.name: p.read_bytes() for p in tmp_path.glob("d.*")} == before
        assert not list(tmp_path.glob(".d.*"))  # no temporaries left behind


def test_missing_inputs_and_empty_corpora_are_refused_before_writing(tmp_path: Path):
    with pytest.raises(DataError, match="input '.*nope.txt' does not exist"):
        preprocess([tmp_path / "nope.txt"], "bytes", tmp_path / "out" / "d", progress=False)
    with pytest.raises(DataError, match="matches no files"):
        iter_documents([str(tmp_path / "*.jsonl")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="hold no files"):
        resolve_inputs([tmp_path / "empty"])
    (tmp_path / "e.txt").write_text("")
    with pytest.raises(DataError, match="inputs hold no documents"):
        preprocess([tmp_path / "e.txt"], "bytes", tmp_path / "out" / "d", progress=False)
    assert not (tmp_path / "out").exists()


def test_corrupt_gzip_is_one_line(tmp_path: Path):
    (tmp_path / "a.txt.gz").write_bytes(b"definitely not gzip")
    with pytest.raises(DataError, match="a.txt.gz: not a valid gzip file"):
        list(iter_documents([tmp_path / "a.txt.gz"]))


def test_nothing_is_printed_under_ci(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setenv("CI", "true")
    write_jsonl(tmp_path / "in.jsonl", ["x", "y"])
    s = preprocess([tmp_path / "in.jsonl"], "bytes", tmp_path / "d", progress=True)
    assert capsys.readouterr() == ("", "")
    assert "preprocessed 2 documents" in s.line() and s.mb_per_s >= 0


def test_documents_are_streamed_not_loaded(tmp_path: Path):
    write_jsonl(tmp_path / "in.jsonl", ["first", "second"])
    it = iter_documents([tmp_path / "in.jsonl"])
    assert next(it) == "first"  # a generator: nothing beyond the first line has been parsed
    stats = ReadStats()
    np.testing.assert_equal(sum(1 for _ in iter_documents([tmp_path / "in.jsonl"], stats=stats)), 2)
    assert stats.bytes_read == (tmp_path / "in.jsonl").stat().st_size
