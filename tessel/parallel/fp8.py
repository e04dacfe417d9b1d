"""FP8 training of the blocks' linear layers through torchao's float8 training.

`convert_to_float8_training` swaps each eligible `nn.Linear` for a `Float8Linear` that casts
its input, weight and output gradient to float8 with dynamic scales (one per tensor:
`tensorwise`; one per row: `rowwise`, `rowwise_with_gw_hp`) for the three matmuls and keeps
the master weights in their own dtype. The output layer (its logits are sensitive and its
shape is vocabulary-bound), the MoE router, the routed experts (grouped matmuls, no
`nn.Linear`) and every matrix with a dimension that is not a multiple of 16 (what the FP8
matmul kernels take) stay in high precision.

On a CPU (or on request, `train.fp8_emulate`) torchao emulates the float8 matmul: the same
casts, scales and autograd run and the product of the dequantised operands is taken in
float32, so CPU tests prove the layouts an FP8 GPU runs. The conversion comes before tensor
parallelism (`tessel.parallel.apply`), whose plans then use torchao's float8 styles under
tensorwise scaling (activations cross the tp group in float8); under FSDP the weights are
all-gathered in float8 (tensorwise, `train.fp8_all_gather`), each weight's scale from an
amax all-reduce at its all-gather. (torchao's `precompute_float8_dynamic_scale_for_fsdp`,
one all-reduce for all of them after the optimizer step, is not used: a scale kept on the
weight would go stale when a checkpoint load or a rollback replaces the weights.)
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tessel.config import Config
from tessel.errors import TesselError

MATMUL_MULTIPLE = 16
"""The FP8 matmul needs both dimensions of a weight divisible by this."""


def fp8_recipe(cfg: Config) -> str | None:
    """train.fp8's scaling recipe (`true` is tensorwise), or None for a run without FP8."""
    fp8 = cfg.train.fp8
    if fp8 is True:
        return "tensorwise"
    return fp8 or None


def fp8_emulated(cfg: Config, device: torch.device | str) -> bool:
    """Whether the float8 matmuls are emulated: train.fp8_emulate, or (unset) off CUDA."""
    chosen = cfg.train.fp8_emulate
    return torch.device(device).type != "cuda" if chosen is None else chosen


def fp8_all_gather(cfg: Config, dp_kind: str, tp: int = 1) -> bool:
    """FSDP all-gathers the float8 weights: tensorwise scaling with train.fp8_all_gather,
    under ZeRO (`dp_kind` "fsdp", `tessel.parallel.fsdp.data_parallel_kind`); the wrapper
    this puts on the weights serves FSDP's all-gather and nothing else. Not beside tensor
    parallelism: torchao's float8 all-gather reduces the weight's amax over the FSDP group
    only, so each tensor-parallel shard would get a scale of its own (measured: losses 1e-4
    apart from the first step); there the weights are all-gathered in high precision and
    cast with the whole weight's scale."""
    return (fp8_recipe(cfg) == "tensorwise" and cfg.train.fp8_all_gather
            and dp_kind == "fsdp" and tp == 1)


def check_fp8(cfg: Config, device: torch.device, tp: int, say: Callable[[str], Any]) -> None:
    """Refuse train.fp8 where it cannot run, in one line that names the key; otherwise say
    in one line what runs in float8 (and that it is emulated, where it is)."""
    recipe = fp8_recipe(cfg)
    if recipe is None:
        return
    emulate = fp8_emulated(cfg, device)
    _check_hardware(cfg, recipe, device, emulate)
    check_fp8_layout(cfg)
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise TesselError("train.fp8 needs torchao: pip install torchao (or set "
                          "train.fp8 = false)") from None
    say(fp8_summary(cfg, recipe, device, tp))


