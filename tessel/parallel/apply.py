"""Build the model for one rank of a layout, in the one fixed order:

    build on meta -> pipeline split -> float8 linears (train.fp8) -> tensor parallel (float8
    styles under tensorwise scaling) -> expert parallel -> context parallel
    (the attention modules' sequence exchange over the cp mesh) -> LoRA adapters
    (lora.enabled; sharded beside their tensor-parallel projections) -> activation
    checkpointing -> compile -> FSDP (ZeRO 1-3; the experts over their own group) ->
    materialise + initialise (`tessel.models.init`, each rank's share placed by
    `tessel.parallel.placement`) -> DDP (zero 0)

Float8 linears come before tensor parallelism, whose float8 styles take Float8Linear
modules (torchtitan too converts before it parallelises). Tensor parallelism comes next
because the later steps must see the DTensor parameters it creates (LoRA adapters come
after it: its plans shard every parameter below a projection, and the adapters' own
placements follow their projection's); activation checkpointing
wraps the block forward that compile then traces; FSDP shards whatever the blocks hold by
then. DDP wraps real tensors, so it comes after initialisation. Weights are initialised per
parameter from its full, unsharded value (`Transformer.initial_value`), so every layout
starts from exactly the single-process weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tessel.config import Config
from tessel.models import lora
from tessel.models.init import InitialBuffer, InitialValue, materialise
from tessel.models.loss import loss_pieces
from tessel.models.transformer import Transformer
from tessel.parallel.async_tp import enable_async_tp
from tessel.parallel.checkpointing import apply_activation_checkpointing
from tessel.parallel.context import ContextParallel, apply_context_parallel
from tessel.parallel.dims import ParallelDims, flat_mesh, resolve_zero
from tessel.parallel.expert import apply_expert_parallel, mesh_experts, moe_layers
from tessel.parallel.fp8 import (
    apply_fp8,
    fp8_all_gather,
    fp8_emulated,
    fp8_recipe,
    scales_over_context,
    tp_styles,
)
from tessel.parallel.fsdp import (
    DataParallel,
    ExpertSharding,
    apply_ddp,
    apply_fsdp,
    data_parallel_kind,
)
from tessel.parallel.pipeline import split_model
from tessel.parallel.placement import MESH
from tessel.parallel.tensor import apply_tensor_parallel, shard_lora


@dataclass
class ParallelModel:
    """This rank's share of the model."""

    parts: list[nn.Module]
    """Modules to run: the whole model, or this rank's pipeline stages (DDP-wrapped for zero 0)."""
    inner: list[Transformer]
    """The same modules unwrapped: parameter names, optimizer groups, checkpoints."""
    stage_ids: list[int] = field(default_factory=lambda: [0])
    dp: DataParallel = field(default_factory=lambda: DataParallel("none", 0))
    has_first: bool = True
    """This rank holds the embeddings (it feeds the token ids)."""
    has_last: bool = True
    """This rank holds the head (it computes the loss)."""
    context: ContextParallel | None = None
    """Context parallelism: shards each batch's sequences for this rank; None without."""

    def parameters(self) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for m in self.inner:
            for p in m.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def train(self, mode: bool = True) -> None:
        for m in self.parts:
            m.train(mode)


