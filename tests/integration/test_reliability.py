"""Nothing lost, nothing silent: one regression test per finding of the hostile probe
(the reliability issue), each failing on the code before it."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_overrides, write_corpus

from tessel.checkpoint import list_checkpoints, read_full, save_checkpoint
from tessel.checkpoint.checksum import DIGEST_KEY
from tessel.cli import main
from tessel.config import ModelConfig
from tessel.models import build_model
from tessel.observe.events import read_jsonl
from tessel.train.run_dir import RunDir

SECRET_URL = "https://bot:hunter2@hooks.example.com/services/T0KEN-SECRET"


def _args(overrides: dict) -> list[str]:
    return [f"--{k}={json.dumps(v)}" for k, v in overrides.items()]


def _train(run: Path, corpus: Path, *extra: str, **overrides) -> int:
    base = tiny_overrides(run, corpus, **{"train.steps": 4, "checkpoint.interval": 2, **overrides})
    return main(["train", *_args(base), "--quiet", *extra])


def _one_line(capsys: pytest.CaptureFixture, needle: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tessel: error: ") and needle in err[0], err
    return err[0]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("rel") / "corpus", n_docs=6, words_per_doc=200)


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    """A 4-step run with checkpoints at steps 2 and 4 and a webhook alert holding a secret."""
    root = tmp_path_factory.mktemp("rel-run")
    config = root / "alerts.toml"
    config.write_text('[[alerts]]\nname = "never"\nwhen = "loss.above"\nthreshold = 1e9\n'
                      f'notify = ["webhook"]\nwebhook_url = "{SECRET_URL}"\n')
    base = tiny_overrides(root / "run", corpus, **{"train.steps": 4, "checkpoint.interval": 2})
    assert main(["train", str(config), *_args(base), "--quiet"]) == 0
    return root / "run"


def _copy(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest, symlinks=True)
    return dest


# ---- 2: secrets -----------------------------------------------------------------------------


def test_secrets_are_never_printed_nor_copied_into_checkpoints(finished: Path, capsys):
    assert main(["config", str(finished / "config.toml")]) == 0
    out = capsys.readouterr().out
    assert "hooks.example.com" in out and "hunter2" not in out and "T0KEN" not in out
    for ckpt in (finished / "checkpoints").glob("step_*"):
        text = (ckpt / "state.json").read_text()
        assert "hunter2" not in text and "T0KEN" not in text, ckpt
    # the run's own config.toml keeps it (resume needs it)
    assert SECRET_URL in (finished / "config.toml").read_text()


# ---- 4: checkpoint content ------------------------------------------------------------------


def test_a_shard_with_flipped_bytes_is_refused_on_resume(finished: Path, tmp_path: Path, capsys):
    run = _copy(finished, tmp_path / "run")
    latest = run / "checkpoints" / "step_00000004"
    shard = latest / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x40  # same size: only a checksum can tell
    shard.write_bytes(bytes(data))
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert main(["train", "--resume", str(run), "--train.steps=8", "--quiet"]) == 2
    line = _one_line(capsys, "__0_0.distcp does not match its checksum")
    assert "step_00000004" in line and "move that directory out of checkpoints/" in line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before  # nothing rotated
    # the advice works: without the damaged one, the run resumes from step 2
    shutil.move(str(latest), str(tmp_path / "aside"))
    os.unlink(run / "checkpoints" / "latest")
    assert main(["train", "--resume", str(run), "--train.steps=5", "--quiet"]) == 0
    assert [s for s, _ in list_checkpoints(run / "checkpoints")][-1] == 5


def test_a_checkpoint_without_state_json_is_refused_on_resume(finished: Path, tmp_path: Path,
                                                              capsys):
    """Resume used to fall back to the checkpoint before without a word (issue 27, item
    10); the docs say a person decides, as for other damage."""
    run = _copy(finished, tmp_path / "run")
    (run / "checkpoints" / "step_00000004" / "state.json").unlink()
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    metrics = (run / "metrics.jsonl").read_text()
    assert main(["train", "--resume", str(run), "--train.steps=8", "--quiet"]) == 2
    line = _one_line(capsys, "step_00000004' is damaged: its state.json is missing")
    assert "move that directory out of checkpoints/" in line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    assert (run / "metrics.jsonl").read_text() == metrics


def test_every_checkpoint_file_has_a_checksum(finished: Path):
    for ckpt in (finished / "checkpoints").glob("step_*"):
        state = json.loads((ckpt / "state.json").read_text())
        assert set(state[DIGEST_KEY]) == set(state["files"]) == {".metadata", "__0_0.distcp"}


# ---- 8: non-finite settings and divergence ---------------------------------------------------


@pytest.mark.parametrize("value", ["inf", "nan", "1e10"])
def test_absurd_learning_rates_are_refused_before_anything_starts(value, corpus, tmp_path, capsys):
    assert _train(tmp_path / "run", corpus, f"--optim.lr={value}") == 2
    _one_line(capsys, "optim.lr")
    assert not (tmp_path / "run").exists()


def test_a_diverged_run_exits_non_zero_and_never_saves_non_finite_weights(
        corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TESSEL_FAULT", "nan:batch=2")  # the third step's loss is NaN
    run = tmp_path / "run"
    assert _train(run, corpus, **{"train.steps": 6}) == 6
    line = _one_line(capsys, "is not finite; training diverged")
    assert "the last checkpoint (step 2) holds finite weights" in line
    assert [s for s, _ in list_checkpoints(run / "checkpoints")] == [2]
    weights = read_full(run / "checkpoints" / "step_00000002", "model")
    assert all(torch.isfinite(t).all() for t in weights.values())
    # --auto-resume does not start it again by itself (it would diverge again)
    assert RunDir(run).halted()["exit_code"] == 6


# ---- 9: metrics file and run directory ------------------------------------------------------


def test_a_half_written_metrics_line_does_not_swallow_the_next_record(finished, tmp_path, capsys):
    run = _copy(finished, tmp_path / "run")
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "loss": 1.2')  # the crash came mid-write
    assert main(["train", "--resume", str(run), "--train.steps=5", "--quiet"]) == 0
    rows, bad = read_jsonl(run / "metrics.jsonl")
    assert bad == 0 and any(r["step"] == 5 and "loss" in r for r in rows)


def test_an_empty_run_dir_is_refused(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _train(tmp_path / "unused", corpus, "--run.dir=") == 2
    _one_line(capsys, "run.dir")
    assert list(tmp_path.iterdir()) == []


# ---- 10: one writer per run directory ---------------------------------------------------------


def test_a_second_process_on_a_run_is_refused_in_one_line(finished, tmp_path, capsys):
    run = _copy(finished, tmp_path / "run")
    holder = RunDir(run)
    holder.lock()
    try:
        assert main(["train", "--resume", str(run), "--train.steps=6", "--quiet"]) == 2
        _one_line(capsys, "is in use by another tessel process")
        assert main(["checkpoint", "consolidate", str(run)]) == 2
        _one_line(capsys, "is in use by another tessel process")
    finally:
        holder.unlock()
    assert main(["train", "--resume", str(run), "--train.steps=5", "--quiet"]) == 0


# ---- 11, 12: a save that fails -----------------------------------------------------------------


def test_disk_full_during_a_save_is_one_line_and_leaves_nothing_half_written(corpus, tmp_path):
    """A real write failure: the process may not write files above 150 KB (RLIMIT_FSIZE,
    EFBIG), so the tokenized corpus and metrics fit and the checkpoint shard does not."""
    run = tmp_path / "run"

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (150_000, 150_000))

    base = tiny_overrides(run, corpus, **{"train.steps": 2})
    proc = subprocess.run([sys.executable, "-m", "tessel", "train", *_args(base)],
                          capture_output=True, text=True, preexec_fn=limit, timeout=300,
                          env={**os.environ, "CI": "true"})
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(err) == 1 and "could not save the checkpoint of step 2" in err[0], proc.stderr
    assert "File too large" in err[0] and "Traceback" not in proc.stderr
    assert [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".")] == []


def test_a_ctrl_c_inside_a_save_stays_a_ctrl_c_and_removes_the_partial_save(tmp_path, monkeypatch):
    """DCP wraps everything a rank raises, a KeyboardInterrupt too, in its CheckpointException
    (a BaseException): the second Ctrl-C during the shutdown checkpoint became a traceback
    with exit 1 instead of exit 130."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    def interrupted(*_args, **_kwargs):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as exc:
            raise CheckpointException("save", {0: (exc, None)}) from None

    monkeypatch.setattr(dcp, "save", interrupted)
    model = build_model(ModelConfig(preset="tiny"), seed=0)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 1, model, None, {})
    assert list(tmp_path.iterdir()) == []


