"""Runs one probe model of the activation probe (`probe.py`) and records what it saves.

One forward of a small model plus its loss, in a precision regime, under saved-tensor hooks:
every tensor autograd saves, once per storage, with the module that saved it; the outputs of
the operators each selective checkpointing policy keeps (a dispatch mode); and the weights' low-precision
copies autocast saves. What the model hands every block besides its hidden state (masks, the
RoPE table) is shared by the blocks and left out. With `lora`, the probe's blocks carry
adapters as the run's (`tessel.planner.lora.probe_adapters`); `later_block`: the block's
input needs a gradient, as every block's but the first does in a LoRA model (whose
embeddings are frozen).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tessel.config import LoraConfig, ModelConfig
from tessel.models.loss import token_loss_sum
from tessel.models.transformer import Transformer
from tessel.parallel.checkpointing import KeepRule
from tessel.parallel.context import chunk_positions
from tessel.planner.exchange import ShapeExchange
from tessel.planner.lora import probe_adapters

BATCH, POSITIONS = 2, 8  # the probe's micro-batch and (its rank's) positions
KEEPING = ("selective", "matmuls")
"""The checkpointing policies that keep operator outputs (tessel.parallel.checkpointing)."""
_B, _T = BATCH, POSITIONS


class _ModuleStack:
    """The qualified name of the module running now, from forward hooks."""

    def __init__(self, model: nn.Module):
        self.stack = ["loss"]  # outside every module: the loss
        self.handles = []
        for name, module in model.named_modules():
            if not name:
                continue
            self.handles.append(module.register_forward_pre_hook(self._enter(name)))
            self.handles.append(module.register_forward_hook(self._leave))

    def _enter(self, name: str):  # noqa: ANN202
        def hook(_module: nn.Module, _args: tuple) -> None:
            self.stack.append(name)
        return hook

    def _leave(self, _module: nn.Module, _args: tuple, _out: object) -> None:
        self.stack.pop()

    @property
    def current(self) -> str:
        return self.stack[-1]

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _where(qualified: str) -> str:
    """'layers.0.attention.wq' -> 'attention.wq'; 'layers.0' -> 'block'; 'norm' -> 'norm'."""
    parts = qualified.split(".")
    if parts[0] == "layers":
        rest = ".".join(parts[2:])
        return rest or "block"
    return qualified


class _OutputRecorder(TorchDispatchMode):
    """Records the outputs each selective checkpointing policy keeps (its `KeepRule`, new
    for every block as a checkpointed region's is)."""

    def __init__(self, modules: _ModuleStack):
        super().__init__()
        self.modules = modules
        self.rules = {policy: KeepRule(policy) for policy in KEEPING}
        self.outputs: dict[str, list[tuple[str, torch.Tensor]]] = {p: [] for p in KEEPING}

    def new_region(self, _module: nn.Module, _args: tuple) -> None:
        self.rules = {policy: KeepRule(policy) for policy in KEEPING}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for policy, rule in self.rules.items():
            if rule.keeps(func):
                for t in out if isinstance(out, tuple) else (out,):
                    if isinstance(t, torch.Tensor) and t.is_floating_point():
                        self.outputs[policy].append((self.modules.current, t))
        return out


@dataclass
class Saved:
    where: str
    shape: tuple[int, ...]
    nbytes: int


@contextlib.contextmanager
def _autocast(regime: str) -> Iterator[None]:
    if regime in ("bf16", "bf16_params"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yield
    elif regime == "fp16":
        with torch.autocast("cpu", dtype=torch.float16):
            yield
    else:
        yield


def run_probe(probe: ModelConfig, regime: str, document_mask: bool,
              exchange: ShapeExchange | None = None, lora: LoraConfig | None = None,
              later_block: bool = False
              ) -> tuple[list[Saved], dict[str, list[Saved]], list[Saved]]:
    """(saved tensors, the outputs each of KEEPING keeps, weight casts) of one forward of a
    1-block model plus its loss, each storage once; with `exchange`, of context-parallel
    rank 0 of exchange.size; `lora`, `later_block`: see the module docstring."""
    torch.manual_seed(0)
    model = Transformer(probe)
    if lora is not None:
        probe_adapters(model, lora)
    whole, positions = _T, None
    if exchange is not None:
        whole = _T * exchange.size
        positions = chunk_positions(whole, exchange.size, 0, True).expand(_B, -1)
        model.context_parallel = exchange
        for block in model.layers.values():
            block.attention.sequence = exchange
    model.train()
    if regime == "bf16_params":  # FSDP's gathered parameters are bf16
        model.to(torch.bfloat16)
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    param_shapes = {tuple(p.shape) for p in model.parameters()}
    modules = _ModuleStack(model)
    records: dict[int, Saved] = {}
    casts: dict[int, Saved] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in own or storage.nbytes() == 0:
            return t
        rec = Saved(_where(modules.current), tuple(t.shape), storage.nbytes())
        shape = tuple(t.shape)
        if ((t.dim() == 2 and t.shape[0] != _B * _T
             and (shape in param_shapes or shape[::-1] in param_shapes))
                or (t.dim() == 3 and shape in param_shapes)):  # 3-D: grouped expert weights
            casts.setdefault(ptr, rec)  # a weight's low-precision (or fp32 router) copy
        elif ptr not in records or rec.nbytes > records[ptr].nbytes:
            records[ptr] = rec
        return t

    tokens = torch.randint(0, probe.vocab_size, (_B, _T))
    targets = torch.randint(0, probe.vocab_size, (_B, _T))
    docs = (torch.tensor([[0] * (whole // 2) + [1] * (whole - whole // 2)] * _B)
            if document_mask else None)
    recorder = _OutputRecorder(modules)
    # What the model hands every block besides the hidden state (the document mask and the
    # per-document RoPE table): built once per forward and shared by all blocks, so not a
    # block's own activation (planner/memory.py counts it once per micro-batch).
    shared: set[int] = set()

    def block_inputs(_module: nn.Module, args: tuple) -> None:
        shared.update(a.untyped_storage().data_ptr() for a in args[1:]
                      if isinstance(a, torch.Tensor) and a is not model.rope_freqs)

    hooks = [b.register_forward_pre_hook(block_inputs) for b in model.layers.values()]
    hooks += [b.register_forward_pre_hook(recorder.new_region) for b in model.layers.values()]
    if later_block:
        hooks += [b.register_forward_pre_hook(_needs_gradient) for b in model.layers.values()]
    try:
        with _autocast(regime), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with recorder:
                logits = model(tokens, docs, positions)
            loss = token_loss_sum(logits, targets)
    finally:
        modules.close()
        for hook in hooks:
            hook.remove()
    del loss
    saved = [r for p, r in records.items() if p not in shared]
    if exchange is not None:  # what context parallelism's collectives return
        recorder.outputs["selective"] += [("layers.0.attention", t) for t in exchange.returned]
    kept = {policy: _once_per_storage(outputs) for policy, outputs in recorder.outputs.items()}
    return saved, kept, list(casts.values())


def _once_per_storage(outputs: list[tuple[str, torch.Tensor]]) -> list[Saved]:
    seen: dict[int, Saved] = {}
    for where, t in outputs:
        storage = t.untyped_storage()
        seen.setdefault(storage.data_ptr(), Saved(_where(where), tuple(t.shape), storage.nbytes()))
    return list(seen.values())


def _needs_gradient(_module: nn.Module, args: tuple) -> tuple:
    """A block's input as a later block gets it: one that needs a gradient."""
    return (args[0].detach().requires_grad_(), *args[1:])
