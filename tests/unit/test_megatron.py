"""Megatron-LM corpora, both ways, against megatron-core's own indexed_dataset.py (a dev
dependency): what it writes tessel reads, what `tessel preprocess --format megatron` writes
it reads, with the same documents; damage is refused in one line."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from tessel.cli import main
from tessel.config.blend import weighted_paths
from tessel.data.indexed import IndexedDataset
from tessel.data.preprocess import preprocess
from tessel.data.tokenizer import byte_tokenizer
from tessel.errors import DataError

with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed"
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronDataset
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

TEXTS = [f"document {i}: " + "words and more words " * (i % 5 + 1) for i in range(40)]


def _megatron_corpus(prefix: Path, tok, dtype=np.uint16, split_sentences=False) -> list[list[int]]:
    """A corpus written by megatron-core's builder (as its preprocess_data.py does: EOD after
    each document); with `split_sentences`, each document is several sequences."""
    docs = [tok.encode(t) + [tok.eod_id] for t in TEXTS]
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for ids in docs:
        if split_sentences:
            cut = len(ids) // 2
            builder.add_document(torch.tensor(ids), [cut, len(ids) - cut])
        else:
            builder.add_document(torch.tensor(ids), [len(ids)])
    builder.finalize(f"{prefix}.idx")
    return docs


@pytest.mark.parametrize("dtype,split", [(np.uint16, False), (np.int32, True)])
def test_tessel_reads_a_corpus_megatron_core_wrote(tmp_path: Path, dtype, split: bool):
    tok = byte_tokenizer()
    docs = _megatron_corpus(tmp_path / "m", tok, dtype, split)
    with pytest.raises(DataError, match="Megatron-LM dataset .* keeps no tokenizer.*set "
                                        "data.tokenizer"):
        IndexedDataset(tmp_path / "m")
    ds = IndexedDataset(tmp_path / "m", tok)
    assert ds.format == "megatron" and ds.dtype == np.dtype(dtype)
    assert [ds.document(i).tolist() for i in range(ds.n_docs)] == docs
    ds.verify()  # ids inside the vocabulary (no checksum in this format)
    # the same token stream as Megatron's reader sees, document by document
    mds = MegatronDataset(str(tmp_path / "m"))
    bounds = mds.document_indices
    for i, ids in enumerate(docs):
        seqs = [mds[j] for j in range(bounds[i], bounds[i + 1])]
        assert np.concatenate(seqs).tolist() == ids


def test_megatron_core_reads_what_tessel_preprocess_writes(tmp_path: Path):
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    tok = byte_tokenizer()
    (tmp_path / "tok.json").write_text(tok.to_json())
    prefix = tmp_path / "out" / "d"
    assert main(["preprocess", "--input", str(tmp_path / "c.jsonl"), "--tokenizer",
                 str(tmp_path / "tok.json"), "--output", str(prefix), "--format", "megatron",
                 "--append-eod", "--quiet"]) == 0
    mds = MegatronDataset(str(prefix))
    expected = [tok.encode(t) + [tok.eod_id] for t in TEXTS]
    assert [mds[i].tolist() for i in range(len(mds))] == expected
    assert mds.document_indices.tolist() == list(range(len(TEXTS) + 1))
    ours = IndexedDataset(prefix)  # the tokenizer.json written beside it
    assert ours.format == "megatron"
    assert [ours.document(i).tolist() for i in range(ours.n_docs)] == expected


def test_large_vocabularies_get_megatrons_int32(tmp_path: Path):
    from tessel.data import megatron

    assert megatron.dtype_for_vocab(65499) == np.uint16
    assert megatron.dtype_for_vocab(65500) == np.int32
    lengths = np.array([3, 0, 5])
    (tmp_path / "x.idx").write_bytes(megatron.index_bytes(np.int32, lengths))
    (tmp_path / "x.bin").write_bytes(np.arange(8, dtype=np.int32).tobytes())
    mds = MegatronDataset(str(tmp_path / "x"))
    assert [mds[i].tolist() for i in range(3)] == [[0, 1, 2], [], [3, 4, 5, 6, 7]]


def test_a_megatron_corpus_trains_on_the_tokens_megatron_sees(tmp_path: Path, monkeypatch):
    """Megatron-written corpus -> tessel train: the same losses as the same documents
    preprocessed by tessel (so the same token stream reached the model)."""
    tok = byte_tokenizer()
    (tmp_path / "tok.json").write_text(tok.to_json())
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    (tmp_path / "megatron").mkdir()
    _megatron_corpus(tmp_path / "megatron" / "corpus", tok)
    preprocess([tmp_path / "c.jsonl"], tok, tmp_path / "tessel" / "corpus", append_eod=True,
               progress=False)
    losses = []
    for made_by in ("megatron", "tessel"):
        monkeypatch.chdir(tmp_path / made_by)  # the same data.paths name: the same sample order
        assert main(["train", "--data.source=indexed", "--data.paths=['corpus']",
                     f"--data.tokenizer={tmp_path / 'tok.json'}", "--data.split=100,0",
                     "--model.n_layers=1", "--model.d_model=32", "--model.n_heads=2",
                     "--model.vocab_size=257", "--train.seq_len=32",
                     "--train.micro_batch_size=2", "--train.global_batch_size=2",
                     "--train.steps=3", "--metrics.log_interval=1", "--run.dir=run",
                     "--quiet"]) == 0
        losses.append([json.loads(line)["loss"] for line in
                       Path("run/metrics.jsonl").read_text().splitlines() if '"loss"' in line])
    assert losses[0] == losses[1] and len(losses[0]) == 3


def _damage(prefix: Path, how: str) -> None:
    idx = bytearray((prefix.parent / (prefix.name + ".idx")).read_bytes())
    if how == "truncated index":
        del idx[-5:]
    elif how == "float dtype":
        idx[17] = 7
    elif how == "bad pointers":
        idx[34 + 4 * 40 + 8] ^= 0x01  # the second sequence's pointer
    elif how == "bad document indices":
        idx[-8:] = (10**6).to_bytes(8, "little")
    elif how == "version":
        idx[9] = 2
    (prefix.parent / (prefix.name + ".idx")).write_bytes(bytes(idx))
    if how == "truncated tokens":
        b = prefix.parent / (prefix.name + ".bin")
        b.write_bytes(b.read_bytes()[:-2])


@pytest.mark.parametrize("how,says", [
    ("truncated index", "is truncated"),
    ("float dtype", "holds float32 values, not token ids"),
    ("bad pointers", "not stored back to back"),
    ("bad document indices", "document indices do not run from 0"),
    ("version", "Megatron index version 2"),
    ("truncated tokens", "the token file is truncated"),
])
def test_a_damaged_megatron_corpus_is_refused_in_one_line(tmp_path: Path, capsys, how, says):
    tok = byte_tokenizer()
    (tmp_path / "tok.json").write_text(tok.to_json())
    _megatron_corpus(tmp_path / "m", tok)
    _damage(tmp_path / "m", how)
    code = main(["data", "inspect", str(tmp_path / "m"), "--tokenizer", str(tmp_path / "tok.json")])
    err = capsys.readouterr().err
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1


def test_out_of_vocabulary_ids_in_a_megatron_corpus_are_refused(tmp_path: Path):
    builder = IndexedDatasetBuilder(f"{tmp_path / 'm'}.bin", dtype=np.int32)
    builder.add_document(torch.tensor([1, 2, 999]), [3])
    builder.finalize(f"{tmp_path / 'm'}.idx")
    with pytest.raises(DataError, match="token id 999, outside its 257-token vocabulary"):
        IndexedDataset(tmp_path / "m", byte_tokenizer()).verify()


def test_megatron_blend_syntax():
    assert weighted_paths(["0.3 a 0.7 b"]) == [(0.3, "a"), (0.7, "b")]
    assert weighted_paths(["0.3", "a", "0.7", "b"]) == [(0.3, "a"), (0.7, "b")]
    assert weighted_paths(["0.3 a", "0.7 b"]) == [(0.3, "a"), (0.7, "b")]
    assert weighted_paths(["a", "b"]) == [(None, "a"), (None, "b")]
    for bad, says in ((["0.3 a 0.7"], 'must be "PREFIX" or "WEIGHT PREFIX"'),
                      (["0.3 a b c"], "the weight must be a positive number"),
                      (["0.3 a", "b"], "a weight for every dataset or for none"),
                      (["inf a"], "the weight must be a positive number")):
        with pytest.raises(ValueError, match=says):
            weighted_paths(bad)


def test_inspect_shows_a_megatron_dataset(tmp_path: Path, capsys):
    tok = byte_tokenizer()
    (tmp_path / "tok.json").write_text(tok.to_json())
    docs = _megatron_corpus(tmp_path / "m", tok)
    assert main(["data", "inspect", str(tmp_path / "m"), "--tokenizer", str(tmp_path / "tok.json"),
                 "--verify"]) == 0
    out = capsys.readouterr().out
    assert "format      Megatron-LM (MMIDIDX index)" in out
    assert f"documents   {len(docs)}" in out and "checksum    none in the Megatron format" in out