# ---- 13, 14: absurd sizes and small ones ------------------------------------------------------


@pytest.mark.parametrize("override", ["--model.vocab_size=1000000000000",
                                      "--model.d_model=10000000"])
def test_a_model_no_machine_can_hold_is_refused_before_allocating(override, corpus, tmp_path,
                                                                   capsys):
    extra = ["--model.n_heads=1"] if "d_model" in override else []
    assert _train(tmp_path / "run", corpus, override, *extra) == 2
    _one_line(capsys, "GiB for its weights, gradients and optimizer state on this machine")


def test_small_things_are_one_line(finished, tmp_path, corpus, capsys):
    assert main(["train", str(tmp_path)]) == 2
    _one_line(capsys, "is a directory")
    run = _copy(finished, tmp_path / "run")
    (run / "checkpoints" / "step_00000004" / ".metadata").unlink()
    assert main(["generate", str(run), "--max-new-tokens", "2"]) == 2
    _one_line(capsys, ".metadata is missing")
    base = tiny_overrides(tmp_path / "x", corpus)
    base.pop("data.source")
    assert main(["train", *_args(base), "--quiet"]) == 2  # data.paths, default source
    _one_line(capsys, 'data.paths is set but data.source = "stdlib" does not read it')


# ---- 3: a Hugging Face index that points outside its directory --------------------------------


