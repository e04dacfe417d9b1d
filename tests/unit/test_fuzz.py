"""Property tests: random configs and random or corrupted files fed to the validators and
readers. Each either accepts its input (and then what it returns is right) or refuses it
with tessel's one-line error; never another exception, never garbage accepted."""

from __future__ import annotations

import json
import shutil
import string
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessel.checkpoint import read_full, read_state, save_checkpoint
from tessel.config import Config, ModelConfig, read_toml
from tessel.data.indexed import IndexedDataset
from tessel.errors import TesselError
from tessel.models import build_model

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])

# Values of every kind a hand-written or hostile config may hold.
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3),
    max_leaves=6,
)
KEYS = [f"{section}.{field}" for section, model in Config.model_fields.items()
        if hasattr(model.annotation, "model_fields")
        for field in model.annotation.model_fields]


@SETTINGS
@given(st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=4))
def test_random_overrides_are_a_config_or_one_line(overrides):
    try:
        cfg = Config.from_dict({}, overrides)
    except TesselError as exc:
        assert "\n" not in str(exc) and str(exc)
        return
    # accepted: every float is finite and the config round-trips through its own TOML
    dumped = json.dumps(cfg.to_dict())
    assert "Infinity" not in dumped and "NaN" not in dumped
    again = Config.from_dict(cfg.to_dict())
    # (a preset of None is not written to TOML, which has no null: only its name may differ)
    assert again.model_copy(update={"model": again.model.model_copy(update={"preset": None})}) \
        == cfg.model_copy(update={"model": cfg.model.model_copy(update={"preset": None})})


@SETTINGS
@given(st.text(alphabet=string.printable, max_size=200))
def test_random_toml_is_a_dict_or_one_line(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("toml") / "c.toml"
    path.write_text(text)
    try:
        data = read_toml(path)
    except TesselError as exc:
        assert "\n" not in str(exc)
        return
    assert isinstance(data, dict)
    try:
        Config.from_dict(data)
    except TesselError as exc:
        assert "\n" not in str(exc)


def _corrupt(target: Path, edits: list[tuple[float, int]], cut: float | None) -> None:
    """Bytes overwritten at relative positions, then the file cut at a relative length."""
    data = bytearray(target.read_bytes())
    for where, value in edits:
        data[int(where * len(data))] = value
    if cut is not None:
        data = data[: int(cut * len(data))]
    target.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def good_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tessel.data.preprocess import preprocess

    root = tmp_path_factory.mktemp("ds")
    (root / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    (root / "b.txt").write_text("pack my box with five dozen liquor jugs\n" * 30)
    preprocess([str(root / "a.txt"), str(root / "b.txt")], "bytes", root / "web", progress=False)
    return root / "web"


@SETTINGS
@given(which=st.sampled_from([".bin", ".idx", ".tokenizer.json"]),
       edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)),
                      min_size=1, max_size=4),
       cut=st.none() | st.floats(0, 1))
def test_a_corrupted_dataset_is_refused_or_identical(good_dataset, tmp_path_factory, which,
                                                     edits, cut):
    root = tmp_path_factory.mktemp("bad")
    for suffix in (".bin", ".idx", ".tokenizer.json"):
        shutil.copy(f"{good_dataset}{suffix}", root / f"web{suffix}")
    target = root / f"web{which}"
    _corrupt(target, edits, cut)
    original = IndexedDataset(good_dataset)
    try:
        ds = IndexedDataset(root / "web")
        ds.verify()
    except TesselError as exc:
        assert "\n" not in str(exc)
        return
    # accepted: then it must be the same data (an edit that wrote the byte already there)
    assert np.array_equal(np.asarray(ds.tokens), np.asarray(original.tokens))
    assert np.array_equal(ds.doc_offsets, original.doc_offsets)


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    model = build_model(ModelConfig(preset="tiny", n_layers=1, d_model=32, n_heads=2), seed=0)
    path = save_checkpoint(tmp_path_factory.mktemp("ck"), 1, model, None, {"config": {}})
    # Tied: the checkpoint holds the embedding once (no output.weight).
    return path, {k: v.clone() for k, v in model.state_dict().items() if k != "output.weight"}


@SETTINGS
@given(which=st.sampled_from([".metadata", "__0_0.distcp", "state.json"]),
       edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)),
                      min_size=1, max_size=4),
       cut=st.none() | st.floats(0, 1))
def test_a_corrupted_checkpoint_is_refused_or_identical(good_checkpoint, tmp_path_factory,
                                                        which, edits, cut):
    src, weights = good_checkpoint
    path = tmp_path_factory.mktemp("bad-ck") / src.name
    shutil.copytree(src, path)
    target = path / which
    _corrupt(target, edits, cut)
    try:
        state = read_state(path)
        loaded = read_full(path, "model")
    except TesselError as exc:
        assert "\n" not in str(exc)
        return
    assert state["step"] == 1
    assert loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)
