"""The indexed dataset format: round trip, atomic publication, and refusal of bad files."""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from tessel.data import indexed
from tessel.data.indexed import HEADER_SIZE, IndexedDataset, IndexedWriter, dtype_for_vocab
from tessel.data.tokenizer import Tokenizer, byte_tokenizer, train_bpe
from tessel.errors import DataError

DOCS = [[1, 2, 3], [], [255, 0], [7] * 10]


def write(prefix: Path, docs: list[list[int]] = DOCS, tok: Tokenizer | None = None) -> Path:
    with IndexedWriter(prefix, tok or byte_tokenizer()) as w:
        for d in docs:
            w.add_document(d)
    return prefix


def test_round_trip_attributes_and_documents(tmp_path: Path):
    prefix = write(tmp_path / "d")
    for name in ("d", "d.bin", "d.idx"):  # the suffix is optional
        ds = IndexedDataset(tmp_path / name)
        assert ds.prefix == tmp_path / "d"
        assert (ds.n_docs, ds.n_tokens, ds.vocab_size, ds.dtype) == (4, 15, 257, np.dtype("<u2"))
        assert len(ds) == 4
    assert isinstance(ds.tokens, np.memmap) and ds.tokens.ndim == 1
    assert not ds.tokens.flags.writeable
    assert ds.doc_offsets.dtype == np.int64
    assert ds.doc_offsets.tolist() == [0, 3, 3, 5, 15]
    assert [ds.document(i).tolist() for i in range(4)] == DOCS
    assert ds.document(-1).tolist() == DOCS[-1]
    with pytest.raises(IndexError):
        ds.document(4)
    assert ds.tokenizer_fingerprint == byte_tokenizer().fingerprint()
    assert ds.tokenizer().fingerprint() == ds.tokenizer_fingerprint
    ds.verify()
    # Only the three published files are left: no temporaries.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.bin", "d.idx", "d.tokenizer.json"]
    assert (prefix.with_suffix(".bin")).stat().st_size == 15 * 2


def test_add_documents_batch_equals_one_by_one(tmp_path: Path):
    write(tmp_path / "a")
    flat = np.concatenate([np.array(d, dtype=np.int64) for d in DOCS])
    with IndexedWriter(tmp_path / "b", byte_tokenizer()) as w:
        w.add_documents(flat, np.array([len(d) for d in DOCS]))
    for ext in (".bin", ".idx", ".tokenizer.json"):
        assert (tmp_path / f"a{ext}").read_bytes() == (tmp_path / f"b{ext}").read_bytes()


def test_dtype_follows_vocabulary_size(tmp_path: Path):
    assert dtype_for_vocab(65536) == np.dtype("<u2")
    assert dtype_for_vocab(65537) == np.dtype("<u4")
    big = Tokenizer(HFTokenizer(models.WordLevel({f"w{i}": i for i in range(70_000)}, unk_token="w0")),
                    "wordlevel")
    ds = IndexedDataset(write(tmp_path / "big", [[69_999, 65_536, 3]], big))
    assert ds.dtype == np.dtype("<u4") and ds.vocab_size == 70_001
    assert ds.document(0).tolist() == [69_999, 65_536, 3]


def test_ids_outside_the_vocabulary_are_refused(tmp_path: Path):
    with pytest.raises(DataError, match="outside the tokenizer's vocabulary of 257"):
        write(tmp_path / "d", [[1, 300]])
    assert list(tmp_path.iterdir()) == []


def test_an_exception_leaves_no_files_and_keeps_an_existing_dataset(tmp_path: Path):
    write(tmp_path / "d")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(RuntimeError, match="boom"):
        with IndexedWriter(tmp_path / "d", byte_tokenizer()) as w:
            w.add_document([9, 9, 9, 9])
            raise RuntimeError("boom")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    # Directories the writer created for an aborted dataset are removed too.
    with pytest.raises(RuntimeError):
        with IndexedWriter(tmp_path / "new" / "deeper" / "d", byte_tokenizer()):
            raise RuntimeError("boom")
    assert not (tmp_path / "new").exists()


def test_an_unfinished_write_is_never_readable(tmp_path: Path):
    # As if the process were killed before finalize: only hidden temporaries exist.
    w = IndexedWriter(tmp_path / "d", byte_tokenizer())
    w.add_document([1, 2, 3])
    with pytest.raises(DataError, match="is missing"):
        IndexedDataset(tmp_path / "d")
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_a_crash_between_renames_leaves_the_old_dataset_refused_not_mixed(tmp_path, monkeypatch):
    write(tmp_path / "d")
    real_replace = os.replace

    def crash_on_idx(src, dst):
        if str(dst).endswith(".idx"):
            raise OSError("simulated crash before the commit")
        real_replace(src, dst)

    monkeypatch.setattr(indexed.os, "replace", crash_on_idx)
    with pytest.raises(OSError, match="simulated"):
        write(tmp_path / "d", [[5] * 3])
    # The new .bin is in place but the old .idx was removed first: refused, never mixed.
    with pytest.raises(DataError, match="d.idx' is missing"):
        IndexedDataset(tmp_path / "d")


