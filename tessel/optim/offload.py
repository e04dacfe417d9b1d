"""AdamW with its state and its update in host memory (`parallel.offload = "optimizer"`,
DeepSpeed's ZeRO-Offload for the optimizer).

The parameters and gradients stay on the device (sharded by FSDP, split by TP, whatever the
layout made them). Adam's two moments, 8 bytes per parameter, live in host memory: under
ZeRO-1/2/3 that is each rank's shard of them. A step copies each local gradient and
parameter shard to pinned host buffers, runs PyTorch's own AdamW kernel (the functional
`torch.optim.adamw.adamw`, multi-tensor) there, and copies the parameters back.

For checkpoints the optimizer looks like any other: its param_groups hold the model's
parameters and its state is keyed by them, with moments that are DTensors of the same mesh
and placements as their parameter (their local tensors in host memory), so DCP saves and
reshards them like AdamW's. On a CPU device nothing moves, and the update is bit-for-bit
AdamW's (the tests rely on that).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def placed_like(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The gradient with its parameter's placements: tensor parallelism can leave a
    gradient replicated where its parameter is sharded (AdamW over DTensors redistributes
    implicitly; the local shards used here must match)."""
    if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
        return grad.redistribute(param.device_mesh, param.placements)
    return grad


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as a tensor shaped and placed like `param` (a DTensor when it is one)."""
    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return local


class HostAdamW(torch.optim.AdamW):
    """torch.optim.AdamW (same hyperparameters, same state and checkpoint format, so runs
    move freely between offloaded and not) with `step` done in host memory."""

    def __init__(self, params: Iterable[Any], lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float = 0.0):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         foreach=True)
        # Pinned memory makes the device<->host copies asynchronous DMA transfers.
        self._pin = torch.cuda.is_available()
        self._staging: dict[tuple[int, str], torch.Tensor] = {}

    def _host_zeros(self, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros(like.shape, dtype=torch.float32, device="cpu", pin_memory=self._pin)

    def _to_host(self, t: torch.Tensor, key: tuple[int, str]) -> torch.Tensor:
        """`t` itself when it already is in host memory, else a pinned copy (issued
        asynchronously; `step` synchronises before reading it)."""
        if t.device.type == "cpu":
            return t
        buf = self._staging.get(key)
        if buf is None:
            buf = self._staging[key] = torch.empty(t.shape, dtype=t.dtype, device="cpu",
                                                   pin_memory=self._pin)
        return buf.copy_(t, non_blocking=True)

    def _init_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        state = self.state[p]
        if not state:
            local = _local(p)
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = _like(p, self._host_zeros(local))
            state["exp_avg_sq"] = _like(p, self._host_zeros(local))
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, host_params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._init_state(p)
                params.append(p)
                host_params.append(self._to_host(_local(p), (id(p), "param")))
                grads.append(self._to_host(_local(placed_like(p.grad, p)), (id(p), "grad")))
                exp_avgs.append(_local(state["exp_avg"]))
                exp_avg_sqs.append(_local(state["exp_avg_sq"]))
                steps.append(state["step"])
            if not params:
                continue
            devices = {_local(p).device for p in params if _local(p).device.type == "cuda"}
            for device in devices:  # the copies to host have landed
                torch.cuda.current_stream(device).synchronize()
            beta1, beta2 = group["betas"]
            adamw(host_params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=True,
                  amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                  weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
            for p, host in zip(params, host_params):
                local = _local(p)
                if local.data_ptr() != host.data_ptr():
                    local.copy_(host, non_blocking=True)
        return loss

    @staticmethod
    def _process_value_according_to_param_policy(
        param: torch.Tensor, value: torch.Tensor, param_id: int,
        param_groups: list[dict[Any, Any]], key: Hashable = None,
    ) -> torch.Tensor:
        """On load, torch.optim moves each state value to its parameter's device; keep the
        moments in host memory instead (loading must not need the device memory that
        offloading saves)."""
        if key == "step" or not torch.is_floating_point(value):
            return value
        local = _local(value).to(device="cpu", dtype=torch.float32)
        if torch.cuda.is_available() and not local.is_pinned():
            local = local.pin_memory()
        return _like(value, local) if isinstance(value, DTensor) else local
