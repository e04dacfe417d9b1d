"""Pipeline parallelism: split the model into stages by layer and drive them with one of
`torch.distributed.pipelining`'s schedules.

A stage is the whole model (built on meta) with the blocks of other stages deleted, the
embeddings kept only in the first stage and the final norm + head only in the last. Blocks
live in a ModuleDict keyed by their global index, so parameter names, and therefore
checkpoints, are the same under every split.

Tied embeddings (Megatron's scheme): the last stage keeps its own copy of the token embedding
as the output projection's weight, under the same name; it starts from the same values, the
two gradients are summed over the embedding group (the first and last pipeline ranks of each
data/tensor-parallel coordinate) before the optimizer step (`EmbeddingSync`), so both copies
take the same steps and stay identical. A checkpoint holds the one tensor.

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
            stage.embeds = False
            stage.pos_embeddings = None
            if not (model.cfg.tie_embeddings and s == n_stages - 1):
                stage.tok_embeddings = None
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


class EmbeddingSync:
    """Sums the gradient of a tied embedding over its two copies (first and last pipeline
    stage) after the backward pass, as Megatron's embedding group does; a no-op on ranks
    that hold neither or when the embeddings are not tied."""

    def __init__(self, stages: list[tuple[int, torch.nn.Module]], mesh: DeviceMesh | None,
                 pp: int, tied: bool):
        self.param: torch.nn.Parameter | None = None
        self.group = None
        self.is_copy = False
        """This rank holds the last stage's copy (left out of the gradient norm: the
        tensor is counted once, on the first stage)."""
        if not tied or pp == 1 or mesh is None:
            return
        holders = [m for _, m in stages if getattr(m, "tok_embeddings", None) is not None]
        if not holders:
            return
        self.param = holders[0].tok_embeddings.weight
        self.is_copy = all(s != 0 for s, _ in stages)
        if pp == 2:
            self.group = mesh["pp"].get_group()  # exactly the first and last stage's ranks
            return
        # The first and the last pipeline rank of this rank's (dp, cp, tp) coordinate; only
        # the two members create their group (use_local_synchronization).
        pp_ranks = mesh["pp"].mesh.tolist()
        self.group = torch.distributed.new_group([pp_ranks[0], pp_ranks[-1]],
                                                 use_local_synchronization=True)

    def __call__(self) -> None:
        if self.param is None or self.param.grad is None:
            return
        from torch.distributed.tensor import DTensor

        g = self.param.grad
        if isinstance(g, DTensor) and g.placements != self.param.placements:
            # The vocab-parallel embedding's backward may leave a replicated gradient:
            # lay it out like the parameter (a local slice) so both copies line up.
            g = self.param.grad = g.redistribute(self.param.device_mesh, self.param.placements)
        torch.distributed.all_reduce(g.to_local() if isinstance(g, DTensor) else g,
                                     group=self.group)
