"""A crafted checkpoint cannot run code through any command that reads checkpoints.

Each payload creates a marker file when it runs. It is first shown to run under plain
`pickle` / `torch.load(weights_only=False)` (what stock DCP uses), so a test that passes
cannot be passing because the payload was inert. Then every entry point that reads a
checkpoint (`train --resume`, `generate`, `checkpoint consolidate`, `model.init_from`,
`convert tessel-to-hf`) must refuse it with one line and exit 2, without the marker appearing.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from conftest import forge_state, tiny_overrides, write_corpus

from tessel.checkpoint import CheckpointError, latest_checkpoint, read_full
from tessel.checkpoint.safe_load import read_metadata
from tessel.cli import main
from tessel.config import Config
from tessel.train import Trainer


def _unicode(s: str) -> bytes:
    b = s.encode()
    return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE


def _command(marker: Path) -> str:
    return f"touch {marker}"


def plain_payload(marker: Path) -> bytes:
    """A .metadata that calls os.system through __reduce__ (GLOBAL posix system)."""

    class Evil:
        def __reduce__(self):
            return (os.system, (_command(marker),))

    return pickle.dumps(Evil(), protocol=2)


def dotted_payload(marker: Path, tail: bytes = b".") -> bytes:
    """Protocol 4: STACK_GLOBAL with a module DCP really uses and the dotted name
    'os.system' (resolved by getattr): an allow-list of whole modules admits it."""
    call = (_unicode("torch.distributed.checkpoint.filesystem") + _unicode("os.system")
            + b"\x93" + _unicode(_command(marker)) + b"\x85R")  # STACK_GLOBAL, TUPLE1, REDUCE
    return b"\x80\x04" + call + (b"0" + tail if tail != b"." else b".")


def stealth_payload(marker: Path, original: bytes) -> bytes:
    """Runs the command, drops its result (POP), then unpickles the genuine metadata: under
    a check-then-load scheme the run would train normally and exit 0."""
    assert original[:2] == b"\x80\x04"
    return dotted_payload(marker, tail=original[2:])


PAYLOADS = {"plain": plain_payload, "dotted": dotted_payload, "stealth": stealth_payload}


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny run with a final checkpoint (model, optimizer, RNG), shared by the module."""
    root = tmp_path_factory.mktemp("secure")
    corpus = write_corpus(root / "corpus", n_docs=4, words_per_doc=200)
    cfg = Config.load(None, tiny_overrides(root / "run", corpus, **{"train.steps": 2}))
    trainer = Trainer(cfg, console=False)
    try:
        trainer.train()
    finally:
        trainer.close()
    (root / "run" / "corpus_path").write_text(str(corpus))
    return root / "run"


def _copy(run: Path, dest: Path) -> tuple[Path, Path]:
    shutil.copytree(run, dest, symlinks=True)
    ckpt = latest_checkpoint(dest / "checkpoints")
    assert ckpt is not None
    return dest, ckpt


def _entry_points(run: Path, ckpt: Path, tmp: Path) -> dict[str, list[str]]:
    corpus = (run / "corpus_path").read_text()
    fresh = tiny_overrides(tmp / "fresh", Path(corpus), **{"train.steps": 1})
    fresh_args = [f"--{k}={json.dumps(v)}" for k, v in fresh.items()]
    return {
        "resume": ["train", "--resume", str(run), "--train.steps=3", "--quiet"],
        "generate": ["generate", str(run), "--max-new-tokens", "2"],
        "consolidate": ["checkpoint", "consolidate", str(run), "--output", str(tmp / "m.st")],
        "init_from": ["train", *fresh_args, f"--model.init_from={json.dumps(str(ckpt))}",
                      "--quiet"],
        "export": ["convert", "tessel-to-hf", str(run), str(tmp / "hf")],
    }


def _assert_refused(argv: list[str], capsys: pytest.CaptureFixture, needle: str) -> None:
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, (argv[0], err)
    assert len(err) == 1 and err[0].startswith("tessel: error: ") and needle in err[0], err


