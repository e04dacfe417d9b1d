"""FP8 training of the blocks' linear layers through torchao (Hopper and newer).

torchao's `convert_to_float8_training` swaps each `nn.Linear` for a `Float8Linear` that casts
its input, weight and output gradient to float8 with dynamic per-tensor scales for the three
matmuls and keeps the master weights in their own dtype. Embeddings, the output head and
norms stay in bf16 (the head's logits are sensitive and its shape is vocabulary-bound).
"""

from __future__ import annotations

import torch
from torch import nn

from tessel.config import Config
from tessel.errors import TesselError


def check_fp8(cfg: Config, device: torch.device) -> None:
    """Refuse train.fp8 where it cannot run, in one line that says why."""
    if not cfg.train.fp8:
        return
    if device.type != "cuda":
        raise TesselError(
            f"train.fp8 needs an NVIDIA GPU with FP8 tensor cores (compute capability 8.9+); "
            f"this run is on {device.type}: set train.fp8 = false"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise TesselError(
            f"train.fp8 needs FP8 tensor cores (compute capability 8.9+: Ada, Hopper, "
            f"Blackwell); {name} is {major}.{minor}: set train.fp8 = false"
        )
    if cfg.train.precision not in ("bf16", "auto"):
        raise TesselError(f"train.fp8 runs under bf16; set train.precision = 'bf16' "
                          f"(not {cfg.train.precision!r})")
    if cfg.parallel.tp > 1 or cfg.parallel.pp > 1:
        raise TesselError("train.fp8 is supported with data parallelism (DDP, ZeRO) only; "
                          "set parallel.tp = 1 and parallel.pp = 1")
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise TesselError("train.fp8 needs torchao: pip install torchao") from None


def apply_fp8(stage: nn.Module) -> None:
    """Float8 linears in every block of `stage` (on meta, before compile and FSDP)."""
    from torchao.float8 import convert_to_float8_training

    # float8 matmuls need both dimensions divisible by 16.
    def eligible(mod: nn.Module, _fqn: str) -> bool:
        return isinstance(mod, nn.Linear) and mod.in_features % 16 == 0 and mod.out_features % 16 == 0

    for block in stage.layers.values():  # type: ignore[union-attr]
        convert_to_float8_training(block, module_filter_fn=eligible)
