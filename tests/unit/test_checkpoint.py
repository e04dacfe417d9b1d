import json
from pathlib import Path

import pytest
import torch
from conftest import forge_state

from tessel.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_model,
    load_optimizer,
    read_state,
    save_checkpoint,
    store,
)
from tessel.config import ModelConfig, OptimConfig
from tessel.models import build_model
from tessel.optim.groups import build_optimizer


def _model_and_opt(seed: int = 0):
    model = build_model(ModelConfig(preset="tiny-llama"), seed=seed)
    opt = build_optimizer(model, OptimConfig(), torch.device("cpu"))
    model(torch.randint(0, 512, (2, 8))).sum().backward()
    opt.step()
    return model, opt


def test_round_trip_is_exact(tmp_path: Path):
    model, opt = _model_and_opt()
    rng = {"torch_cpu": torch.get_rng_state()}
    path = save_checkpoint(tmp_path, 3, model, opt, {"loader": {"epoch": 1}}, rng)
    assert path.name == "step_00000003" and (tmp_path / "latest").resolve() == path.resolve()
    model2, opt2 = _model_and_opt(seed=1)
    load_model(path, model2)
    load_optimizer(path, model2, opt2)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert s1.keys() == s2.keys()
    for k in s1:
        for key in s1[k]:
            assert torch.equal(s1[k][key], s2[k][key])
    assert read_state(path)["loader"] == {"epoch": 1}


def test_tied_weights_saved_once_and_restored_tied(tmp_path: Path):
    model = build_model(ModelConfig(preset="tiny"), seed=0)
    path = save_checkpoint(tmp_path, 1, model, None, {})
    other = build_model(ModelConfig(preset="tiny"), seed=9)
    load_model(path, other)
    assert other.output.weight is other.tok_embeddings.weight
    assert torch.equal(other.output.weight, model.output.weight)


def test_keep_last(tmp_path: Path):
    model, opt = _model_and_opt()
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, model, opt, {}, keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5]


def test_failure_during_save_leaves_previous_checkpoint_intact(tmp_path: Path, monkeypatch):
    model, opt = _model_and_opt()
    good = save_checkpoint(tmp_path, 1, model, opt, {"marker": "good"})
    before = {p.name: p.read_bytes() for p in good.iterdir()}

    def crash(path, data):  # dies after the tensors were written, before state.json
        raise KeyboardInterrupt

    monkeypatch.setattr(store, "_write_json", crash)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, model, opt, {})
    monkeypatch.undo()

    assert latest_checkpoint(tmp_path) == good
    assert (tmp_path / "latest").resolve() == good.resolve()
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before
    assert read_state(good)["marker"] == "good"
    # the next save cleans the leftover and succeeds
    save_checkpoint(tmp_path, 2, model, opt, {})
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1, 2]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_a_checkpoint_that_lost_its_state_json_is_refused_not_passed_over(tmp_path: Path):
    """A published checkpoint without state.json was complete and damaged since: refused,
    naming it, rather than falling back to the one before on its own (issue 27, item 10). A
    save that never completed (a crash before state.json, a hidden temporary) is skipped."""
    from tessel.checkpoint import find_checkpoint

    model, opt = _model_and_opt()
    root = tmp_path / "checkpoints"
    first = save_checkpoint(root, 1, model, opt, {})
    second = save_checkpoint(root, 2, model, opt, {})
    unfinished = root / ".tmp-step_00000003"  # what a crash mid-save leaves
    unfinished.mkdir()
    (unfinished / "__0_0.distcp").write_bytes(b"partial")
    assert latest_checkpoint(root) == second
    (second / "state.json").unlink()
    needle = r"step_00000002' is damaged: its state.json is missing.*move that directory out"
    for look in (lambda: latest_checkpoint(root), lambda: find_checkpoint(tmp_path),
                 lambda: find_checkpoint(second)):
        with pytest.raises(CheckpointError, match=needle):
            look()
    assert [s for s, _ in list_checkpoints(root)] == [1]  # (retention ignores it)
    second.rename(tmp_path / "aside")  # what the message advises: then the one before
    assert latest_checkpoint(root) == first == find_checkpoint(tmp_path)