@pytest.mark.parametrize("kind", list(PAYLOADS))
def test_crafted_metadata_is_refused_by_every_entry_point(
    kind: str, trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
):
    run, ckpt = _copy(trained_run, tmp_path / "run")
    marker = tmp_path / f"pwned-{kind}"
    original = (ckpt / ".metadata").read_bytes()
    payload = PAYLOADS[kind](marker, original) if kind == "stealth" else PAYLOADS[kind](marker)

    # The payload is live: plain pickle (what DCP itself calls) runs it.
    result = pickle.loads(payload)
    assert marker.exists(), "the payload must run under plain pickle, or this test proves nothing"
    if kind == "stealth":
        assert type(result).__name__ == "Metadata"  # and DCP would then train normally
    marker.unlink()

    (ckpt / ".metadata").write_bytes(payload)
    forge_state(ckpt)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    for name, argv in _entry_points(run, ckpt, tmp_path).items():
        _assert_refused(argv, capsys, "names ")
        assert not marker.exists(), f"{name} ran the payload"
    named = "posix.system" if kind == "plain" else "torch.distributed.checkpoint.filesystem.os.system"
    assert main(["checkpoint", "consolidate", str(run)]) == 2
    assert f"names {named}," in capsys.readouterr().err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before  # nothing saved
    assert not (tmp_path / "hf").exists() and not (tmp_path / "m.st").exists()


def _malicious_torch_blob(marker: Path) -> bytes:
    class Evil:
        def __reduce__(self):
            return (os.system, (_command(marker),))

    buf = io.BytesIO()
    torch.save({"lr": Evil()}, buf)
    return buf.getvalue()


def test_crafted_value_in_a_shard_is_refused(trained_run: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture):
    """Non-tensor values (optimizer hyper-parameters) sit in the .distcp shards as
    torch.save blobs that stock DCP reads with weights_only=False."""
    run, ckpt = _copy(trained_run, tmp_path / "run")
    marker = tmp_path / "pwned-bytes"
    blob = _malicious_torch_blob(marker)
    torch.load(io.BytesIO(blob), weights_only=False)  # live under stock DCP's call
    assert marker.exists()
    marker.unlink()

    # Point every bytes item of the metadata at the blob, appended to the shard, and fix up
    # sizes in state.json as an attacker who controls the whole directory would.
    md = read_metadata(ckpt)
    shard = ckpt / "__0_0.distcp"
    offset = shard.stat().st_size
    with shard.open("ab") as f:
        f.write(blob)
    n = 0
    for index, info in md.storage_data.items():
        if type(md.state_dict_metadata[index.fqn]).__name__ == "BytesStorageMetadata":
            info.offset, info.length = offset, len(blob)
            n += 1
    assert n > 0, "the optimizer state must hold non-tensor values for this test to mean anything"
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    forge_state(ckpt)

    _assert_refused(["train", "--resume", str(run), "--train.steps=3", "--quiet"], capsys,
                    "is not plain data")
    assert not marker.exists()


def test_metadata_cannot_point_outside_the_checkpoint(trained_run: Path, tmp_path: Path):
    run, ckpt = _copy(trained_run, tmp_path / "run")
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\0" * 4096)
    md = read_metadata(ckpt)
    for info in md.storage_data.values():
        info.relative_path = "../../../secret.bin"
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    forge_state(ckpt)
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        read_full(ckpt, "model")


def test_damaged_or_missing_metadata_is_one_line(trained_run: Path, tmp_path: Path):
    run, ckpt = _copy(trained_run, tmp_path / "run")
    (ckpt / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(CheckpointError, match="is damaged: .metadata does not match its checksum"):
        read_full(ckpt, "model")
    forge_state(ckpt)
    with pytest.raises(CheckpointError, match="is damaged"):
        read_full(ckpt, "model")
    (ckpt / ".metadata").write_bytes(struct.pack("<I", 7))
    forge_state(ckpt)
    with pytest.raises(CheckpointError, match="is damaged"):
        read_full(ckpt, "model")
    (ckpt / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="metadata file is missing"):
        read_full(ckpt, "model")


def test_only_safe_load_unpickles_checkpoints():
    """The guard is on every path: no other module of tessel reads a pickle or calls DCP's
    loader or reader directly."""
    root = Path(__file__).resolve().parents[2] / "tessel"
    needles = ("pickle.load", "torch.load(", "dcp.load(", "FileSystemReader(",
               "checkpoint.load(", "import pickle")
    offenders = []
    for path in root.rglob("*.py"):
        if path.name == "safe_load.py":
            continue
        text = path.read_text()
        offenders += [f"{path.relative_to(root)}: {n}" for n in needles if n in text]
    assert offenders == []


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink() and p.name != ".lock"}


