from pathlib import Path

import pytest

from tessel.config import Config, ConfigError, ModelConfig, reference_markdown
from tessel.models.presets import PRESETS

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_describe_the_demo():
    cfg = Config()
    assert cfg.model.preset == "demo" and cfg.data.source == "stdlib"
    assert cfg.run.dir == "runs/demo"


def test_preset_fills_shape_and_explicit_fields_win():
    cfg = Config.load(None, {"model.preset": "gpt2-124m", "model.n_layers": 6})
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.model.vocab_size) == (6, 768, 50257)
    assert cfg.model.n_kv_heads == 12 and cfg.model.ffn_hidden == 4 * 768


def test_llama_ffn_rule_and_gqa():
    m = ModelConfig(preset="tiny-llama", ffn_hidden=None, d_model=4096, n_heads=32)
    assert m.ffn_hidden == 11008  # Llama 2 7B: 2/3 of 4*4096 rounded up to 256
    assert ModelConfig(preset="llama3-8b").n_kv_heads == 8


def test_file_then_overrides(tmp_path: Path):
    f = tmp_path / "c.toml"
    f.write_text('[train]\nsteps = 7\nseq_len = 64\n[optim]\nlr = 1e-3\n')
    cfg = Config.load(f, ["--train.steps=9", "--optim.schedule=wsd", "--data.paths=['a', 'b']"])
    assert (cfg.train.steps, cfg.train.seq_len, cfg.optim.lr) == (9, 64, 1e-3)
    assert cfg.optim.schedule == "wsd" and cfg.data.paths == ["a", "b"]


def test_switching_preset_on_a_resolved_config(tmp_path: Path):
    f = tmp_path / "config.toml"
    f.write_text(Config.load(None, {"model.preset": "gpt2-124m", "model.dropout": 0.1}).to_toml())
    cfg = Config.load(f, {"model.preset": "gpt2-350m"})
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.model.ffn_hidden) == (24, 1024, 4096)
    assert cfg.model.dropout == 0.1  # a field the user changed from the preset stays


def test_resolved_toml_round_trips(tmp_path: Path):
    cfg = Config.load(None, {"model.preset": "llama3-8b", "train.seq_len": 2048})
    f = tmp_path / "config.toml"
    f.write_text(cfg.to_toml())
    assert Config.load(f) == cfg


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"model.n_layer": 2}, "unknown key 'model.n_layer' in model; did you mean 'model.n_layers'"),
        ({"trian.steps": 2}, "unknown key 'trian'"),
        ({"train.steps": "100"}, "train.steps: input should be a valid integer (got '100')"),
        ({"train.compile": 1}, "train.compile: input should be a valid boolean"),
        ({"optim.lr": -1.0}, "optim.lr: input should be greater than 0 (got -1.0)"),
        ({"train.seq_len": 4096}, "train.seq_len=4096 exceeds model.max_seq_len=256"),
        ({"train.global_batch_size": 33}, "global_batch_size=33 is not divisible by micro_batch_size*dp=16"),
        ({"model.preset": "gpt5"}, "unknown preset 'gpt5'"),
        ({"model.n_heads": 5}, "d_model=192 is not divisible by n_heads=5"),
        ({"model.n_kv_heads": 4}, "n_heads=6 is not divisible by n_kv_heads=4"),
        ({"data.source": "files"}, 'data.source = "files" needs data.paths'),
        ({"data.split": "98"}, "split='98' must be two or three non-negative weights"),
        ({"data.source": "indexed", "data.paths": ["0.7 a", "b"]}, "a weight for every dataset or for none"),
        ({"data.source": "indexed", "data.paths": ["-1 a"]}, "the weight must be a positive number"),
        ({"data.source": "indexed", "data.paths": ["1 a b"]}, 'must be "PREFIX" or "WEIGHT PREFIX"'),
        ({"parallel.pp_virtual_stages": 2}, "needs an interleaved schedule"),
        ({"parallel.zero": 1, "parallel.dp_comm_hook": "fp16"}, "needs zero=0"),
        ({"parallel.offload": "params"}, "needs parallel.zero=3"),
        ({"parallel.zero": 4}, "parallel.zero"),
        ({"train.precision": "fp8"}, "train.precision: input should be"),
    ],
)
def test_bad_values_are_rejected_with_the_key_and_fix(overrides, needle):
    with pytest.raises(ConfigError) as err:
        Config.load(None, overrides)
    msg = str(err.value)
    assert needle in msg
    assert "\n" not in msg


@pytest.mark.parametrize(
    ("text", "needle"),
    [("[train\nsteps=1", "is not valid TOML"), ("[train]\nsteps = -3\n", "train.steps")],
)
def test_bad_files_are_rejected(tmp_path: Path, text: str, needle: str):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        Config.load(f)


def test_missing_file_and_malformed_override():
    with pytest.raises(ConfigError, match="does not exist"):
        Config.load("/nonexistent/x.toml")
    with pytest.raises(ConfigError, match="must look like --section.key=value"):
        Config.load(None, ["--train.steps"])
    with pytest.raises(ConfigError, match="must be section.key"):
        Config.load(None, {"steps": 3})


def test_weighted_paths_and_three_way_split():
    d = Config.load(None, {"data.source": "indexed", "data.paths": ["0.7 data/web", "0.3 data/books"],
                           "data.split": "969,30,1"}).data
    assert d.weighted_paths() == [(0.7, "data/web"), (0.3, "data/books")]
    assert d.split_fractions() == pytest.approx((0.969, 0.030, 0.001))
    assert Config.load(None, {"data.split": "98,2"}).data.split_fractions() == pytest.approx((0.98, 0.02, 0))


def test_with_overrides_revalidates():
    cfg = Config()
    assert cfg.with_overrides({"train.steps": 3}).train.steps == 3
    with pytest.raises(ConfigError, match="exceeds model.max_seq_len"):
        cfg.with_overrides({"model.max_seq_len": 128})


def test_every_preset_is_valid():
    for name in PRESETS:
        assert ModelConfig(preset=name).preset == name


def test_every_recipe_loads():
    recipes = sorted((ROOT / "configs").glob("*.toml"))
    names = {p.stem for p in recipes}
    assert {"tiny", "gpt2-124m", "gpt2-350m", "gpt3-1.3b", "llama3-8b"} <= names
    for path in recipes:
        cfg = Config.load(path)
        assert cfg.model.preset == path.stem


def test_readme_reference_matches_the_typed_config():
    readme = (ROOT / "README.md").read_text()
    assert reference_markdown() in readme, (
        "README config reference is stale: regenerate it with `tessel config --reference`"
    )


def test_every_field_is_documented():
    from tessel.config import _table_model

    for section in Config.model_fields.values():
        model = _table_model(section.annotation)  # [[alerts]] is a list of AlertConfig
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"
