"""JSON and TOML files tessel reads from users (tessel/fileio.py's read_json and read_toml):
one that is not UTF-8 text, not JSON or TOML, or nested deeper than Python's parser goes is
one line naming the file, never a UnicodeDecodeError or RecursionError traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessel.cli import main
from tessel.errors import TesselError
from tessel.fileio import read_json, read_toml

DAMAGED = [
    (b"\xff\xfe{}", "is not UTF-8 text (byte 0: invalid start byte)"),
    (b"[" * 100_000, "nests its arrays or tables too deep to read"),
]


@pytest.mark.parametrize("content, needle", [*DAMAGED, (b"{", "is not valid JSON")])
def test_a_damaged_json_file_is_one_line_naming_it(tmp_path: Path, content: bytes, needle: str):
    f = tmp_path / "x.json"
    f.write_bytes(content)
    with pytest.raises(TesselError) as info:
        read_json(f, "some file")
    assert str(info.value).startswith(f"some file {str(f)!r} ") and needle in str(info.value)
    assert len(str(info.value)) < 300


@pytest.mark.parametrize("content, needle", [
    (b"\xff\xfe", "is not UTF-8 text"), (b"a = " + b"[" * 100_000, "too deep to read"),
    (b"[x\n", "is not valid TOML")])
def test_a_damaged_toml_file_is_one_line_naming_it(tmp_path: Path, content: bytes, needle: str):
    f = tmp_path / "x.toml"
    f.write_bytes(content)
    with pytest.raises(TesselError, match=needle):
        read_toml(f, "some file")
    with pytest.raises(TesselError, match="does not exist"):
        read_toml(tmp_path / "none.toml", "some file")


@pytest.mark.parametrize("content, needle", DAMAGED)
def test_a_damaged_hf_config_is_one_line(tmp_path: Path, capsys, content: bytes, needle: str):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_bytes(content)
    assert main(["convert", "hf-to-tessel", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("tessel: error: ") and needle in err
    assert str(tmp_path / "hf" / "config.json") in err


def test_a_config_nested_too_deep_is_one_line(tmp_path: Path, capsys):
    f = tmp_path / "deep.toml"
    f.write_text("a = " + "[" * 100_000)
    assert main(["plan", str(f), "--gpus", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("tessel: error: config file ")
    assert "too deep to read" in err
