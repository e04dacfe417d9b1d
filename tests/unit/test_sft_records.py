"""Fine-tuning records that are not clean text are handled as pretraining documents are:
bytes that are not UTF-8 and lone surrogates are replaced and counted in the start-up line, a
string made mostly of them is refused, and a line nested too deep to parse is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tessel.config import Config
from tessel.data import build_data
from tessel.data.readers import ReadStats, iter_documents, iter_json_records
from tessel.errors import DataError

GOOD = json.dumps({"messages": [{"role": "user", "content": "hi there"},
                                {"role": "assistant", "content": "hello to you"}]}).encode()


def _config(tmp_path: Path, data: Path, **extra) -> Config:
    return Config.load(None, {"data.source": "sft", "data.paths": [str(data)],
                              "data.tokenizer": "auto", "model.vocab_size": 320,
                              "data.chat_template": "chatml", "data.split": "100,0",
                              "data.cache_dir": str(tmp_path / "cache"), "train.seq_len": 64,
                              "train.micro_batch_size": 1, **extra})


def _write(path: Path, *lines: bytes) -> Path:
    path.write_bytes(b"\n".join([GOOD] * 20 + list(lines)) + b"\n")
    return path


def test_invalid_utf8_and_lone_surrogates_are_replaced_and_counted(tmp_path: Path):
    """A lone surrogate (JSON "\\ud800") was a UnicodeEncodeError traceback in the BPE
    training; bytes that are not UTF-8 were replaced without being counted."""
    data = _write(tmp_path / "chats.jsonl",
                  b'{"prompt": "caf\xe9 \\ud800?", "completion": "yes \\ud83d\\ude00"}',
                  b'{"messages": [{"role": "user", "content": "x"}, '
                  b'{"role": "assistant", "content": "na\xefve"}]}')
    stats = ReadStats()
    records = [obj for _, obj in iter_json_records(data, stats)]
    assert records[20] == {"prompt": "caf\ufffd \ufffd?", "completion": "yes \U0001f600"}
    assert records[21]["messages"][1]["content"] == "na\ufffdve"
    assert (stats.documents, stats.invalid_utf8) == (22, 2)
    lines: list[str] = []
    build_data(_config(tmp_path, data), console=lines.append)  # a BPE trained on them
    summary = next(line for line in lines if line.startswith("sft: "))
    assert summary.startswith("sft: 22 examples,")
    assert summary.endswith("; invalid UTF-8 replaced in 2 of 22 records)"), summary


def test_a_string_made_mostly_of_invalid_bytes_is_refused(tmp_path: Path):
    """A reply of 40 bytes that are not UTF-8 was learned as 40 U+FFFD; pretraining refuses
    such a document."""
    data = _write(tmp_path / "chats.jsonl",
                  b'{"prompt": "q", "completion": "' + bytes(range(0x80, 0xA8)) + b'"}')
    with pytest.raises(DataError, match=r"chats.jsonl:21: 40 of 40 characters are not UTF-8"):
        build_data(_config(tmp_path, data), console=lambda _: None)
    assert not any((tmp_path / "cache").glob("sft-*"))


def test_a_line_nested_too_deep_is_one_line(tmp_path: Path):
    data = _write(tmp_path / "chats.jsonl",
                  b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    with pytest.raises(DataError, match=r"chats.jsonl:21: JSON nested too deeply to read"):
        build_data(_config(tmp_path, data), console=lambda _: None)


def test_pretraining_lines_nested_too_deep_are_one_line_too(tmp_path: Path):
    path = tmp_path / "docs.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n")
    with pytest.raises(DataError, match=r"docs.jsonl:2: JSON nested too deeply to read"):
        list(iter_documents(path))


def test_parquet_and_hf_datasets_train_as_their_jsonl(tmp_path: Path):
    """Fine-tuning records in columns (Parquet; a Hugging Face save_to_disk directory) give
    the JSONL's examples: the same start-up line, the same packed tokens."""
    import datasets
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{"messages": [{"role": "user", "content": f"hi {i} there"},
                             {"role": "assistant", "content": "hello to you" + "!" * (i % 5)}]}
               for i in range(24)]
    jsonl = tmp_path / "chats.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "chats.parquet")
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "chats_ds"))
    seen = {}
    for name in ("chats.jsonl", "chats.parquet", "chats_ds"):
        lines: list[str] = []
        data = build_data(_config(tmp_path / name.replace(".", "_"), tmp_path / name),
                          console=lines.append)
        batch = data.train.next_batch()
        seen[name] = (next(line for line in lines if line.startswith("sft: ")),
                      np.asarray(batch.inputs), np.asarray(batch.targets))
    want = seen["chats.jsonl"]
    assert want[0].startswith("sft: 24 examples,")
    for name in ("chats.parquet", "chats_ds"):
        assert seen[name][0] == want[0]
        assert (seen[name][1] == want[1]).all() and (seen[name][2] == want[2]).all()
