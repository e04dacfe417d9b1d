"""Whether a run may start or resume in its directory, and from which checkpoint.

Nothing here writes: a refused start leaves the run directory as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tessel.checkpoint import CheckpointError, read_state
from tessel.config import Config, with_saved_defaults
from tessel.data import load_tokenizer
from tessel.errors import DataError, TesselError
from tessel.models.lora import resolve_targets
from tessel.train.control import EXIT_PAUSED
from tessel.train.run_dir import RunDir

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


class RunHalted(TesselError):
    """--auto-resume on a run that paused or stopped on purpose; exits with its code."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def resume_point(run: RunDir, cfg: Config, resume: bool, auto_resume: bool,
                 say: Callable[[str], None]) -> tuple[Path, dict[str, Any]] | None:
    """Refuse to overwrite a run, or to resume one incompatibly; the checkpoint to resume
    from and its state, or None to start from step 0."""
    if not resume:
        if run.holds_run():
            raise TesselError(
                f"{str(run.path)!r} already holds a run; continue it with "
                f"`tessel train --resume {run.path}` or choose another --run.dir"
            )
        return None
    if not run.holds_run():
        raise CheckpointError(f"nothing to resume: {str(run.path)!r} holds no run")
    halted = run.halted()
    if halted is not None and auto_resume:
        raise RunHalted(
            f"{run.path} {halted.get('message', 'was halted')}; not resuming it "
            f"automatically: continue it with `tessel train --resume {run.path}`",
            int(halted.get("exit_code", EXIT_PAUSED)),
        )
    ckpt = run.latest_checkpoint()
    if ckpt is None:  # stopped before its first checkpoint: start it again from step 0
        say(f"tessel: {run.path} has no checkpoint yet; starting from step 0")
        return None
    state = read_state(ckpt)
    try:
        then = Config.from_dict(with_saved_defaults(state["config"]))
    except KeyError:
        raise CheckpointError(f"checkpoint {str(ckpt)!r} lacks its config; it is damaged") from None
    frozen = (FROZEN_ON_RESUME + (FROZEN_WITH_LORA if then.lora.enabled else ())
              + (FROZEN_WITH_MUON if then.optim.name == "muon" else ()))
    for key in frozen:
        old, new = _get(then, key), _get(cfg, key)
        if not _same(key, old, new):
            # another optimizer has no state to resume: it starts from the weights
            fresh = (" (from its weights: model.init_from = a checkpoint of it)"
                     if key.startswith("optim.") else "")
            raise CheckpointError(
                f"cannot resume {str(run.path)!r}: {_first_difference(key, old, new)}; resume "
                f"without changing it or start a new run{fresh}"
            )
    return ckpt, state


def check_tokenizer(run: RunDir, tokenizer: Any) -> None:
    """The data's tokenizer must be the one the run was trained with."""
    saved = load_tokenizer(run.tokenizer)
    if saved.fingerprint() != tokenizer.fingerprint():
        raise DataError(
            f"the data's tokenizer differs from the one {str(run.path)!r} was trained "
            "with; resume with the data the run was started with"
        )


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