def _check_hardware(cfg: Config, recipe: str, device: torch.device, emulate: bool) -> None:
    if recipe == "mxfp8":
        # torchao 0.18 offers MXFP8 training only in its MoE prototype
        # (torchao.prototype.moe_training.MXFP8TrainingOpConfig through quantize_), not
        # through Float8Linear. Tried (emulated, one CPU process): it trains, but the
        # checkpoint pickles its weight wrapper (a resume is refused by weights_only
        # loading) and every matmul's token count must be a multiple of the block size 32.
        raise TesselError("train.fp8 = 'mxfp8' is not available with this torchao (MXFP8 "
                          "training is a prototype there); use 'tensorwise' or 'rowwise'")
    if not emulate and device.type != "cuda":
        raise TesselError(
            f"train.fp8 needs an NVIDIA GPU with FP8 tensor cores (compute capability 8.9+) "
            f"unless emulated; this run is on {device.type}: leave train.fp8_emulate unset "
            f"(or true) to emulate the float8 matmuls, or set train.fp8 = false")
    if not emulate:
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            name = torch.cuda.get_device_name(device)
            raise TesselError(
                f"train.fp8 needs FP8 tensor cores (compute capability 8.9+: Ada, Hopper, "
                f"Blackwell); {name} is {major}.{minor}: set train.fp8 = false (or "
                f"train.fp8_emulate = true to debug)")
    precision = cfg.train.precision
    if recipe == "rowwise_with_gw_hp" and precision == "bf16" and device.type != "cuda":
        # measured: its high-precision weight-gradient matmul meets a bf16 and a float32
        # operand under CPU autocast ("expected m1 and m2 to have the same dtype")
        raise TesselError("train.fp8 = 'rowwise_with_gw_hp' does not run under bf16 on a CPU "
                          "(torchao's high-precision weight gradient mixes bf16 and float32 "
                          "there); set train.precision = 'fp32' or train.fp8 = 'rowwise'")
    allowed = ("bf16", "auto", "fp32") if emulate else ("bf16", "auto")
    if precision not in allowed:
        raise TesselError(f"train.fp8 runs under bf16{' or fp32 (emulated)' if emulate else ''}; "
                          f"set train.precision = 'bf16' (not {precision!r})")


def check_fp8_layout(cfg: Config) -> None:
    """Refuse the train.fp8 combinations that cannot run, in one line naming the key (the
    layout itself: any of dp, ZeRO, tp with sequence parallelism, pp, cp)."""
    recipe = fp8_recipe(cfg)
    if recipe is None:
        return
    del recipe


def fp8_summary(cfg: Config, recipe: str, device: torch.device, tp: int) -> str:
    """The start-up line: the recipe, what stays in high precision and why, emulation."""
    emulate = fp8_emulated(cfg, device)
    with torch.device("meta"):
        from tessel.models.transformer import Transformer

        model = Transformer(cfg.model)
    converted, kept = 0, set()
    for block in model.layers.values():  # type: ignore[union-attr]
        for name, mod in block.named_modules():
            if isinstance(mod, nn.Linear):
                reason = _kept_because(mod, name, tp)
                if reason:
                    kept.add(f"{name} ({reason})")
                else:
                    converted += 1
    if not converted:
        raise TesselError(
            f"train.fp8: no linear layer of this model has dimensions that are multiples of "
            f"{MATMUL_MULTIPLE}{' per tensor-parallel shard' if tp > 1 else ''} (kept: "
            f"{'; '.join(sorted(kept))}); set train.fp8 = false")
    mode = ("emulated: the float8 casts and scales run, the matmuls in float32" if emulate
            else "on the GPU's FP8 tensor cores")
    high = "; ".join(["output layer", *sorted(kept)])
    moe = ", MoE routed experts (no float8 grouped matmul wired)" if cfg.model.moe_experts else ""
    extra = []
    if tp > 1 and recipe == "tensorwise":
        extra.append("tensor-parallel activations cross in float8"
                     if float8_collectives(cfg, device) else
                     "tensor-parallel activations cross in high precision (gloo has no "
                     "float8 collectives; the same numbers)")
    if cfg.parallel.zero != 0 and cfg.train.fp8_all_gather:
        extra.append("FSDP all-gathers the weights in float8" if recipe == "tensorwise" and tp == 1
                     else "FSDP all-gathers the weights in high precision (float8 all-gather "
                     "needs tensorwise scaling and no tensor parallelism)")
    if cfg.parallel.cp > 1 and recipe == "tensorwise":
        extra.append("under context parallelism the activations' and output gradients' scales "
                     "come from the whole sequence (amax all-reduced over the cp ranks)"
                     if tp == 1 else "under context parallelism with tensor parallelism each "
                     "cp rank scales its own tokens (close to one process's run, not equal)")
    if cfg.train.fp8_recompute_weight:
        extra.append("the float8 weight is recomputed in backward (torchao 0.18 always does)")
    return (f"train.fp8: {recipe} scaling on {converted} block linears ({mode}); kept in "
            f"high precision: {high}{moe}" + "".join(f"; {e}" for e in extra))


