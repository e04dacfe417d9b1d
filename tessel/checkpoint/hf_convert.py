"""Conversions between tessel and the Hugging Face format, tensor by tensor.

    hf_to_tessel(HF_DIR, OUT)       OUT/model.safetensors (tessel names), config.toml (the
                                    model, init_from = OUT), tokenizer.json (and the chat
                                    template's tokenizer_config.json, chat_template.jinja)
    tessel_to_hf(SOURCE, OUT)       an HF directory transformers loads: config.json,
                                    model.safetensors or shards + index, tokenizer files
                                    (and the chat template a fine-tune saved beside them);
                                    SOURCE: a run, a checkpoint (any layout) or a tessel
                                    safetensors file

Exports read one tensor at a time from the checkpoint (its DCP shards, whatever layout wrote
them) and write each HF shard as soon as it is full, so the host holds at most one shard and
a tensor.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tessel.checkpoint.eod import hf_eod
from tessel.checkpoint.hf_arch import HFError
from tessel.checkpoint.hf_bias import check_expert_bias
from tessel.checkpoint.hf_io import DEFAULT_SHARD_BYTES, HFReader, read_json, write_hf
from tessel.checkpoint.hf_models import for_hf_config, for_model
from tessel.checkpoint.init_from import WeightSource
from tessel.config import Config, ConfigError, ModelConfig
from tessel.config.load import validate
from tessel.fileio import fsync_dir

FINE_TUNE_SEQ_LEN = 1024  # the generated config's sequence length (the model's, if shorter)


def _import_eod(src: Path, m: ModelConfig, where: str, eod_token: str) -> tuple[str, str]:
    """The imported run's `data.eod_token`, and a note saying which token ends documents."""
    path = src / "tokenizer.json"
    if not path.is_file():
        return eod_token, ""
    from tessel.data.tokenizer import load_tokenizer

    eod_from = "--eod-token"
    if eod_token == "auto":
        eod_token, eod_from = hf_eod(src)
    tok = load_tokenizer(path, eod_token)
    if tok.vocab_size > m.vocab_size:
        added = eod_from == "none named"  # tessel added its own token past the vocabulary
        raise HFError(
            f"{str(path)!r} has no end-of-document token and none of the model's files names "
            f"an EOS or pad token; pass --eod-token with one of its tokens" if added else
            f"{str(path)!r} has {tok.vocab_size} ids but {where} has vocab_size="
            f"{m.vocab_size}; the tokenizer does not match the model")
    name = tok.hf.id_to_token(tok.eod_id)
    return eod_token, f"documents end with {name!r} (id {tok.eod_id}, {eod_from})"


