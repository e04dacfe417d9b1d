"""The config of the run that wrote a checkpoint, as every reader of a run takes it.

A run directory's `config.toml` is the run's whole config (secrets included, which the copy
in each checkpoint's state.json has redacted), but it is a file anyone may edit after the
checkpoint was saved. The settings that fix what a checkpoint's tensors mean (`frozen_keys`:
the model, the tokenizer, LoRA's rank, alpha and targets, ...) must be the ones state.json
recorded: `train --resume` refuses to change them, and every other reader of a run
(`generate`, `checkpoint consolidate`, `convert tessel-to-hf` with or without `--peft`,
`model.init_from`) refuses an edited config.toml the same way (`run_config`), through the
one comparison here (`config_change`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tessel.checkpoint.errors import CheckpointError
from tessel.checkpoint.state_file import damaged, read_state
from tessel.config import Config, ConfigError, read_saved, with_saved_defaults
from tessel.models.lora import resolve_targets

# Changing these on resume would silently change what the checkpoint means.
# (Mixture weights and cache locations may change; the loader checks the datasets themselves.)
FROZEN_ON_RESUME = (
    "model", "data.source", "data.tokenizer", "data.split", "data.json_key", "train.seq_len",
    "train.seed", "data.chat_template", "data.sft_overlong", "data.sft_pack", "lora.enabled",
    "optim.name", "optim.state_dtype",
)
# A LoRA run's checkpoints hold its adapters: which projections have them, their shape and
# the scale (alpha / rank) their term is multiplied by. Other targets would drop adapters (or
# leave new ones untrained beside them), another alpha would rescale them; lora.dropout,
# lora.base_dtype and lora.export may change like any training setting.
FROZEN_WITH_LORA = ("lora.rank", "lora.alpha", "lora.targets")
# A Muon run's checkpoints hold a momentum buffer for each Muon matrix and AdamW's moments
# for the rest: moving a parameter between the two would leave it without its state.
FROZEN_WITH_MUON = ("optim.muon_adamw", "optim.muon_force")


def saved_config(ckpt: Path, state: dict[str, Any]) -> Config:
    """The config checkpoint `ckpt` recorded in its state.json (`state`), secrets redacted."""
    try:
        return Config.from_dict(with_saved_defaults(state["config"]))
    except KeyError:
        raise damaged(ckpt, "lacks the run's config") from None
    except ConfigError as exc:
        raise damaged(ckpt, f"holds a config tessel cannot read ({exc})") from None


def frozen_keys(then: Config) -> tuple[str, ...]:
    """The settings a checkpoint saved under config `then` fixes."""
    return (FROZEN_ON_RESUME + (FROZEN_WITH_LORA if then.lora.enabled else ())
            + (FROZEN_WITH_MUON if then.optim.name == "muon" else ()))


def config_change(then: Config, now: Config) -> tuple[str, str] | None:
    """(the key, "KEY was OLD in the run, now NEW") for the first setting the checkpoint
    saved under `then` fixes that `now` changes; None when there is none."""
    for key in frozen_keys(then):
        old, new = _get(then, key), _get(now, key)
        if not _same(key, old, new):
            return key, _first_difference(key, old, new)
    return None


def run_config(ckpt: Path, state: dict[str, Any] | None = None) -> Config:
    """The config of the run that wrote checkpoint `ckpt`: its run directory's config.toml
    (which keeps the secrets), refused in one line when it was edited since on a setting the
    checkpoint fixes; the copy in state.json when the run directory has no config.toml."""
    state = read_state(ckpt) if state is None else state
    then = saved_config(ckpt, state)
    toml = ckpt.parent.parent / "config.toml"
    if not toml.is_file():
        return then
    now = Config.from_dict(read_saved(toml))
    change = config_change(then, now)
    if change is not None:
        raise CheckpointError(
            f"{str(toml)!r} was changed after checkpoint {ckpt.name} was saved: {change[1]}; "
            "put it back as it was (the checkpoint's state.json records it), or start a new "
            "run for another setting")
    return now


def _get(cfg: Config, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node.model_dump() if hasattr(node, "model_dump") else node


def _same(key: str, old: Any, new: Any) -> bool:
    if key == "lora.targets":  # the same projections, by tessel's or Hugging Face's names
        return resolve_targets(old) == resolve_targets(new)
    return old == new


def _first_difference(key: str, old: Any, new: Any) -> str:
    if isinstance(old, dict) and isinstance(new, dict):
        for k in old:
            if old[k] != new.get(k):
                return f"{key}.{k} was {old[k]!r} in the run, now {new.get(k)!r}"
    return f"{key} was {old!r} in the run, now {new!r}"
