"""Pipeline parallelism: split the model into stages by layer and drive them with one of
`torch.distributed.pipelining`'s schedules.

A stage is the whole model (built on meta) with the blocks of other stages deleted, the
embeddings kept only in the first stage and the final norm + head only in the last. Blocks
live in a ModuleDict keyed by their global index, so parameter names, and therefore
checkpoints, are the same under every split.

Stage placement: with v virtual stages per rank, rank r holds stages r, r + pp, r + 2pp, ...
(the looped placement that interleaved 1F1B and interleaved zero-bubble expect).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from tessel.config import ParallelConfig
from tessel.models.transformer import Transformer
from tessel.parallel.dims import stage_layer_counts

_SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zero-bubble": ScheduleInterleavedZeroBubble,
}


def stage_ids(pp_rank: int, pp: int, virtual: int) -> list[int]:
    """Global stage indices held by pipeline rank `pp_rank` (looped placement)."""
    return [pp_rank + v * pp for v in range(virtual)]


def split_model(model: Transformer, p: ParallelConfig, pp_rank: int) -> list[tuple[int, Transformer]]:
    """(stage index, stage module) for each stage this rank holds. `model` is on meta."""
    n_stages = p.pp * p.pp_virtual_stages
    counts = stage_layer_counts(len(model.layers), n_stages, p.pp_layers_first, p.pp_layers_last)
    bounds = [sum(counts[:i]) for i in range(n_stages + 1)]
    stages = []
    for s in stage_ids(pp_rank, p.pp, p.pp_virtual_stages):
        stage = copy.deepcopy(model)  # cheap: parameters are on meta
        keep = {str(i) for i in range(bounds[s], bounds[s + 1])}
        for name in list(stage.layers.keys()):
            if name not in keep:
                del stage.layers[name]
        if s != 0:
            stage.tok_embeddings = None
            stage.pos_embeddings = None
        if s != n_stages - 1:
            stage.norm = None
            stage.output = None
        stages.append((s, stage))
    return stages


def build_schedule(
    stages: list[tuple[int, torch.nn.Module]],
    p: ParallelConfig,
    pp_mesh: DeviceMesh,
    device: torch.device,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """The schedule that runs this rank's stages. The loss function already divides by the
    step's token count, so gradients must not be scaled again (scale_grads=False)."""
    n_stages = p.pp * p.pp_virtual_stages
    pipeline_stages = [
        PipelineStage(module, s, n_stages, device, group=pp_mesh.get_group())
        for s, module in stages
    ]
    cls = _SCHEDULES[p.pp_schedule]
    if issubclass(cls, PipelineScheduleSingle):
        return cls(pipeline_stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn,
                   scale_grads=False)
    return cls(pipeline_stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
