"""Starting weights from elsewhere (`model.init_from`): their model shape, their tokenizer,
and each tensor by tessel's name, one at a time, from

- a Hugging Face model directory (config.json + safetensors; GPT-2, Llama, Mixtral or
  Qwen3-MoE), converted on the fly (`hf_models`);
- a single safetensors file of tessel's names (`tessel checkpoint consolidate`), or a
  directory holding one as model.safetensors (`tessel convert hf-to-tessel`);
- a tessel run directory (its latest checkpoint) or checkpoint directory, any layout (DCP).

`load_config` is `Config.load` for a new run: the shape is read from those weights here, once,
and handed to the config's validation (which never reads the disk itself).

Every rank of a parallel layout asks for the full tensors of the parameters it holds and
keeps its slice (see `tessel.models.init.materialise`), so loading works for any layout.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tessel.checkpoint.eod import hf_eod, run_eod
from tessel.checkpoint.errors import check_finite
from tessel.checkpoint.hf_arch import VOCAB_ROWS, HFError, fit_vocab_rows
from tessel.checkpoint.hf_io import HFReader, read_json
from tessel.checkpoint.hf_models import check_export, for_hf_config
from tessel.config import SHAPE_FIELDS, Config, ModelConfig
from tessel.config.load import read_merged, validate
from tessel.models.lora import is_adapter

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# The shape, plus what a model was trained with that an import or export must carry
# (dropout: stock GPT-2's 0.1); explicit settings override the non-shape ones.
_MODEL_FIELDS = (
    "dropout", "n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "qk_norm", "vocab_size",
    "qk_norm_scope", "qkv_bias", "norm_placement",
    "max_seq_len", "ffn_hidden",
    "position", "rope_theta", "norm", "norm_eps", "mlp", "tie_embeddings", "bias",
    "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
    "rope_original_max_seq_len",
    # sliding windows, per-layer RoPE and Gemma's conventions (Mistral, Gemma 3)
    "rope_scaling_type", "sliding_window", "layer_types", "rope_local_theta", "embed_scale",
    "norm_offset", "query_scale", "final_logit_softcap",
    # Mixture-of-Experts structure and routing (the balancing settings are the new run's)
    "moe_experts", "moe_top_k", "moe_shared_experts", "moe_ffn_hidden", "moe_first_dense_layers",
    "moe_every", "moe_router",
)


def _tessel_file(path: Path) -> Path | None:
    """The tessel-format safetensors file at `path` (a file, or DIR/model.safetensors)."""
    file = path if path.is_file() else path / "model.safetensors"
    if not file.is_file() or file.suffix != ".safetensors":
        return None
    with safe_open(str(file), framework="pt") as f:
        meta = f.metadata() or {}
    return file if meta.get("format") == "tessel" else None


def _tessel_checkpoint(path: Path) -> Path | None:
    """The DCP checkpoint at `path`: itself, or a run directory's latest."""
    from tessel.checkpoint.store import find_checkpoint

    return find_checkpoint(path)


def model_fields_of(path: Path) -> dict[str, Any]:
    """The model fields the weights at `path` fix ({} when nothing is there yet)."""
    if not path.exists():
        return {}
    where = str(path)
    if (path / "config.json").is_file():
        hf = read_json(path / "config.json")
        return for_hf_config(hf, f"{where}/config.json").model_fields(hf, f"{where}/config.json")
    model: dict[str, Any] | None = None
    file = _tessel_file(path)
    if file is not None:
        with safe_open(str(file), framework="pt") as f:
            model = json.loads((f.metadata() or {}).get("model_config", "{}"))
    elif (ckpt := _tessel_checkpoint(path)) is not None:
        from tessel.checkpoint.run_config import run_config

        model = run_config(ckpt).model.model_dump()  # config.toml, as the checkpoint has it
    elif (path / "config.toml").is_file():
        model = tomllib.loads((path / "config.toml").read_text()).get("model", {})
    if not model:
        raise HFError(
            f"model.init_from={where!r} holds no model tessel can read (a Hugging Face "
            "directory with config.json, a tessel safetensors file, or a tessel run or "
            "checkpoint directory)"
        )
    return {k: model[k] for k in _MODEL_FIELDS if k in model}


def load_config(
    path: str | Path | None = None,
    overrides: Mapping[str, Any] | Sequence[str] | None = None,
) -> Config:
    """`Config.load(path, overrides)`, with the model fields that the weights of
    `model.init_from` fix (when it is set) read from them: they win over the preset, and an
    explicit shape field that disagrees is an error naming the key. What `tessel train` and
    the other commands load for a new run; a resumed run's config.toml already states every
    field and is read with `Config.load`. A model `checkpoint.hf_export_interval` cannot
    export is refused here too (`hf_models.check_export`)."""
    merged = read_merged(Config, path, overrides)
    model = merged.get("model")
    init_from = model.get("init_from") if isinstance(model, dict) else None
    fields = None
    if isinstance(init_from, str) and init_from:  # any other value: validation says why
        source = Path(init_from)
        if not source.exists():
            raise HFError(f"model.init_from={init_from!r} does not exist or holds no weights")
        fields = model_fields_of(source)
    cfg = Config.from_dict(merged, init_fields=fields)
    check_export(cfg)
    return cfg


