"""LoRA runs on disk: the fingerprint of the frozen base, and the two exports.

A LoRA checkpoint holds only the adapters (and their optimizer state); the base comes from
`model.init_from` every time the run starts, so its checkpoints record which base it was, as
a fingerprint, and a resume, a merge, an export or sampling refuses another one.

Exports of a LoRA checkpoint:
- merged (`tessel convert tessel-to-hf`, checkpoint.hf_export_interval): the base with
  W + alpha/rank B A in every adapted projection, written by the ordinary HF export
  (`MergedSource` stands in for the checkpoint's weights); `tessel checkpoint consolidate`
  writes the same merged weights in tessel's names (`merged_tensors`);
- peft (`tessel convert tessel-to-hf --peft`, or lora.export = "peft"): adapter_config.json
  and adapter_model.safetensors, keys as peft writes them
  (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), loadable with
  `peft.PeftModel.from_pretrained(base, DIR)` on the Hugging Face base model.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tessel.checkpoint.eod import run_eod
from tessel.checkpoint.errors import CheckpointError, check_finite
from tessel.checkpoint.hf_arch import HFError, one_to_one
from tessel.checkpoint.init_from import WeightSource
from tessel.config import Config, ModelConfig
from tessel.fileio import atomic_directory
from tessel.models.lora import TESSEL_TARGETS, TESSEL_TO_HF, is_adapter, merged_weight

FINGERPRINT_KEY = "lora_base"  # in a LoRA checkpoint's state.json


def base_fingerprint(cfg: Config) -> str:
    """A digest of the frozen base a LoRA run trains on: the bytes of the weight files of
    model.init_from (an HF directory's config.json and safetensors; a tessel safetensors file;
    a checkpoint's files), or, without init_from, the seed and shape of the random base."""
    h = hashlib.sha256()
    h.update(json.dumps(cfg.model.model_dump(exclude={"init_from"}), sort_keys=True,
                        default=str).encode())
    if not cfg.model.init_from:
        h.update(f"random base, train.seed={cfg.train.seed}".encode())
        return h.hexdigest()
    for f in _weight_files(Path(cfg.model.init_from)):
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def _weight_files(path: Path) -> list[Path]:
    from tessel.checkpoint.store import find_checkpoint

    if path.is_file():
        return [path]
    if (path / "config.json").is_file():
        return [path / "config.json", *sorted(path.glob("*.safetensors"))]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    ckpt = find_checkpoint(path)
    if ckpt is None:
        raise HFError(f"model.init_from={str(path)!r} does not exist or holds no weights")
    return sorted(f for f in ckpt.iterdir() if f.is_file() and f.name != "state.json")


def check_base(state: dict[str, Any], fingerprint: str, ckpt: Path, init_from: str) -> None:
    """Refuse adapters (to resume, merge or export) trained on another base than the one
    model.init_from holds now."""
    saved = state.get(FINGERPRINT_KEY)
    if saved is None:
        raise CheckpointError(f"checkpoint {str(ckpt)!r} has no LoRA base fingerprint; it was "
                              "not written by a LoRA run (lora.enabled)")
    if saved != fingerprint:
        where, fix = (f"model.init_from={init_from!r}", "put the weights the adapters were "
                      "trained on back at that path") if init_from else (
            "the random base of the run's model settings and train.seed",
            "restore the settings the run was started with")
        raise CheckpointError(
            f"checkpoint {str(ckpt)!r} holds adapters trained on another base model (fingerprint "
            f"{saved[:12]}) than {where} holds now ({fingerprint[:12]}); {fix}")


def check_base_now(cfg: Config, ckpt: Path) -> None:
    """Refuse the adapters of LoRA checkpoint `ckpt` when the base the run names now holds
    other weights than the ones they were trained on: merging, exporting and sampling read
    the base from the run's model.init_from again, as a resume does."""
    from tessel.checkpoint.state_file import read_state

    check_base(read_state(ckpt), base_fingerprint(cfg), ckpt, cfg.model.init_from)


def lora_config_of(src: Path) -> tuple[Config, Path] | None:
    """(the run's config, the checkpoint) when `src` (a run or checkpoint directory) is a
    LoRA checkpoint; None otherwise."""
    from tessel.checkpoint.run_config import run_config
    from tessel.checkpoint.store import find_checkpoint

    if not src.is_dir():
        return None
    ckpt = find_checkpoint(src)
    if ckpt is None:
        return None
    cfg = run_config(ckpt)  # the run's config.toml, checked against the checkpoint's record
    return (cfg, ckpt) if cfg.lora.enabled else None


def _saved(ckpt: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The model tensors of LoRA checkpoint `ckpt`: (its adapters, the rest: the persistent
    buffers such as the MoE balancing bias)."""
    from tessel.checkpoint.store import read_full

    saved = {k: check_finite(v, k, repr(str(ckpt))) for k, v in read_full(ckpt, "model").items()}
    return ({k: v for k, v in saved.items() if is_adapter(k)},
            {k: v for k, v in saved.items() if not is_adapter(k)})


class MergedSource:
    """The weights of a LoRA checkpoint with its adapters merged: a `WeightSource` (get by
    tessel name) over the base of model.init_from and the checkpoint's adapters."""

    def __init__(self, cfg: Config, ckpt: Path, m: ModelConfig):
        check_base_now(cfg, ckpt)
        if cfg.model.init_from:
            self.base_get = WeightSource(Path(cfg.model.init_from), m).get
        else:  # a random base is its seed's: drawn again, exactly as the run drew it
            from tessel.models.transformer import Transformer

            with torch.device("meta"):
                model = Transformer(m)
            seed = cfg.train.seed
            self.base_get = lambda name, shape: model.initial_value(name, shape, seed)
        self.adapters, self.buffers = _saved(ckpt)
        self.scaling = cfg.lora.alpha / cfg.lora.rank
        self.tokenizer = ckpt.parent.parent / "tokenizer.json"
        # the run's config.toml (the checkpoint's copy of the config has secrets redacted)
        self.eod_token = run_eod(ckpt.parent.parent)
        self.path, self.kind = ckpt, f"LoRA checkpoint {ckpt.name} merged"

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        w = self.base_get(name, shape)
        stem = name.removesuffix(".weight")
        a = self.adapters.get(f"{stem}.lora_A.weight")
        if a is None:
            return w
        return merged_weight(w, a, self.adapters[f"{stem}.lora_B.weight"], self.scaling)


def merged_tensors(cfg: Config, ckpt: Path) -> dict[str, torch.Tensor]:
    """The whole model LoRA checkpoint `ckpt` stands for, by tessel name, as `tessel
    checkpoint consolidate` writes a model: every parameter of the base with the adapters
    merged (a tied output projection once, as the embedding) and the persistent buffers the
    checkpoint holds. No adapter names: the result is an ordinary model."""
    from tessel.models.transformer import Transformer

    source = MergedSource(cfg, ckpt, cfg.model)
    with torch.device("meta"):
        model = Transformer(cfg.model)  # the base's shapes (no adapters)
    out = {name: source.get(name, tuple(p.shape)) for name, p in model.named_parameters()}
    return {**out, **source.buffers}


def export_peft(src: Path, out: Path) -> str:
    """Write the adapters of the LoRA run or checkpoint `src` as a peft adapter directory
    `out` (atomically); returns a one-line summary."""
    from tessel.checkpoint.hf_models import for_model

    found = lora_config_of(src)
    if found is None:
        raise HFError(f"{str(src)!r} is not a LoRA run or checkpoint (lora.enabled); "
                      "--peft exports adapters only")
    cfg, ckpt = found
    m = cfg.model
    # Llama's projection names, which Qwen2, Qwen3, OLMo 2, Mistral and Gemma 3 share (their
    # biases and QK-norms have no adapters)
    if m.position != "rope" or m.mlp == "gelu" or m.moe_experts:
        raise HFError("--peft: peft adapters are written for Llama-shaped dense models "
                      "(LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Olmo2ForCausalLM, "
                      "MistralForCausalLM, Gemma3ForCausalLM); export merged weights instead "
                      "(without --peft)")
    if out.exists():
        raise HFError(f"{str(out)!r} already exists; choose a new output directory")
    check_base_now(cfg, ckpt)  # the adapters are only good on the base they were trained on
    tensors = {}
    for name, t in _saved(ckpt)[0].items():
        # layers.{i}.attention.wq.lora_A.weight -> model.layers.{i}.self_attn.q_proj.lora_A...
        _, i, rest = name.split(".", 2)
        path, _, kind = rest.removesuffix(".weight").rpartition(".")  # attention.wq, lora_A
        short = path.rpartition(".")[2]
        hf_path = ("self_attn." if path.startswith("attention.") else "mlp.") + TESSEL_TO_HF[short]
        if kind == "lora_B" and short in ("wq", "wk"):
            # The rows of q/k are permuted between tessel's RoPE pairs and HF's halves (as
            # the weights are on export): B's rows are the weight's output rows.
            heads = "n_heads" if short == "wq" else "n_kv_heads"
            t = one_to_one([(name, "hf", heads)], m, to_tessel=False)["hf"](lambda _, t=t: t)
        tensors[f"base_model.model.model.layers.{i}.{hf_path}.{kind}.weight"] = t.contiguous()
    targets = sorted({TESSEL_TO_HF[t] for t in _short_targets(cfg)})
    init_from = cfg.model.init_from
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora.rank,
        "lora_alpha": cfg.lora.alpha, "lora_dropout": cfg.lora.dropout,
        "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "inference_mode": True,
        "init_lora_weights": True, "modules_to_save": None,
        "base_model_name_or_path": str(Path(init_from).resolve()) if init_from else None,
    }
    with atomic_directory(out) as tmp:
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    return (f"wrote {out}: peft LoRA adapter (r={cfg.lora.rank}, {', '.join(targets)}), "
            f"{len(tensors)} tensors, {size / 2**20:.2f} MiB; load it with "
            f"peft.PeftModel.from_pretrained(base, {str(out)!r}) on {for_model(m).hf_class} "
            f"{init_from or '(base)'}")


def _short_targets(cfg: Config) -> list[str]:
    from tessel.models.lora import resolve_targets

    return [t for t in resolve_targets(cfg.lora.targets) if t in TESSEL_TARGETS]
