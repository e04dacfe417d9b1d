"""Input formats are recognised by content: compressed shards, Arrow and Hugging Face
datasets round-trip; binary that tessel cannot decode is refused, never read as text."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
from pathlib import Path

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessel.cli import main
from tessel.data.indexed import IndexedDataset
from tessel.data.readers import ReadStats, iter_documents
from tessel.errors import DataError

DOCS = ["first document, ünïcode ✓", "second\nwith a newline", "third " * 300]
COMPRESSORS = {
    "gz": gzip.compress,
    "zst": lambda b: zstandard.ZstdCompressor().compress(b),
    "bz2": bz2.compress,
    "xz": lzma.compress,
}


def _jsonl(docs: list[str]) -> bytes:
    return "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()


@pytest.mark.parametrize("ext", sorted(COMPRESSORS))
def test_compressed_jsonl_and_text_round_trip(tmp_path: Path, ext: str):
    compress = COMPRESSORS[ext]
    (tmp_path / f"a.jsonl.{ext}").write_bytes(compress(_jsonl(DOCS)))
    (tmp_path / f"b.txt.{ext}").write_bytes(compress(DOCS[0].encode()))
    stats = ReadStats()
    got = list(iter_documents([tmp_path / f"a.jsonl.{ext}", tmp_path / f"b.txt.{ext}"],
                              stats=stats))
    assert got == [*DOCS, DOCS[0]]
    assert stats.invalid_utf8 == 0


def test_compression_is_recognised_by_content_not_name(tmp_path: Path):
    # a zstd shard someone named .jsonl: read as zstd, not as garbage text
    (tmp_path / "shard.jsonl").write_bytes(COMPRESSORS["zst"](_jsonl(DOCS)))
    assert list(iter_documents([tmp_path / "shard.jsonl"])) == DOCS
    # multi-frame zstd (as written by streaming compressors) is read across frames
    frames = b"".join(COMPRESSORS["zst"](_jsonl([d])) for d in DOCS)
    (tmp_path / "frames.jsonl.zst").write_bytes(frames)
    assert list(iter_documents([tmp_path / "frames.jsonl.zst"])) == DOCS


def test_preprocess_of_a_zst_shard_keeps_its_documents(tmp_path: Path):
    """The regression: `tessel preprocess --input d.jsonl.zst` made one document of binary
    garbage and exited 0."""
    (tmp_path / "d.jsonl.zst").write_bytes(COMPRESSORS["zst"](_jsonl(DOCS)))
    assert main(["preprocess", "--input", str(tmp_path / "d.jsonl.zst"), "--tokenizer", "bytes",
                 "--output", str(tmp_path / "out" / "d"), "--quiet"]) == 0
    ds = IndexedDataset(tmp_path / "out" / "d")
    tok = ds.tokenizer()
    assert [tok.decode(ds.document(i).tolist()) for i in range(ds.n_docs)] == DOCS


def test_arrow_files_and_hugging_face_datasets(tmp_path: Path):
    import datasets
    import pyarrow as pa
    import pyarrow.ipc as ipc

    table = pa.table({"text": DOCS, "n": [1, 2, 3]})
    with ipc.new_file(tmp_path / "f.arrow", table.schema) as w:  # IPC file format
        w.write_table(table, max_chunksize=2)
    with ipc.new_stream(tmp_path / "s.bin", table.schema) as w:  # stream, unhelpful name
        w.write_table(table)
    assert list(iter_documents([tmp_path / "f.arrow", tmp_path / "s.bin"])) == DOCS + DOCS

    ds = datasets.Dataset.from_dict({"text": DOCS, "id": [1, 2, 3]})
    ds.save_to_disk(str(tmp_path / "hf"), num_shards=2)
    assert list(iter_documents([tmp_path / "hf"])) == DOCS
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match="is a Hugging Face DatasetDict; name one split's "
                                        "directory, e.g. .*dd/train"):
        iter_documents([tmp_path / "dd"])
    assert list(iter_documents([tmp_path / "dd" / "train"])) == DOCS
    with pytest.raises(DataError, match="no column 'body'"):
        list(iter_documents([tmp_path / "hf"], json_key="body"))


@pytest.mark.parametrize("name,content,says", [
    ("tokens.txt", np.arange(1000, dtype=np.uint16).tobytes(), "binary data"),
    ("arr.txt", b"\x93NUMPY\x01\x00" + bytes(100), "a NumPy array"),
    ("d.jsonl", b"PK\x03\x04" + bytes(50), "a zip archive"),
    ("d.idx", b"MMIDIDX\x00\x00" + bytes(50), "a Megatron index"),
    ("d.jsonl.gz", b"this is not gzip", "not a valid gzip file (no gzip header"),
    ("d.jsonl.zst", COMPRESSORS["zst"](_jsonl(DOCS))[:-40], "not a valid zstd file"),
    ("t.parquet.zst", COMPRESSORS["zst"](b"PAR1" + bytes(10)), "zstd-compressed Parquet"),
    # mtime=0: the same bytes in every process (the xdist workers must collect equal ids)
    ("double.txt.gz", gzip.compress(gzip.compress(b"x" * 100, mtime=0), mtime=0), "compressed twice"),
    ("russian.txt", ("привет, мир " * 40).encode("koi8-r"), "are not UTF-8"),
    ("noise.txt", bytes(range(128, 256)) * 20, "are not UTF-8"),
], ids=lambda v: v if isinstance(v, str) else "content")
def test_undecodable_input_is_refused_in_one_line_and_nothing_is_written(
        tmp_path: Path, capsys, name: str, content: bytes, says: str):
    (tmp_path / name).write_bytes(content)
    code = main(["preprocess", "--input", str(tmp_path / name), "--tokenizer", "bytes",
                 "--output", str(tmp_path / "out" / "d"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and says in err and name in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_few_stray_bytes_are_replaced_and_counted_not_refused(tmp_path: Path):
    # a Latin-1 file is about a third accents: replaced and counted, not refused
    (tmp_path / "a.txt").write_bytes(("déjà vu à l'été " * 40).encode("latin-1"))
    (tmp_path / "b.jsonl").write_bytes(b'{"text": "caf\xe9 au lait"}\n')
    stats = ReadStats()
    docs = list(iter_documents([tmp_path / "a.txt", tmp_path / "b.jsonl"], stats=stats))
    assert stats.invalid_utf8 == 2 and all("\ufffd" in d for d in docs)


def test_files_source_refuses_binary_before_training(tmp_path: Path, capsys):
    """data.source=files went through the same reader and trained on the garbage."""
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "good.txt").write_text("plain text " * 50)
    (tmp_path / "c" / "shard.bin").write_bytes(os.urandom(4096))
    code = main(["train", "--data.source=files", f"--data.paths=['{tmp_path / 'c'}']",
                 f"--run.dir={tmp_path / 'run'}", "--train.steps=1", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "shard.bin: looks like binary data" in err
    assert not (tmp_path / "run").exists()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=600), name=st.sampled_from(
    ["a.txt", "a.jsonl", "a.jsonl.gz", "a.jsonl.zst", "a.txt.bz2", "a.xz", "a.parquet", "a.arrow"]),
    prefix=st.sampled_from([b"", b"\x1f\x8b", b"\x28\xb5\x2f\xfd", b"BZh", b"PAR1", b"ARROW1",
                            b"\xff\xff\xff\xff", b'{"text": "']))
def test_random_bytes_are_documents_or_one_line(tmp_path_factory, data: bytes, name: str,
                                                 prefix: bytes):
    path = tmp_path_factory.mktemp("fuzz") / name
    path.write_bytes(prefix + data)
    try:
        docs = list(iter_documents([path]))
    except DataError as exc:
        assert "\n" not in str(exc) and str(path) in str(exc)
    else:
        assert all(isinstance(d, str) and d for d in docs)
        assert b"\x00" not in prefix + data or name.endswith((".gz", ".zst", ".bz2", ".xz"))