def build_parallel_model(
    cfg: Config, dims: ParallelDims, mesh: DeviceMesh | None, device: torch.device,
    param_dtype: torch.dtype | None, initial: InitialValue | None = None,
    initial_buffer: InitialBuffer | None = None,
) -> ParallelModel:
    """This rank's share of the model, initialised from `initial` (full tensor by name and
    shape; e.g. weights of model.init_from) or else from the seeded random initialisation;
    its persistent buffers from `initial_buffer` where that has them."""
    p = cfg.parallel
    with torch.device("meta"):
        whole = Transformer(cfg.model)
    if dims.pp > 1:
        assert mesh is not None
        stages = split_model(whole, p, mesh["pp"].get_local_rank())
    else:
        stages = [(0, whole)]
    n_stages = dims.pp * p.pp_virtual_stages
    zero = resolve_zero(p)
    kind = data_parallel_kind(zero, dims.dp * dims.cp, dims.tp, dims.pp)
    ep_mesh = experts_fsdp_mesh = None
    context = None
    if dims.ep > 1:
        assert mesh is not None
        ep_mesh, experts_fsdp_mesh = dims.expert_meshes(mesh)
    recipe = fp8_recipe(cfg)
    for _, stage in stages:
        if recipe is not None:  # before tensor parallelism: its float8 styles need them
            apply_fp8(stage, cfg, fp8_emulated(cfg, device),
                      fp8_all_gather(cfg, kind, dims.tp), dims.tp)
        if dims.tp > 1:
            assert mesh is not None
            apply_tensor_parallel(stage, mesh["tp"], p.sequence_parallel,
                                  replicate_experts=ep_mesh is None,
                                  styles=tp_styles(cfg, device))
            enable_async_tp(p, mesh["tp"])  # parallel.async_tp: before the blocks compile
        if ep_mesh is not None:
            apply_expert_parallel(stage, ep_mesh)
        if dims.cp > 1:
            assert mesh is not None
            context = apply_context_parallel(stage, mesh["cp"], p.cp_mode, p.cp_load_balance)
            _split_moe_tokens(stage, mesh, dims)
            scales_over_context(stage, mesh["cp"], recipe, dims.tp)  # train.fp8's
        if cfg.lora.enabled:
            apply_lora(cfg, stage, mesh["tp"] if dims.tp > 1 and mesh is not None else None,
                       p.sequence_parallel)
        apply_activation_checkpointing(stage, p.activation_checkpointing,
                                       p.activation_checkpointing_every)
        # this rank's logits per micro-batch: its tokens (1/cp; both rows of a DPO pair) x
        # its vocabulary (1/tp)
        stage.loss_chunks = loss_pieces(
            p.loss_chunks, cfg.train.rows_per_micro_batch * cfg.train.seq_len / dims.cp,
            cfg.model.padded_vocab_size / dims.tp)
        if cfg.train.compile:
            # Regional compilation: one graph per block keeps start-up short and the
            # parameter names (and so the checkpoints) unchanged.
            for block in stage.layers.values():
                block.compile()
        if kind in ("fsdp", "replicate"):
            assert mesh is not None
            # replicate: dp_shard is 1 (ParallelDims), so this is a (replicas, 1) mesh, the
            # replicas being dp_replicate x cp (context-parallel ranks hold the same weights).
            shard_mesh = (dims.replicate_mesh(mesh) if kind == "replicate"
                          else dims.hsdp(mesh, flat_mesh(mesh, "dp_shard_cp")))
            experts = None
            if experts_fsdp_mesh is not None:
                experts = ExpertSharding(experts_fsdp_mesh, dims.dp * dims.cp)
            apply_fsdp(stage, shard_mesh, max(zero, 1), param_dtype, p.offload == "params",
                       experts)
    for _, stage in stages:
        materialise(stage, device, cfg.train.seed, initial, initial_buffer, MESH)
    inner = [stage for _, stage in stages]
    parts: list[nn.Module] = list(inner)
    if kind == "ddp":
        assert mesh is not None
        parts = [apply_ddp(m, flat_mesh(mesh, "dp_cp"), p.dp_comm_hook) for m in inner]
    ids = [s for s, _ in stages]
    return ParallelModel(
        parts=parts, inner=inner, stage_ids=ids, dp=DataParallel(kind, zero),
        has_first=0 in ids, has_last=n_stages - 1 in ids, context=context,
    )


def _split_moe_tokens(stage: Transformer, mesh: DeviceMesh, dims: ParallelDims) -> None:
    """Under context parallelism a rank's MoE layers see its part of the sequence (and
    under tensor + sequence parallelism a tp rank's part of that): their balance statistics
    sum over the cp x tp ranks that share the micro-batch's tokens."""
    group = mesh["cp", "tp"]._flatten("cp_tp") if dims.tp > 1 else mesh["cp"]
    for moe in moe_layers(stage):
        exchange = mesh_experts(moe)
        exchange.token_group, exchange.token_shards = group.get_group(), dims.cp * dims.tp


def apply_lora(cfg: Config, stage: Transformer, tp_mesh: DeviceMesh | None,
               sequence_parallel: bool) -> None:
    """LoRA adapters on the stage's target projections (the rest frozen), placed like their
    projections under tensor parallelism, and the base held in lora.base_dtype."""
    c = cfg.lora
    lora.add_lora(stage, c.targets, c.rank, c.alpha, c.dropout)
    if tp_mesh is not None:
        shard_lora(stage, tp_mesh, sequence_parallel)
    if c.base_dtype == "bfloat16":
        lora.cast_base(stage, torch.bfloat16)
