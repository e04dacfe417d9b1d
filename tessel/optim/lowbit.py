"""Optimizer state in low precision (`optim.state_dtype`): AdamW's moments and Muon's
momentum in bfloat16 with stochastic rounding, and torchao's 8-bit AdamW.

bfloat16 keeps 8 bits of mantissa: rounding a moment to nearest after every update would
drop the small increments that (1 - beta) x gradient adds, and the moments would stall.
Stochastic rounding rounds up or down at random, with the probabilities that make the
stored value right on average, so the increments survive in expectation. The update itself
runs in float32 on the float32 parameters; only the stored state is bfloat16 (half of
AdamW's 8 bytes per parameter).

The random bits are drawn from a generator seeded by (step, parameter, shard), never from
the global RNG: a resumed run rounds exactly as the uninterrupted one did, and replicas of a
parameter (DDP, HSDP's replicate dimension, TP's replicated norms) round alike and stay
identical.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from tessel.errors import TesselError
from tessel.optim.offload import placed_like

STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The state precisions tessel's own update keeps (int8 is torchao's)."""
_MASK = -65536  # 0xFFFF0000 as an int32: the bits a bfloat16 keeps of a float32


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def stochastic_round(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """float32 `x` in bfloat16, each element rounded away from zero with probability (the
    part a bfloat16 cannot hold) / (one bfloat16 step): E[result] = x."""
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device,
                          generator=generator)
    # Adding to the bit pattern adds to the magnitude (sign apart); masking truncates it.
    return ((x.view(torch.int32) + noise) & _MASK).view(torch.float32).to(torch.bfloat16)


def shard_index(p: torch.Tensor) -> int:
    """Which shard of `p` this rank holds, counted over the mesh dimensions that shard it
    (replicas share an index, so they round alike); 0 for a plain tensor."""
    if not isinstance(p, DTensor):
        return 0
    index = 0
    for size, coord, placement in zip(p.device_mesh.shape, p.device_mesh.get_coordinate(),
                                      p.placements):
        if not placement.is_replicate():
            index = index * size + coord
    return index


def closure_loss(closure: Any) -> Any:
    """What an optimizer's `step(closure)` returns: the closure's loss, computed with
    gradients enabled (step itself runs under no_grad), or None without a closure."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class Rounder:
    """Stores float32 values into state tensors of their own dtype: bfloat16 by stochastic
    rounding from a generator seeded by (step, parameter, shard), float32 as they are."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.generators: dict[torch.device, torch.Generator] = {}

    def store(self, dst: torch.Tensor, src: torch.Tensor, step: int, key: tuple) -> None:
        if dst.dtype == torch.float32:
            dst.copy_(src)
            return
        gen = self.generators.get(src.device)
        if gen is None:
            gen = self.generators[src.device] = torch.Generator(device=src.device)
        gen.manual_seed(hash((self.seed, step, *key)) & (2**62 - 1))
        dst.copy_(stochastic_round(src, gen))


STATE_KEYS = ("exp_avg", "exp_avg_sq", "momentum_buffer")


def keep_state_dtype(opt: torch.optim.Optimizer, dtype: torch.dtype) -> None:
    """Have `opt` keep its state in `dtype` across load_state_dict, which casts loaded
    floating-point state to its parameter's dtype (float32: twice the memory, and no more
    rounding)."""
    def recast(o: torch.optim.Optimizer) -> None:
        for state in o.state.values():
            for key in STATE_KEYS:
                if key in state and state[key].dtype != dtype:
                    state[key] = state[key].to(dtype)  # exact: the values were saved in it

    if dtype != torch.float32:
        opt.register_load_state_dict_post_hook(recast)


def adamw_step(opt: torch.optim.Optimizer, group: dict, rounder: Rounder, dtype: torch.dtype,
               group_index: int) -> None:
    """PyTorch's AdamW update (single-tensor form, decoupled weight decay) of `group`'s
    parameters with both moments stored in `dtype` (tests: float32 = torch.optim.AdamW)."""
    beta1, beta2 = group["betas"]
    lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
    for k, p in enumerate(group["params"]):
        if p.grad is None:
            continue
        state = opt.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype)
        state["step"] += 1
        step = int(state["step"].item())
        g = local(placed_like(p.grad, p)).float()
        m, v = local(state["exp_avg"]), local(state["exp_avg_sq"])
        m32 = m.float().lerp_(g, 1 - beta1)
        v32 = v.float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
        w = local(p)
        w.mul_(1 - lr * wd)
        denom = (v32.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
        w.addcdiv_(m32, denom, value=-lr / (1 - beta1 ** step))
        key = (group_index, k, shard_index(p))
        rounder.store(m, m32, step, (*key, 0))
        rounder.store(v, v32, step, (*key, 1))


class StateAdamW(torch.optim.AdamW):
    """AdamW with its moments in `state_dtype` (bfloat16: stochastic rounding); its state
    has AdamW's keys and shapes, so checkpoints treat it as AdamW's."""

    def __init__(self, groups: list[dict], *, state_dtype: str, **kw: Any):
        super().__init__(groups, **kw)
        self.state_dtype = STATE_DTYPES[state_dtype]
        self.rounder = Rounder()
        keep_state_dtype(self, self.state_dtype)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure_loss(closure)
        for n, group in enumerate(self.param_groups):
            adamw_step(self, group, self.rounder, self.state_dtype, n)
        return loss


class TorchaoImportNoise(logging.Filter):
    """What importing torchao logs that says nothing about the run: each of its compiled
    extensions (`torchao/_C*.so`: mxfp8, CUTLASS kernels) that does not load on this machine
    ("Failed to load ..."; the 8-bit AdamW runs without them), and PyTorch's deprecation
    notice for the enum torchao registers. Everything else still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        extension = msg.startswith("Failed to load ") and "torchao" in msg and "_C" in msg
        return not (extension or "is an Enum subclass and is now natively supported" in msg)


def import_adamw_8bit() -> Any:
    """torchao's AdamW8bit class, imported with TorchaoImportNoise on the two loggers that
    import writes to (once per process: the import runs once). Its first compiled step's
    UserWarning that the state's tensor subclass has no stable cache hash (PyTorch's AOT
    cache then skips it) is left out too."""
    warnings.filterwarnings("ignore", category=UserWarning,
                            message="OptimState8bit does not implement _stable_hash_for_caching")
    noise = TorchaoImportNoise()
    loggers = [logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")]
    for logger in loggers:
        logger.addFilter(noise)
    try:
        from torchao.optim import AdamW8bit
    finally:
        for logger in loggers:
            logger.removeFilter(noise)
    return AdamW8bit


def adamw_8bit(groups: list[dict], **kw: Any) -> torch.optim.Optimizer:
    """torchao's AdamW8bit (blockwise-quantised moments, 256 per float32 scale)."""
    try:
        AdamW8bit = import_adamw_8bit()  # noqa: N806
    except ImportError:
        raise TesselError("optim.state_dtype = 'int8' is torchao's 8-bit AdamW, and torchao "
                          "is not installed: pip install 'tessel[lowbit]', or choose "
                          "optim.state_dtype = 'bfloat16' or 'float32'") from None
    return AdamW8bit(groups, **kw)
