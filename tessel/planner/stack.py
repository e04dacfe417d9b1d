"""The software stack a GPU prediction assumes, as a property of its kernels.

The profiles' matmul efficiency (hardware.MATMUL_EFFICIENCY) is fitted to Megatron-LM's
published runs: Transformer Engine's fused kernels, ZeRO-1, TP and PP. tessel runs the
PyTorch-native stack (FSDP2, DTensor, SDPA, torch.compile of each block), as torchtitan does,
and reaches a smaller share of the peak with it: each stack is the fraction of Megatron's
matmul efficiency its kernels reach, fitted on the published runs of that stack
(tessel/planner/published.py; docs/planning.md's table). Once tessel has measured itself on a
GPU, `tessel plan --calibrate BENCH.json` fits the profile's efficiency to that run, which
then replaces this assumption (the stack's factor applies to the calibrated efficiency as it
did when it was fitted, so the prediction of the calibrated run is what it measured).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tessel.planner.hardware import GpuProfile


@dataclass(frozen=True)
class Stack:
    name: str
    matmul_factor: dict[str, float]
    """By GPU generation (`generation`): the fraction of the profile's (Megatron-fitted) matmul
    efficiency this stack reaches."""
    description: str

    def factor(self, hw: GpuProfile) -> float:
        return self.matmul_factor[generation(hw)]


def generation(hw: GpuProfile) -> str:
    """"ampere" for the A100 profiles, else "hopper" (H100, H200, H800; later GPUs, until a
    published run of theirs says otherwise, as Hopper)."""
    return "ampere" if hw.name.startswith("a100") else "hopper"


# Fitted on torchtitan's published runs (published.py): on Ampere the PyTorch-native stack
# reached what Megatron-LM reached (64 A100s, eager: -10% to +2% at 1.0), where both ran
# FlashAttention-2 and cuBLAS; on Hopper it reaches less, since Megatron's Transformer
# Engine and cuDNN kernels use Hopper's asynchronous tensor cores and fuse the element-wise
# work that SDPA's FlashAttention-2 path and eager PyTorch leave apart (H100 at 500 W: 0.68
# eager, 0.79 with torch.compile, within 2.1% of all four rows). torch.compile: x 1/0.86
# (torchtitan measured 5,762 against 6,667 tokens/s per GPU on 8 H100s, 5,605 against 6,514
# on 128).
COMPILE_GAIN = 1 / 0.86
MEGATRON = Stack("megatron-te", {"ampere": 1.0, "hopper": 1.0},
                 "Megatron-LM with Transformer Engine's fused kernels (the profiles' fit)")
PYTORCH_EAGER = Stack(
    "pytorch-eager", {"ampere": 1.0, "hopper": 0.68},
    "PyTorch-native without torch.compile: FSDP2/DTensor, SDPA (FlashAttention-2)")
PYTORCH_COMPILED = Stack(
    "pytorch-compile", {g: min(f * COMPILE_GAIN, 1 / 0.625)
                        for g, f in PYTORCH_EAGER.matmul_factor.items()},
    "PyTorch-native with torch.compile of each block (as train.compile)")
STACKS = {s.name: s for s in (MEGATRON, PYTORCH_COMPILED, PYTORCH_EAGER)}


def tessel_stack(compile: bool) -> Stack:
    """The stack a tessel run is: compiled blocks (train.compile) or eager."""
    return PYTORCH_COMPILED if compile else PYTORCH_EAGER


def on_stack(hw: GpuProfile, stack: Stack) -> GpuProfile:
    """`hw` as `stack` runs on it (profiles measured on CPU processes are tessel's already)."""
    factor = stack.factor(hw)
    if hw.device_type != "cuda" or factor == 1.0:
        return hw
    return dataclasses.replace(hw, matmul_efficiency=hw.matmul_efficiency * factor)