def _refused_by_every_reader(run: Path, ckpt: Path, tmp: Path, capsys: pytest.CaptureFixture,
                             needle: str) -> None:
    """Every command that reads a run refuses it: exit 2, one line holding `needle`, nothing
    written in the run or outside it."""
    before = _files(run)
    for argv in _entry_points(run, ckpt, tmp).values():
        _assert_refused(argv, capsys, needle)
    assert _files(run) == before
    assert not any((tmp / p).exists() for p in ("fresh", "m.st", "hf"))


def _deep(state: dict) -> str:
    return json.dumps(state)[:-1] + ', "loader": ' + "[" * 200_000 + "]" * 200_000 + "}"


# name -> what is done to the parsed state.json (or the text or bytes written instead of it)
DAMAGE = {
    "nested 200,000 deep": _deep,
    "files a list": lambda s: {**s, "files": list(s["files"])},
    "loader text": lambda s: {**s, "loader": "position 7"},
    "step two": lambda s: {**s, "step": "two"},
    "step a boolean": lambda s: {**s, "step": True},
    "a file size as text": lambda s: {**s, "files": {k: str(v) for k, v in s["files"].items()}},
    "config a list": lambda s: {**s, "config": []},
    "config.model a list": lambda s: {**s, "config": {**s["config"], "model": [1]}},
    "not an object": lambda s: [s],
    "not UTF-8": lambda s: json.dumps(s).encode().replace(b'"step"', b'"st\xffep"'),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_state_json_is_one_line_for_every_reader(
        damage: str, trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture):
    """state.json nested 200,000 deep, `files` a list, `loader` text or `step` "two" gave
    tracebacks in `train --resume`, `generate` and `consolidate` (round 3, item 14): every
    reader checks it in one place and says the checkpoint is damaged, and how to go on."""
    run, ckpt = _copy(trained_run, tmp_path / "run")
    state = json.loads((ckpt / "state.json").read_text())
    state.pop("state_sha256")  # what a forger (or a careless hand) leaves out
    damaged = DAMAGE[damage](state)
    if not isinstance(damaged, bytes):
        damaged = (damaged if isinstance(damaged, str) else json.dumps(damaged)).encode()
    (ckpt / "state.json").write_bytes(damaged)
    _refused_by_every_reader(run, ckpt, tmp_path, capsys, "is damaged: its state.json ")


def test_an_edited_model_setting_is_refused_by_every_reader(
        trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture):
    """The run's config.toml changed after the checkpoint on a setting that fixes what its
    tensors mean (here the norm's epsilon, which no tensor shape shows): exports, sampling and
    model.init_from computed with the edited value (round 3, item 11); each refuses it as
    `train --resume` does, naming the change."""
    run, ckpt = _copy(trained_run, tmp_path / "run")
    config = run / "config.toml"
    text = config.read_text()
    edited = re.sub(r"(?m)^norm_eps = .*$", "norm_eps = 0.5", text, count=1)
    assert edited != text
    config.write_text(edited)
    _refused_by_every_reader(run, ckpt, tmp_path, capsys, "model.norm_eps was ")


def test_a_checkpoint_with_non_finite_weights_is_refused_by_every_reader(
        trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture):
    """Weights holding NaN (saved as they are, by hand or by a tessel that did not check) are
    never sampled from, exported, consolidated or started from silently (round 3, item 12):
    each reader names the tensor."""
    from tessel.checkpoint import save_checkpoint
    from tessel.models import build_model

    run, ckpt = _copy(trained_run, tmp_path / "run")
    state = json.loads((ckpt / "state.json").read_text())
    weights = read_full(ckpt, "model")
    weights["layers.0.attention.wq.weight"][1, 2] = float("nan")
    model = build_model(Config.load(run / "config.toml").model)
    model.load_state_dict(weights, strict=False)
    kept = {k: v for k, v in state.items()
            if k not in ("format", "step", "files", "crc32", "state_sha256")}
    newest = save_checkpoint(run / "checkpoints", state["step"] + 1, model, None, kept)
    needle = "tensor 'layers.0.attention.wq.weight' holds 1 NaN or infinite value(s)"
    entry_points = _entry_points(run, newest, tmp_path)
    del entry_points["resume"]  # training on: its own checks judge every step (monitoring.md)
    for argv in entry_points.values():
        _assert_refused(argv, capsys, needle)
    assert not any((tmp_path / p).exists() for p in ("fresh", "m.st", "hf"))