def check_shape(m: ModelConfig, path: Path) -> None:
    """Refuse (one line) a model config whose shape is not the one of the weights at `path`:
    a config built with `Config.load` keeps the defaults for the fields the weights fix
    (it never reads them), and would otherwise fail tensor by tensor."""
    theirs = validate(ModelConfig, {"preset": None, **model_fields_of(path)})
    wrong = [k for k in ModelConfig.model_fields  # in the config's order: n_layers first
             if k in SHAPE_FIELDS and getattr(m, k) != getattr(theirs, k)]
    if wrong:
        shown = ", ".join(f"{k}={getattr(theirs, k)!r}" for k in wrong[:3])
        ours = ", ".join(f"{k}={getattr(m, k)!r}" for k in wrong[:3])
        raise HFError(
            f"model.init_from={str(path)!r} holds a model with {shown}, but the config's model "
            f"has {ours}: Config.load never reads the weights; load the config with "
            "tessel.load_config(path, overrides), which takes the shape from them")


def _refuse_adapters(where: str, names: Iterable[str]) -> None:
    """Weights that hold LoRA adapters hold nothing else of the model (a LoRA checkpoint, or
    what `tessel checkpoint consolidate` wrote of one before it merged them): refused."""
    if any(is_adapter(n) for n in names):
        raise HFError(
            f"{where!r} holds LoRA adapters only, not a model's weights; write the model they "
            "make with their base by `tessel checkpoint consolidate LORA_RUN` (the adapters "
            "merged) and use that file")


class WeightSource:
    """Full tensors by tessel parameter name, from `path`, for a model of shape `m`."""

    def __init__(self, path: Path, m: ModelConfig):
        self.path = path
        self.m = m
        self._get: Callable[[str], torch.Tensor]
        self._has: Callable[[str], bool] = lambda name: False  # no buffers in an HF directory
        if (path / "config.json").is_file():
            arch = for_hf_config(read_json(path / "config.json"), str(path / "config.json"))
            reader = HFReader(path)
            table = arch.tessel_from_hf(m, reader.names())
            read = lambda name: reader.get(name, *arch.alternatives(name))  # noqa: E731
            self._get = lambda name: table[name](read)
            self.kind = f"Hugging Face {arch.hf_class}"
            self.tokenizer = path / "tokenizer.json"
            self.eod_token, self.eod_from = hf_eod(path)
            return
        file = _tessel_file(path)
        if file is not None:
            handle = safe_open(str(file), framework="pt")
            names = set(handle.keys())
            _refuse_adapters(str(file), names)

            def get(name: str) -> torch.Tensor:
                if name not in names and name == "output.weight":  # stored once when tied
                    name = "tok_embeddings.weight"
                if name not in names:
                    raise KeyError(name)  # (safetensors' own error is no KeyError)
                return handle.get_tensor(name)

            self._get = get
            self._has = names.__contains__
            self.kind = "tessel safetensors"
            self.tokenizer = file.parent / "tokenizer.json"
            self.eod_token, self.eod_from = run_eod(file.parent), "config.toml"
            return
        ckpt = _tessel_checkpoint(path)
        if ckpt is None:
            raise HFError(f"model.init_from={str(path)!r} does not exist or holds no weights")
        from tessel.checkpoint.store import checkpoint_shapes, read_full

        shapes = checkpoint_shapes(ckpt)
        _refuse_adapters(str(ckpt), shapes)
        self._get = lambda name: read_full(ckpt, "model", only={name})[name]
        self._has = shapes.__contains__
        self.kind = f"tessel checkpoint {ckpt.name}"
        self.tokenizer = ckpt.parent.parent / "tokenizer.json"
        self.eod_token, self.eod_from = run_eod(ckpt.parent.parent), "config.toml"

    def buffer(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """Persistent buffer `name` (the MoE balancing bias `...feed_forward.expert_bias`) in
        float32, or None when the weights hold none (a Hugging Face directory).

        Carried over because it is part of the trained router: the top-k choice of each token
        is made on the scores plus this bias, so a fine-tune (or sampling) that started it at
        zero would route tokens differently from the run that trained the experts."""
        return self.get(name, shape) if self._has(name) else None

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Tensor `name` in float32, checked against the model's `shape`."""
        try:
            tensor = check_finite(self._get(name), name, repr(str(self.path)))
        except KeyError:
            raise HFError(f"model.init_from={str(self.path)!r}: no tensor for {name!r}") from None
        rows = min(tensor.shape[0], shape[0]) if tensor.ndim and len(shape) else 0
        if (name in VOCAB_ROWS and tuple(tensor.shape[1:]) == tuple(shape[1:])
                and rows >= self.m.vocab_size):
            # Saved with other padding (model.vocab_pad_to; none before it existed): the
            # same real rows, the padding re-made.
            tensor = fit_vocab_rows(tensor, self.m.vocab_size, shape[0])
        if tuple(tensor.shape) != tuple(shape):
            raise HFError(
                f"model.init_from={str(self.path)!r}: tensor {name!r} has shape "
                f"{tuple(tensor.shape)}, the model's is {tuple(shape)}"
            )
        return tensor.to(torch.float32)