ROW_PARALLEL = ("attention.wo", "feed_forward.w2")
"""The projections tensor parallelism splits by input columns (the others by output rows)."""


def _kept_because(mod: nn.Linear, name: str, tp: int) -> str | None:
    """Why a block's linear stays in high precision, or None when it goes to float8: the
    router, or a dimension of its tensor-parallel shard not a multiple of 16."""
    if name.endswith("router") or ".router." in f".{name}.":
        return "router"
    split_in = name.endswith(ROW_PARALLEL)
    n_in = mod.in_features // (tp if split_in else 1)
    n_out = mod.out_features // (1 if split_in else tp)
    if n_in % MATMUL_MULTIPLE or n_out % MATMUL_MULTIPLE or min(n_in, n_out) == 0:
        shard = " per tensor-parallel shard" if tp > 1 else ""
        return f"{n_out}x{n_in}{shard}, not multiples of {MATMUL_MULTIPLE}"
    return None


def float8_config(cfg: Config, emulate: bool, all_gather: bool) -> Any:
    """torchao's Float8LinearConfig for train.fp8's recipe (`all_gather`: `fp8_all_gather`)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig

    recipe = fp8_recipe(cfg)
    assert recipe is not None
    base = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(base, emulate=emulate,
                               enable_fsdp_float8_all_gather=all_gather)


def apply_fp8(stage: nn.Module, cfg: Config, emulate: bool, all_gather: bool, tp: int) -> None:
    """Float8 linears in every block of `stage` (on meta, before tensor parallelism of
    degree `tp`, compile and FSDP), those `_kept_because` names left alone."""
    from torchao.float8 import convert_to_float8_training

    def eligible(mod: nn.Module, fqn: str) -> bool:
        return isinstance(mod, nn.Linear) and _kept_because(mod, fqn, tp) is None

    config = float8_config(cfg, emulate, all_gather)
    for block in stage.layers.values():  # type: ignore[union-attr]
        convert_to_float8_training(block, module_filter_fn=eligible, config=config)


def scales_over_context(stage: nn.Module, cp_mesh: Any, recipe: str | None, tp: int) -> None:
    """Tensorwise scaling (`recipe`) under context parallelism without tensor parallelism
    (`tp` 1; nothing otherwise): each block's float8 linear scales its input and its output
    gradient by the amax of the whole sequence, reduced over the cp ranks (one all-reduce of
    a scalar per cast), so each cast is the one a single process makes of the whole
    micro-batch. Each rank scaling its own
    part (torchtitan's way) kept such a run only close to one process's (losses 4e-4 apart
    after 4 steps). Rowwise scales are per token row already: the same on any split."""
    if recipe != "tensorwise" or tp > 1:
        return
    from torchao.float8.float8_linear import Float8Linear

    scaled = _context_scaled_class()
    for block in stage.layers.values():  # type: ignore[union-attr]
        for mod in block.modules():
            if type(mod) is Float8Linear:
                mod.__class__ = scaled
                mod.scale_mesh = cp_mesh


def _context_scaled_class() -> type:
    """Float8Linear whose input and output-gradient casts take their amax over
    `scale_mesh`'s group (scales_over_context); built on first use (torchao is optional)."""
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    global _CONTEXT_SCALED
    if _CONTEXT_SCALED is not None:
        return _CONTEXT_SCALED

    class GradScaledOver(torch.autograd.Function):
        """Forward: unchanged. Backward: the gradient cast to float8 with the group's amax
        (torchao's NoopFwToFloat8BwDynamic, the amax reduced), which the matmul's backward
        then takes as it is for both of its products."""

        @staticmethod
        def forward(ctx: Any, y: torch.Tensor, linear: Any) -> torch.Tensor:  # noqa: ANN401
            ctx.linear = linear
            return y

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None]:  # noqa: ANN401
            m = ctx.linear
            c = m.config
            return hp_tensor_to_float8_dynamic(
                grad, c.cast_config_grad_output.target_dtype, m.linear_mm_config,
                reduce_amax=True, gemm_input_role=GemmInputRole.GRAD_OUTPUT,
                device_mesh=m.scale_mesh,
                round_scales_to_power_of_2=c.round_scales_to_power_of_2), None

    class ContextScaledFloat8Linear(Float8Linear):
        scale_mesh: Any = None

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            if torch.is_autocast_enabled():  # as Float8Linear.forward
                input = input.to(torch.get_autocast_gpu_dtype())
            c = self.config
            x = hp_tensor_to_float8_dynamic(
                input, c.cast_config_input.target_dtype, self.linear_mm_config,
                reduce_amax=True, gemm_input_role=GemmInputRole.INPUT,
                device_mesh=self.scale_mesh, round_scales_to_power_of_2=c.round_scales_to_power_of_2)
            out = matmul_with_hp_or_float8_args.apply(x, self.weight.t(), self.linear_mm_config, c)
            out = GradScaledOver.apply(out, self)
            if self.bias is not None:
                out = out + self.bias.to(out.dtype)
            return out

    _CONTEXT_SCALED = ContextScaledFloat8Linear
    return _CONTEXT_SCALED


