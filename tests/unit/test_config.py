import json
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
    cfg = Config.load(f, ["--train.steps=9", "--optim.schedule=wsd", "--data.source=files",
                          "--data.paths=['a', 'b']"])
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
        ({"parallel.offload": "params", "parallel.zero": 1}, "needs parallel.zero=3"),
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
        if path.stem.startswith("lora-"):  # named for the method; the model is its preset
            assert cfg.lora.enabled and f"lora-{cfg.model.preset}".startswith(path.stem)
        elif path.stem.startswith("long-"):  # long context: the preset's, split over cp ranks
            assert cfg.parallel.cp > 1 and cfg.model.preset == path.stem.removeprefix("long-")
            assert cfg.train.seq_len > PRESETS[cfg.model.preset]["max_seq_len"]
        else:  # a recipe is named after its preset; sft-/dpo-NAME fine-tunes the NAME preset
            assert cfg.model.preset == path.stem.removeprefix("sft-").removeprefix("dpo-")


def test_readme_reference_matches_the_typed_config():
    readme = (ROOT / "docs" / "config-reference.md").read_text()
    assert reference_markdown() in readme, (
        "docs/config-reference.md is stale: regenerate it with "
        "`tessel config --reference > docs/config-reference.md`"
    )


def test_every_field_is_documented():
    from tessel.config import table_model

    for section in Config.model_fields.values():
        model = table_model(section.annotation)  # [[alerts]] is a list of AlertConfig
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"


# ---- model.init_from: the weights fix the shape, read once by load_config -----------------

LLAMA_HF = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 320,
    "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}


def hf_dir(path: Path) -> Path:
    """A Hugging Face directory as far as the shape goes: config.json (no weights needed)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(LLAMA_HF))
    return path


def test_building_a_config_with_init_from_never_reads_the_weights(tmp_path: Path):
    missing = str(tmp_path / "not-there")
    cfg = Config.from_dict({"model": {"init_from": missing}})
    assert cfg.model.init_from == missing and cfg.model.preset is None
    assert cfg.with_overrides({"train.steps": 3}).train.steps == 3
    assert Config.load(None, {"model.init_from": missing}).model.d_model == 192
    # Weights that are there are not read either: the field defaults stand.
    present = hf_dir(tmp_path / "hf")
    assert Config.load(None, {"model.init_from": str(present)}).model.d_model == 192


def test_init_fields_sit_between_the_preset_and_explicit_fields():
    init = {"n_layers": 2, "d_model": 64, "n_heads": 4, "max_seq_len": 128}
    cfg = Config.from_dict({"model": {"init_from": "w", "max_seq_len": 64}},
                           {"train.seq_len": 64}, init_fields=init)
    m = cfg.model
    assert (m.preset, m.n_layers, m.d_model, m.n_heads, m.max_seq_len) == (None, 2, 64, 4, 64)
    explicit = Config.from_dict({"model": {"init_from": "w", "preset": "tiny-llama"}},
                                {"train.seq_len": 128}, init_fields=init)
    assert (explicit.model.preset, explicit.model.d_model, explicit.model.mlp) == (
        "tiny-llama", 64, "swiglu")  # the weights win over the preset, the preset fills the rest
    with pytest.raises(ConfigError) as err:
        Config.from_dict({"model": {"init_from": "w", "d_model": 128}}, init_fields=init)
    assert "model.d_model=128 but the weights of model.init_from have 64; drop model.d_model" in (
        str(err.value))


def test_load_config_fills_the_shape_from_a_hugging_face_directory(tmp_path: Path):
    from tessel.checkpoint.init_from import load_config

    src = hf_dir(tmp_path / "hf")
    f = tmp_path / "c.toml"
    f.write_text(f'[model]\ninit_from = "{src}"\ndropout = 0.1\n[train]\nseq_len = 64\n')
    cfg = load_config(f, {"train.steps": 5})
    m = cfg.model
    assert (m.preset, m.n_layers, m.d_model, m.n_heads, m.n_kv_heads) == (None, 2, 64, 4, 2)
    assert (m.ffn_hidden, m.vocab_size, m.position, m.mlp, m.rope_theta) == (
        160, 320, "rope", "swiglu", 500000.0)
    assert m.dropout == 0.1 and cfg.train.steps == 5
    # The resolved config states every field: copies and its config.toml keep the shape
    # without the weights.
    (src / "config.json").unlink()
    assert cfg.with_overrides({"train.steps": 7}).model == m
    resolved = tmp_path / "config.toml"
    resolved.write_text(cfg.to_toml())
    assert Config.load(resolved) == cfg
    import tessel

    assert tessel.load_config is load_config


def test_load_config_fills_the_shape_from_tessel_safetensors(tmp_path: Path):
    import torch
    from safetensors.torch import save_file

    from tessel.checkpoint.init_from import load_config

    shape = ModelConfig(preset="tiny-llama")
    (tmp_path / "w").mkdir()
    save_file({"tok_embeddings.weight": torch.zeros(1)}, str(tmp_path / "w/model.safetensors"),
              metadata={"format": "tessel", "model_config": json.dumps(shape.model_dump())})
    m = load_config(None, {"model.init_from": str(tmp_path / "w"), "train.seq_len": 64}).model
    assert m.preset is None
    assert m.model_dump(exclude={"preset", "init_from"}) == shape.model_dump(
        exclude={"preset", "init_from"})


def test_load_config_refuses_shape_that_contradicts_the_weights(tmp_path: Path):
    from tessel.checkpoint.init_from import load_config

    src = str(hf_dir(tmp_path / "hf"))
    with pytest.raises(ConfigError) as err:
        load_config(None, ["--model.d_model=128", f"--model.init_from={json.dumps(src)}"])
    msg = str(err.value)
    assert "model.d_model=128 but the weights of model.init_from have 64; drop model.d_model" in msg
    assert "\n" not in msg
    # A field the weights do not fix may differ.
    cfg = load_config(None, {"model.init_from": src, "model.max_seq_len": 128,
                             "train.seq_len": 128})
    assert cfg.model.max_seq_len == 128


def test_load_config_refuses_missing_or_unreadable_weights_in_one_line(tmp_path: Path):
    from tessel.checkpoint.init_from import load_config
    from tessel.errors import TesselError

    missing = str(tmp_path / "not-there")
    with pytest.raises(TesselError) as err:
        load_config(None, {"model.init_from": missing})
    assert str(err.value) == f"model.init_from={missing!r} does not exist or holds no weights"
    (tmp_path / "empty").mkdir()
    with pytest.raises(TesselError, match="holds no model tessel can read"):
        load_config(None, {"model.init_from": str(tmp_path / "empty")})
    # Without init_from it is Config.load.
    assert load_config(None, {"train.steps": 3}) == Config.load(None, {"train.steps": 3})
