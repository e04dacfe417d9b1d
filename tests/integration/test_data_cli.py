"""`tessel tokenizer train`, `tessel preprocess` and `tessel data inspect` as a user runs them.

Through `tessel.cli.main` in this process (CI=true; stdout and stderr captured at the file
descriptors: not a terminal, as in a pipe), the same code as the command minus a ~5 s
start-up; one refusal goes through the real entry point (`python -m tessel`) for its exit
code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tessel.cli import main
from tessel.data.indexed import IndexedDataset
from tessel.data.preprocess import preprocess
from tessel.data.tokenizer import load_tokenizer, train_bpe

TEXTS = [f"Document {i}: the quick brown fox jumps over the lazy dog {i * 7} times.\n" for i in range(40)]


def tessel(*args: str | Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "CI": "true"}
    return subprocess.run([sys.executable, "-m", "tessel", *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=120)


def tessel_here(capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch,
                *args: str | Path) -> tuple[int, str, str]:
    """`tessel ARGS` in this process with CI=true: (exit code, stdout, stderr), captured at
    the file descriptors (what preprocess's forked workers or a native library write there
    counts too, as it would in a subprocess's pipes; test_cli's `tessel_here` sees only
    Python's sys.stdout and sys.stderr)."""
    monkeypatch.setenv("CI", "true")
    capfd.readouterr()
    code = main(list(map(str, args)))
    out, err = capfd.readouterr()
    return code, out, err


def assert_one_line_error(out: str, err: str, code: int, needle: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tessel: error: "), err
    assert needle in lines[0], lines[0]
    assert "Traceback" not in out + err


@pytest.fixture
def jsonl(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return path


def test_tokenizer_train_writes_a_loadable_tokenizer(tmp_path: Path, jsonl: Path, capfd,
                                                     monkeypatch):
    code, out, err = tessel_here(capfd, monkeypatch, "tokenizer", "train", "--input", jsonl,
                                 "--vocab-size", "300", "--output",
                                 tmp_path / "tok" / "tokenizer.json")
    assert code == 0, err
    assert "trained a 300-id byte-level BPE on 40 documents" in out and err == ""
    tok = load_tokenizer(tmp_path / "tok" / "tokenizer.json")
    assert tok.vocab_size == 300 and tok.decode(tok.encode(TEXTS[3])) == TEXTS[3]
    assert [p.name for p in (tmp_path / "tok").iterdir()] == ["tokenizer.json"]


def test_preprocess_writes_a_dataset_and_prints_only_the_summary(tmp_path: Path, jsonl: Path,
                                                                 capfd, monkeypatch):
    tok = train_bpe(TEXTS, 300)
    tok.save(tmp_path / "tok.json")
    code, out, err = tessel_here(capfd, monkeypatch, "preprocess", "--input", jsonl,
                                 "--tokenizer", tmp_path / "tok.json", "--output",
                                 tmp_path / "data" / "web", "--workers", "2", "--append-eod")
    assert code == 0, err
    assert err == "" and len(out.splitlines()) == 1  # CI: no progress bar
    assert out.startswith("preprocessed 40 documents")
    ds = IndexedDataset(tmp_path / "data" / "web")
    assert ds.n_docs == 40 and ds.tokenizer_fingerprint == tok.fingerprint()
    assert ds.tokenizer().decode(ds.document(5).tolist()) == TEXTS[5]


def test_data_inspect_prints_sizes_tokenizer_and_a_sample(tmp_path: Path, jsonl: Path, capfd,
                                                          monkeypatch):
    preprocess([jsonl], "bytes", tmp_path / "d", append_eod=True, progress=False)
    code, out, err = tessel_here(capfd, monkeypatch, "data", "inspect", tmp_path / "d.idx",
                                 "--verify")
    assert code == 0, err
    fields = dict(line.split(None, 1) for line in out.splitlines()[:3])
    assert fields == {"dataset": str(tmp_path / "d"), "documents": "40",
                      "tokens": f"{sum(len(t.encode()) + 1 for t in TEXTS):,}"}
    for needle in ("dtype       uint16", "vocab size  257", "tokenizer   ", "doc length  mean",
                   "checksum    ok", "  | Document 0: the quick brown fox"):
        assert needle in out


def test_bad_input_is_one_line_with_nothing_written(tmp_path: Path, capfd, monkeypatch):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": oops}\n')
    # the real entry point: its exit code and stderr
    out = tessel("preprocess", "--input", tmp_path / "bad.jsonl", "--output", tmp_path / "out" / "d")
    assert_one_line_error(out.stdout, out.stderr, out.returncode, "bad.jsonl:2: not valid JSON")
    assert not (tmp_path / "out").exists()
    code, out, err = tessel_here(capfd, monkeypatch, "preprocess", "--output",
                                 tmp_path / "out" / "d")
    assert_one_line_error(out, err, code, "required: --input")
    assert not (tmp_path / "out").exists()


def _corrupt(prefix: Path) -> Path:
    idx = prefix.with_suffix(".idx")
    raw = bytearray(idx.read_bytes())
    raw[20] ^= 0xFF
    idx.write_bytes(bytes(raw))
    return prefix


@pytest.mark.parametrize("args, needle", [
    (["preprocess", "--input", "{jsonl}", "--output", "{tmp}/o/d", "--workers", "0"],
     "--workers must be >= 1"),
    (["preprocess", "--input", "{tmp}/missing.txt", "--output", "{tmp}/o/d"],
     "missing.txt' does not exist"),
    (["preprocess", "--input", "{jsonl}", "--output", "{tmp}/o/d", "--tokenizer", "{tmp}/no.json"],
     "is neither 'bytes'"),
    (["preprocess", "--input", "{jsonl}", "--output", "{tmp}/o/d", "--json-key", "body"],
     "corpus.jsonl:1: no 'body' key"),
    (["preprocess", "--input", "{jsonl}", "--output", "{tmp}"], "is a directory; name the dataset"),
    (["preprocess", "--input", "{jsonl}", "--output", "{tmp}/o/d", "--bogus"], "unrecognized arguments"),
    (["tokenizer", "train", "--input", "{jsonl}", "--vocab-size", "100", "--output", "{tmp}/o/t.json"],
     "vocab size 100 is too small"),
    (["tokenizer", "train", "--input", "{jsonl}", "--vocab-size", "300", "--output", "{tmp}"],
     "is a directory"),
    (["tokenizer", "train", "--input", "{tmp}/nothing/*.jsonl", "--vocab-size", "300", "--output",
      "{tmp}/o/t.json"], "matches no files"),
    (["tokenizer", "fit"], "invalid choice: 'fit'"),
    (["data"], "the following arguments are required"),
    (["data", "inspect", "{tmp}/o/nothing"], "nothing.idx' is missing"),
    (["data", "inspect", "{corrupt}"], "header checksum mismatch"),
])
def test_bad_input_cases_in_process(tmp_path: Path, jsonl: Path, capsys, args: list[str], needle: str):
    corrupt = tmp_path / "c"
    if "{corrupt}" in args:
        preprocess([jsonl], "bytes", corrupt, progress=False)
        _corrupt(corrupt)
    argv = [a.format(tmp=tmp_path, jsonl=jsonl, corrupt=corrupt) for a in args]
    code = main(argv)
    out, err = capsys.readouterr()
    assert_one_line_error(out, err, code, needle)
    assert not (tmp_path / "o").exists()


def test_help_lists_the_data_commands(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for command in ("tessel tokenizer train", "tessel preprocess", "tessel data inspect"):
        assert command in text
    with pytest.raises(SystemExit) as exit_:
        main(["preprocess", "--help"])
    assert exit_.value.code == 0 and "--append-eod" in capsys.readouterr().out