def test_damaged_checkpoints_are_refused_in_one_line(tmp_path: Path):
    model, opt = _model_and_opt()
    path = save_checkpoint(tmp_path, 1, model, opt, {})
    f = path / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="is damaged: __0_0.distcp has"):
        read_state(path)
    (path / "state.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="is damaged: its state.json is not valid JSON"):
        read_state(path)
    meta = {"format": 99}
    (path / "state.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="format 99"):
        read_state(path)


def test_shape_mismatch_names_the_tensor(tmp_path: Path):
    model, opt = _model_and_opt()
    path = save_checkpoint(tmp_path, 1, model, opt, {})
    other = build_model(ModelConfig(preset="tiny-llama", ffn_hidden=128), seed=0)
    with pytest.raises(CheckpointError, match="'layers.0.feed_forward.w1.weight' has shape"):
        load_model(path, other)


def test_metadata_that_could_run_code_is_refused(tmp_path: Path):
    """DCP's .metadata is a pickle: it is vetted before DCP reads it."""
    import os
    import pickle

    model, opt = _model_and_opt()
    path = save_checkpoint(tmp_path, 1, model, opt, {})

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    (path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match=r"damaged: \.metadata does not match its checksum"):
        load_model(path, model)  # a plain tamper: state.json's checksum disagrees
    forge_state(path)  # an attacker rewrites state.json too: the unpickler still refuses
    with pytest.raises(CheckpointError, match="refusing to load .*names posix.system"):
        load_model(path, model)
    assert not (tmp_path / "pwned").exists()
    (path / ".metadata").write_bytes(b"\x80\x04garbage")
    forge_state(path)
    with pytest.raises(CheckpointError, match="damaged"):
        load_model(path, model)


def test_a_shard_with_flipped_bytes_is_refused_naming_the_file(tmp_path: Path):
    """Same size, different content: only the checksum can tell (issue: step 121's loss was
    686 after such a flip, and the run went on saving checkpoints from it)."""
    model, opt = _model_and_opt()
    path = save_checkpoint(tmp_path, 1, model, opt, {})
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    read_state(path)  # the sizes still agree
    with pytest.raises(CheckpointError, match="__0_0.distcp does not match its checksum.*move "
                                              "that directory out of checkpoints/"):
        load_model(path, model)
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        load_optimizer(path, model, opt)


def test_files_are_dcp_shards_plus_json(tmp_path: Path):
    model, opt = _model_and_opt()
    path = save_checkpoint(tmp_path, 1, model, opt, {})
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", "state.json"]


def test_consolidate_writes_the_whole_model_once(tmp_path: Path):
    from safetensors import safe_open

    from tessel.checkpoint.consolidate import consolidate
    from tessel.cli import main

    model = build_model(ModelConfig(preset="tiny"), seed=0)  # tied embeddings
    cfg = {"model": {"tie_embeddings": True}}
    path = save_checkpoint(tmp_path / "checkpoints", 5, model, None, {"config": cfg})
    out = tmp_path / "model.safetensors"
    n, _, note = consolidate(path, out)
    assert note == ""  # not a LoRA run: the checkpoint's own tensors
    with safe_open(str(out), "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
        assert f.metadata()["step"] == "5"
    expected = {k: v for k, v in model.state_dict().items() if k != "output.weight"}
    assert n == len(expected) and saved.keys() == expected.keys()
    for k in expected:
        assert torch.equal(saved[k], expected[k])
    # the command: a run directory means its latest checkpoint
    out.unlink()
    assert main(["checkpoint", "consolidate", str(tmp_path)]) == 0 and out.is_file()
    assert main(["checkpoint", "consolidate", str(tmp_path / "nothing")]) == 2


def test_checksum_is_the_standard_crc32_of_the_whole_file_across_blocks(tmp_path, monkeypatch):
    import os
    import zlib

    from tessel.checkpoint import checksum

    monkeypatch.setattr(checksum, "_BLOCK", 1000)  # many blocks, combined on a thread pool
    for n in (0, 1, 999, 1000, 1001, 7777):
        data = os.urandom(n)
        (tmp_path / "f").write_bytes(data)
        assert checksum.file_digests([tmp_path / "f"]) == {"f": f"{zlib.crc32(data):08x}"}
    with pytest.raises(checksum.ChecksumMismatch, match="f does not match its checksum"):
        checksum.check(tmp_path / "f", f"{zlib.crc32(data) ^ 1:08x}")


def test_every_rank_hashes_a_share_and_rank_0_gathers_all_of_them(tmp_path):
    import zlib

    from tessel.checkpoint import checksum

    files = {".metadata": b"m" * 10, **{f"__{r}_0.distcp": bytes([r]) * (100 + r)
                                         for r in range(5)}}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "state.json").write_text("{}")  # not a DCP file: not hashed here
    for rank in range(3):
        checksum.hash_share(tmp_path, rank, 3)
    digests = checksum.gather_shares(tmp_path, 3)
    assert digests == {n: f"{zlib.crc32(d):08x}" for n, d in files.items()}
    assert not list(tmp_path.glob(".crc32-*"))  # the share files are gone
    checksum.hash_share(tmp_path, 0, 2)  # rank 1 never wrote its share
    (tmp_path / ".crc32-rank1.json").write_text("{}")
    with pytest.raises(OSError, match="no checksum was written"):
        checksum.gather_shares(tmp_path, 2)