_CONTEXT_SCALED: type | None = None


class TPStyles:
    """The tensor-parallel styles of the blocks' projections: torchao's float8 ones for the
    Float8Linear modules under tensorwise scaling (the activations' all-gathers move float8,
    the output gradients are cast before their collectives), PyTorch's own otherwise."""

    def __init__(self, float8: bool = False):
        self.float8 = float8

    def _is_float8(self, *modules: nn.Module | None) -> bool:
        if not self.float8:
            return False
        from torchao.float8.float8_linear import Float8Linear

        return all(m is None or isinstance(m, Float8Linear) for m in modules)

    def colwise(self, module: nn.Module, **kw: Any) -> Any:
        if self._is_float8(module):
            from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel

            return Float8ColwiseParallel(**kw)
        from torch.distributed.tensor.parallel import ColwiseParallel

        return ColwiseParallel(**kw)

    def rowwise(self, module: nn.Module, **kw: Any) -> Any:
        if self._is_float8(module):
            from torchao.float8.float8_tensor_parallel import Float8RowwiseParallel

            return Float8RowwiseParallel(**kw)
        from torch.distributed.tensor.parallel import RowwiseParallel

        return RowwiseParallel(**kw)

    def prepare_input(self, consumers: list[nn.Module | None], **kw: Any) -> Any:
        """The sequence all-gather before `consumers` (the projections that read the
        module's first input): in float8, cast once, when all of them are float8."""
        if self._is_float8(*consumers):
            from torchao.float8.float8_tensor_parallel import PrepareFloat8ModuleInput

            return PrepareFloat8ModuleInput(**kw)
        from torch.distributed.tensor.parallel import PrepareModuleInput

        return PrepareModuleInput(**kw)


def float8_collectives(cfg: Config, device: torch.device | str) -> bool:
    """Tensor-parallel activations cross in float8: tensorwise scaling on CUDA (NCCL).
    gloo has no float8 dtypes, so on CPU they cross in high precision; the numbers are the
    same (each is cast with the same whole-tensor scale before or after its all-gather)."""
    return fp8_recipe(cfg) == "tensorwise" and torch.device(device).type == "cuda"


def tp_styles(cfg: Config, device: torch.device | str) -> TPStyles:
    """train.fp8's tensor-parallel styles (float8 ones where `float8_collectives`)."""
    return TPStyles(float8_collectives(cfg, device))


def plain_tensor(t: Any) -> Any:
    """A weight (or its optimizer state) as checkpoints hold it: torchao's float8
    all-gather wrapper (FSDP with train.fp8_all_gather) taken off, sharing storage, so
    checkpoints of FP8 runs are the plain tensors of bf16 runs (loadable by any layout and
    by the weights-only reader). Anything else is returned as it is."""
    if not isinstance(t, torch.Tensor) or "torchao.float8" not in sys.modules:
        return t
    from torch.distributed.tensor import DTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    if isinstance(t, DTensor) and isinstance(t._local_tensor, WeightWithDynamicFloat8CastTensor):
        with torch.no_grad():
            return DTensor.from_local(t._local_tensor._tensor, t.device_mesh, t.placements,
                                      run_check=False, shape=t.shape, stride=t.stride())
    return t._tensor if isinstance(t, WeightWithDynamicFloat8CastTensor) else t
