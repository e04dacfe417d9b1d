"""Where a rank holds its share of a model the parallel layer placed on the mesh: the
`tessel.models.init.Placement` that `materialise` takes for it.

A DTensor parameter or buffer (tensor, expert parallelism; FSDP's shards) gets its slice of
the full value with no communication (every rank holds the whole value: src_data_rank=None,
then a redistribution that only slices). FSDP2's CPU offload keeps the sharded parameters in
host memory (it requires them there at its first use); buffers still live on the compute
device.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor


class MeshPlacement:
    """`tessel.models.init.Placement` for DTensors and FSDP2 (plain tensors: whole)."""

    def params_device(self, model: nn.Module, device: torch.device) -> torch.device:
        return torch.device("cpu") if fsdp_offloaded(model) else device

    def fill(self, tensor: torch.Tensor, full: torch.Tensor) -> None:
        if not isinstance(tensor, DTensor):
            tensor.copy_(full)
            return
        # Replicate -> the tensor's placements is a local slice: no communication.
        mesh = tensor.device_mesh
        src = distribute_tensor(full.to(tensor.to_local().device), mesh,
                                [Replicate()] * mesh.ndim, src_data_rank=None)
        tensor.copy_(src.redistribute(mesh, tensor.placements))


MESH = MeshPlacement()


def fsdp_offloaded(model: nn.Module) -> bool:
    """Whether FSDP2 keeps `model`'s sharded parameters in host memory (CPU offload)."""
    state = getattr(model, "_get_fsdp_state", None)
    if state is None:
        return False
    from torch.distributed.fsdp import CPUOffloadPolicy

    group = state()._fsdp_param_group
    return group is not None and isinstance(group.offload_policy, CPUOffloadPolicy)