def hf_to_tessel(src: Path, out: Path, eod_token: str = "auto") -> str:
    """Convert the HF model directory `src` into `out`; returns a one-line summary."""
    where = str(src / "config.json")
    hf = read_json(src / "config.json")
    arch = for_hf_config(hf, where)  # the architecture first, then the weights
    try:
        m = validate(ModelConfig, {"preset": None, **arch.model_fields(hf, where)})
    except ConfigError as exc:  # e.g. num_experts_per_tok > num_experts
        raise HFError(f"{where}: {exc}") from None
    reader = HFReader(src)
    eod, eod_note = _import_eod(src, m, where, eod_token)
    out = out.resolve()
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        read = lambda name: reader.get(name, *arch.alternatives(name))  # noqa: E731
        shapes = _shapes(m)
        tensors = {}
        for name, t in arch.to_tessel(read, m, reader.names()):
            if tuple(t.shape) != shapes[name]:  # never a file that loads into another shape
                raise HFError(f"{where}: tensor {name!r} comes out as {tuple(t.shape)}, the "
                              f"model's is {shapes[name]}; config.json and the weights differ")
            tensors[name] = t.contiguous()
        info = {"format": "tessel", "source": f"{arch.hf_class} {src}",
                "model_config": json.dumps(m.model_dump())}
        save_file(tensors, str(tmp / "model.safetensors"), metadata=info)
        count, size = len(tensors), sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
        overrides: dict[str, Any] = {f"model.{k}": v for k, v in m.model_dump().items()
                                     if v is not None}
        overrides["model.init_from"] = str(out)
        overrides["train.seq_len"] = min(m.max_seq_len, FINE_TUNE_SEQ_LEN)
        if (src / "tokenizer.json").is_file():
            shutil.copy(src / "tokenizer.json", tmp / "tokenizer.json")
            # the chat template and special-token names (data.chat_template = "auto",
            # tessel generate --chat find them beside data.tokenizer)
            for name in ("tokenizer_config.json", "chat_template.jinja"):
                if (src / name).is_file():
                    shutil.copy(src / name, tmp / name)
            overrides["data.tokenizer"] = str(out / "tokenizer.json")
            overrides["data.eod_token"] = eod
        (tmp / "config.toml").write_text(Config.load(None, overrides).to_toml())
        fsync_dir(tmp)
        if out.exists():
            raise HFError(f"{str(out)!r} already exists; choose a new output directory")
        tmp.rename(out)
        fsync_dir(out.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return (f"wrote {out}: {count} tensors, {size / 2**20:.1f} MiB from {arch.hf_class} "
            f"({m.n_layers} layers, d_model {m.d_model}{'; ' + eod_note if eod_note else ''}); "
            "fine-tune with "
            f"`tessel train {out / 'config.toml'} --data.paths=...`")


def tessel_to_hf(src: Path, out: Path, dtype: torch.dtype | None = None,
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                 drop_expert_bias: bool = False) -> str:
    """Export the model at `src` (run, checkpoint or tessel safetensors) to the HF directory
    `out`; returns a one-line summary. An MoE balancing bias that changes routing is refused
    unless `drop_expert_bias` (see hf_bias)."""
    from tessel.checkpoint.init_from import model_fields_of

    if not src.exists():
        raise HFError(f"{str(src)!r} does not exist")
    if (src / "config.json").is_file():
        raise HFError(f"{str(src)!r} is already a Hugging Face model directory")
    m = ModelConfig(preset=None, **model_fields_of(src))
    arch = for_model(m)  # before reading weights: it refuses shapes it cannot export
    from tessel.checkpoint.lora import MergedSource, lora_config_of

    lora = lora_config_of(src)  # a LoRA checkpoint holds adapters only: merge them
    source = MergedSource(*lora, m) if lora is not None else WeightSource(src, m)
    tokenizer_path = source.tokenizer
    config = arch.hf_config(m)
    bias_note = check_expert_bias(source, m, arch.hf_class, drop_expert_bias)
    files: dict[str, str] = {}
    with_template = ""
    if tokenizer_path is not None and tokenizer_path.is_file():
        from tessel.data.tokenizer import load_tokenizer

        tok = load_tokenizer(tokenizer_path, source.eod_token)
        if tok.vocab_size > m.vocab_size:
            raise HFError(f"{str(tokenizer_path)!r} has {tok.vocab_size} ids but the model has "
                          f"vocab_size={m.vocab_size}; the tokenizer does not match the model")
        eos = tok.hf.id_to_token(tok.eod_id)
        # BOS: what the tokenizer's template puts first (Llama 3), else the eod (GPT-2).
        bos_id = tok.prefix_ids[0] if tok.prefix_ids else tok.eod_id
        config.update({"bos_token_id": bos_id, "eos_token_id": tok.eod_id})
        files["tokenizer.json"] = tok.hf_json()
        tok_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": tok.hf.id_to_token(bos_id), "eos_token": eos,
            "model_max_length": m.max_seq_len, "clean_up_tokenization_spaces": False,
        }
        # the chat template the model was fine-tuned with, saved beside its tokenizer
        from tessel.data.chat_files import TEMPLATE_FILE, export_template, saved_template

        chat = saved_template(tokenizer_path.parent, eos)
        if chat is not None:
            text, fields = export_template(chat, lambda t: tok.hf.token_to_id(t) is not None)
            files[TEMPLATE_FILE] = text
            tok_config.update(fields)
            with_template = ", with its chat template"
        files["tokenizer_config.json"] = json.dumps(tok_config, indent=2)
    shapes = _shapes(m)
    read = lambda name: source.get(name, shapes[name])  # noqa: E731
    count, size = write_hf(out, config, arch.to_hf(read, m), files, max_shard_bytes, dtype)
    note = ""
    if m.dropout and arch.model_type != "gpt2":
        note = (f"; model.dropout={m.dropout} is not written ({arch.hf_class} has attention "
                "dropout only; tessel's also drops the residual stream)")
    note += bias_note
    return (f"wrote {out}: {arch.hf_class}, {count} tensors, {size / 2**20:.1f} MiB "
            f"({'one file' if size <= max_shard_bytes else 'sharded'}{with_template}); load it with "
            f"transformers.AutoModelForCausalLM.from_pretrained{note}")


def _shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    from tessel.models.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(m)
    return {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a byte count -> bytes."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
             "gib": 2**30}
    t = text.strip().lower()
    number = t.rstrip("kmgib")
    try:
        value = float(number) * units[t[len(number):]]
    except (ValueError, KeyError):
        raise HFError(f"--max-shard-size {text!r}: use e.g. 5GB, 500MB or 2GiB") from None
    if value < 1:
        raise HFError("--max-shard-size must be positive")
    return int(value)