def test_directory_prefix_is_refused(tmp_path: Path):
    with pytest.raises(DataError, match="is a directory; name the dataset"):
        IndexedWriter(tmp_path, byte_tokenizer())


# ---- corrupted files ---------------------------------------------------------------------


def _patch(path: Path, at: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[at: at + len(data)] = data
    path.write_bytes(bytes(raw))


def _flip(path: Path, at: int) -> None:
    raw = path.read_bytes()
    _patch(path, at, bytes([raw[at] ^ 0xFF]))


def _truncate(path: Path, by: int) -> None:
    path.write_bytes(path.read_bytes()[:-by])


def _rewrite_header(idx: Path, **changes: int) -> None:
    """Change header fields and recompute the header checksum (a consistent but wrong file)."""
    fields = indexed._FIELDS
    values = list(fields.unpack(idx.read_bytes()[: fields.size]))
    names = ["magic", "version", "dtype", "n_docs", "n_tokens", "vocab", "fingerprint", "bin_crc"]
    for k, v in changes.items():
        values[names.index(k)] = v
    packed = fields.pack(*values)
    _patch(idx, 0, packed + struct.pack("<I", zlib.crc32(packed)))


def _non_monotonic(idx: Path) -> None:
    raw = idx.read_bytes()
    n = (len(raw) - HEADER_SIZE - 4) // 8
    offsets = np.frombuffer(raw[HEADER_SIZE: HEADER_SIZE + 8 * n], dtype="<i8").copy()
    offsets[1], offsets[2] = offsets[3], offsets[1]  # 3, 3 -> 5, 3: decreasing, same end
    body = offsets.tobytes()
    _patch(idx, HEADER_SIZE, body + struct.pack("<I", zlib.crc32(body)))


def _other_tokenizer(tok_path: Path) -> None:
    train_bpe(["some other text to learn from"] * 20, 300).save(tok_path)


CORRUPTIONS: dict[str, tuple[Callable[[Path, Path, Path], None], str]] = {
    "missing idx": (lambda b, i, t: i.unlink(), "d.idx' is missing"),
    "missing bin": (lambda b, i, t: b.unlink(), "d.bin' is missing"),
    "missing tokenizer": (lambda b, i, t: t.unlink(), "d.tokenizer.json' is missing"),
    "bad magic": (lambda b, i, t: _patch(i, 0, b"NOTMAGIC"), "not a tessel index (bad magic"),
    "newer version": (lambda b, i, t: _rewrite_header(i, version=2), "format version 2"),
    "header bit flip": (lambda b, i, t: _flip(i, 24), "header checksum mismatch"),
    "fingerprint flip": (lambda b, i, t: _flip(i, 50), "header checksum mismatch"),
    "offsets bit flip": (lambda b, i, t: _flip(i, HEADER_SIZE + 9), "offsets checksum mismatch"),
    "idx truncated": (lambda b, i, t: _truncate(i, 5), "d.idx is truncated"),
    "idx header only": (lambda b, i, t: i.write_bytes(i.read_bytes()[:40]), "d.idx is truncated"),
    "bin truncated": (lambda b, i, t: _truncate(b, 2), "d.bin is truncated (28 bytes, expected 15"),
    "bin too long": (lambda b, i, t: b.write_bytes(b.read_bytes() + b"\0\0"), "longer than its index"),
    "non-monotonic": (lambda b, i, t: _non_monotonic(i), "offsets are not monotonic"),
    "wrong n_tokens": (lambda b, i, t: _rewrite_header(i, n_tokens=14), "offsets are not monotonic"),
    "other tokenizer": (lambda b, i, t: _other_tokenizer(t),
                        "is not the tokenizer the data was made with"),
    "broken tokenizer": (lambda b, i, t: t.write_text("{not json"), "cannot read d.tokenizer.json"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corrupted_datasets_are_refused_with_one_line(tmp_path: Path, case: str):
    prefix = write(tmp_path / "d")
    corrupt, message = CORRUPTIONS[case]
    corrupt(*indexed.dataset_paths(prefix))
    with pytest.raises(DataError) as err:
        IndexedDataset(prefix)
    text = str(err.value)
    assert message in text and "\n" not in text
    assert text.startswith(f"dataset {str(prefix)!r}: ")


def test_verify_finds_corrupted_token_contents(tmp_path: Path):
    prefix = write(tmp_path / "d")
    _flip(tmp_path / "d.bin", 3)  # same size: passes the cheap checks on open
    ds = IndexedDataset(prefix)
    with pytest.raises(DataError, match="d.bin checksum mismatch"):
        ds.verify()


def test_empty_dataset_opens(tmp_path: Path):
    ds = IndexedDataset(write(tmp_path / "d", []))
    assert (ds.n_docs, ds.n_tokens, len(ds.tokens)) == (0, 0, 0)
    ds.verify()