def test_an_hf_index_cannot_name_files_outside_the_model_directory(tmp_path, capsys):
    from safetensors.torch import save_file

    secret = tmp_path / "other"
    secret.mkdir()
    save_file({"x": torch.zeros(2)}, str(secret / "model.safetensors"))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 64,
        "n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 64}))
    for target in ("../other/model.safetensors", str(secret / "model.safetensors")):
        (hf / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {"transformer.wte.weight": target}}))
        assert main(["convert", "hf-to-tessel", str(hf), str(tmp_path / "out")]) == 2
        _one_line(capsys, "which is not a file of")
        assert not (tmp_path / "out").exists()


# ---- 5: preprocess never overwrites without being asked -----------------------------------


def test_preprocess_refuses_its_own_input_and_an_existing_dataset(corpus, tmp_path, capsys):
    out = tmp_path / "web"
    args = ["preprocess", "--input", str(corpus), "--output", str(out), "--quiet"]
    assert main(args) == 0
    first = (tmp_path / "web.bin").read_bytes()
    assert main(args) == 2
    _one_line(capsys, "already exists")
    assert main([*args, "--force"]) == 0 and (tmp_path / "web.bin").read_bytes() == first
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious text\n")
    for output in (str(tmp_path / "victim"), str(victim)):
        assert main(["preprocess", "--input", str(victim), "--output", output, "--force"]) == 2
        _one_line(capsys, "would overwrite the input")
    assert victim.read_bytes() == b"precious text\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# ---- 6, 7: data that changed or was damaged -------------------------------------------------


def _indexed(corpus: Path, out: Path) -> Path:
    assert main(["preprocess", "--input", str(corpus), "--output", str(out), "--quiet",
                 "--append-eod"]) == 0
    return out


def _train_indexed(prefix: Path, run: Path, corpus: Path) -> int:
    base = tiny_overrides(run, corpus, **{"data.source": "indexed", "data.paths": [str(prefix)],
                                          "data.tokenizer": "auto", "train.steps": 2})
    return main(["train", *_args(base), "--quiet"])


def test_token_ids_overwritten_in_place_are_refused_when_training_opens_them(
        corpus, tmp_path, capsys):
    prefix = _indexed(corpus, tmp_path / "web")
    bin_path = tmp_path / "web.bin"
    data = bytearray(bin_path.read_bytes())
    data[100:104] = bytes([7, 0, 7, 0])  # valid ids, wrong content
    bin_path.write_bytes(bytes(data))
    assert _train_indexed(prefix, tmp_path / "run", corpus) == 2
    _one_line(capsys, "web.bin checksum mismatch")
    assert not (tmp_path / "run").exists()


def test_out_of_vocabulary_ids_are_refused_at_open_not_mid_run(tmp_path, corpus, capsys):
    """Ids outside the vocabulary in a file whose checksums agree (rewritten by a tool that
    updated them): refused when the dataset is opened, not an IndexError in the embedding."""
    import struct
    import zlib

    prefix = _indexed(corpus, tmp_path / "web")
    bin_path, idx_path = tmp_path / "web.bin", tmp_path / "web.idx"
    data = bytearray(bin_path.read_bytes())
    data[200:202] = struct.pack("<H", 299)  # uint16 ids; the byte vocabulary has 257
    bin_path.write_bytes(bytes(data))
    idx = bytearray(idx_path.read_bytes())
    idx[72:76] = struct.pack("<I", zlib.crc32(bytes(data)))
    idx[76:80] = struct.pack("<I", zlib.crc32(bytes(idx[:76])))
    idx_path.write_bytes(bytes(idx))
    assert _train_indexed(prefix, tmp_path / "run", corpus) == 2
    _one_line(capsys, "holds token id 299, outside its 257-token vocabulary")


def test_a_corpus_too_small_for_its_validation_split_is_refused(tmp_path, capsys):
    one = write_corpus(tmp_path / "one", n_docs=1, words_per_doc=300)
    assert _train(tmp_path / "run", one) == 2
    _one_line(capsys, "asks for a validation split, but it holds 0 sample(s)")
    assert _train(tmp_path / "run", one, '--data.split="100,0"', "--checkpoint.interval=0") == 0


def test_a_corpus_whose_content_changed_before_the_resume_is_refused(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus", n_docs=6, words_per_doc=200)
    run = tmp_path / "run"
    assert _train(run, corpus) == 0
    doc = corpus / "doc000.txt"
    text = doc.read_text()
    doc.write_text(text.replace("the", "teh"))  # same size, other tokens
    assert doc.stat().st_size == len(text.encode())
    assert main(["train", "--resume", str(run), "--train.steps=6", "--quiet"]) == 2
    _one_line(capsys, "changed since the checkpoint")


# ---- 14: output into a closed pipe ------------------------------------------------------------


def test_output_into_a_closed_pipe_is_quiet(corpus, tmp_path):
    """`tessel data inspect PREFIX | head` printed "error: Broken pipe": here the reader
    closes its end before tessel writes anything."""
    prefix = _indexed(corpus, tmp_path / "web")
    proc = subprocess.Popen([sys.executable, "-m", "tessel", "data", "inspect", str(prefix)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "CI": "true"})
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and err == "", err
