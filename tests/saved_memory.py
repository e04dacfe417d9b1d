"""Measure what autograd really keeps for backward, for checking the planner.

`SavedTensorMeter` installs saved-tensor hooks: every tensor autograd saves is counted once
per storage while any graph node still holds it, so `peak` is the most bytes held for
backward at any moment (under a pipeline schedule: with several micro-batches in flight).
Selective activation checkpointing keeps its tensors in its own cache, not through the
hooks: `meter_selective_checkpointing()` (call before the model is built) counts those too,
from the moment they are cached until their block's backward consumes them.
Parameters and buffers (which exist anyway) are not counted: a parameter is a leaf that requires
grad or an `nn.Parameter` (a frozen one: LoRA's base), or a view of one (FSDP's unsharded
parameters included); buffers are known by their storage.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten

_ACTIVE: list[SavedTensorMeter] = []  # the meter measuring now, if any


class _Held:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class SavedTensorMeter:
    def __init__(self, owned: set[int] | None = None,
                 modules: list[torch.nn.Module] | None = None):
        self.owned = owned or set()  # storages of buffers and anything else not to count
        # Whose parameters' *current* storages are weights too: FSDP2 swaps in unsharded
        # parameters for forward, and a DTensor weight's `to_local()` (expert parallelism,
        # replicated MoE weights under tp) is a non-leaf view of that storage, not an
        # activation.
        self.modules = modules or []
        self.live: dict[int, list[int]] = {}  # storage -> [holders, bytes]
        self.current = 0
        self.peak = 0

    @classmethod
    def for_modules(cls, modules: list[torch.nn.Module]) -> SavedTensorMeter:
        owned = set()
        for m in modules:
            for t in [*m.parameters(), *m.buffers()]:
                local = t.to_local() if isinstance(t, DTensor) else t
                owned.add(local.untyped_storage().data_ptr())
        return cls(owned, modules)

    def _weight_storages(self) -> set[int]:
        out = set()
        for m in self.modules:
            for p in m.parameters():
                local = p._local_tensor if isinstance(p, DTensor) else p
                if local.device.type != "meta":
                    out.add(local.untyped_storage().data_ptr())
        return out

    def _pack(self, t: torch.Tensor) -> object:
        base = t._base if t._base is not None else t
        # A parameter or a view of one (weight.t()); frozen ones (LoRA's base) too: FSDP's
        # unsharded parameters are Parameters that require no grad there, and their
        # storage, gathered anew, is no activation (counted with the parameters).
        if base.is_leaf and (base.requires_grad or isinstance(base, torch.nn.Parameter)):
            return t
        local = t.to_local() if isinstance(t, DTensor) else t
        # A collective's result still in flight (AsyncCollectiveTensor) wraps the real one.
        local = getattr(local, "elem", local)
        ptr = None if local.device.type == "meta" else self._hold(local)
        if ptr is None:
            return t
        held = _Held(t)
        weakref.finalize(held, self._release, ptr)
        return held

    def _hold(self, local: torch.Tensor) -> int | None:
        storage = local.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if ptr in self.owned or nbytes == 0:
            return None
        if not local.is_leaf and ptr not in self.live and ptr in self._weight_storages():
            return None
        entry = self.live.setdefault(ptr, [0, nbytes])
        if entry[0] == 0:
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        return ptr

    def _cache_tensors(self, value: object) -> list[torch.Tensor]:
        leaves, _ = tree_flatten(value)
        out = []
        for leaf in leaves:
            t = getattr(leaf, "val", None)  # checkpoint's _VersionWrapper
            if isinstance(t, torch.Tensor):
                out.append(t.to_local() if isinstance(t, DTensor) else t)
        return out

    def _release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[ptr]

    @staticmethod
    def _unpack(held: object) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held  # type: ignore[return-value]

    @contextlib.contextmanager
    def measuring(self) -> Iterator[SavedTensorMeter]:
        _ACTIVE.append(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            _ACTIVE.remove(self)


class _MeteredEntries(dict):
    """One operator's entries of a selective-checkpointing cache, counted while they hold
    tensors (the backward replaces each with a 'consumed' marker)."""

    def __init__(self, meter: SavedTensorMeter):
        super().__init__()
        self.meter = meter
        self.held: dict[int, list[int]] = {}
        # Entries the recomputation never asks for die with the checkpoint's frame.
        weakref.finalize(self, _release_all, meter, self.held)

    def __setitem__(self, idx: int, value: object) -> None:
        for ptr in self.held.pop(idx, []):
            self.meter._release(ptr)
        super().__setitem__(idx, value)
        ptrs = [self.meter._hold(t) for t in self.meter._cache_tensors(value)]
        self.held[idx] = [p for p in ptrs if p is not None]


def _release_all(meter: SavedTensorMeter, held: dict[int, list[int]]) -> None:
    for ptrs in held.values():
        for ptr in ptrs:
            meter._release(ptr)
    held.clear()


def metered_contexts(real):  # noqa: ANN001, ANN201
    """`torch.utils.checkpoint.create_selective_checkpoint_contexts`, reporting its cache to
    the active meter."""

    def contexts(policy, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        caching, cached = real(policy, *args, **kwargs)
        if _ACTIVE:
            meter = _ACTIVE[-1]
            storage: defaultdict = defaultdict(lambda: _MeteredEntries(meter))
            caching.storage = cached.storage = storage
        return caching, cached

    contexts.metered = True  # type: ignore[attr-defined]
    return contexts


def meter_selective_checkpointing() -> None:
    """Make tessel's selective checkpointing report its cache to the active meter, for the
    rest of the process: patches the function `tessel.parallel.checkpointing` builds its
    checkpoint contexts with, so call it before any model is built (tests use monkeypatch
    instead)."""
    import tessel.parallel.checkpointing as apply

    if not getattr(apply.create_selective_checkpoint_contexts, "metered", False):
        apply.create_selective_checkpoint_contexts = metered_contexts(
            apply.create_selective_checkpoint_contexts)
