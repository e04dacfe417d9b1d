"""Tensor parallelism (Megatron-style) with optional sequence parallelism, via DTensor.

Per block: wq/wk/wv and w1/w3 are split by output columns (each rank holds n_heads/tp query
heads, n_kv_heads/tp key/value heads, ffn_hidden/tp hidden units); wo and w2 by input rows,
so each block needs one all-reduce in forward and one in backward per sub-layer. Per-head
QK-norm weights (model.qk_norm) are replicated, their gradients summed over tp; projection-wide
ones (OLMo 2) are split like the projection's columns (`ColumnShardedNorm`). The
embedding is split by vocabulary rows (vocab-parallel), the output projection by vocabulary
columns (tp divides model.padded_vocab_size; the -inf mask of the padding ids is sharded the
same way), and the loss is computed on vocabulary-sharded logits (`loss_parallel`) without
gathering them.

With sequence parallelism the residual stream between sub-layers is sharded along the
sequence: norms and dropout run on T/tp positions, and each all-reduce becomes a
reduce-scatter + all-gather pair of the same volume.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from tessel.models.moe import MoE
from tessel.models.transformer import Transformer
from tessel.parallel.expert import mesh_experts
from tessel.parallel.fp8 import TPStyles


def apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool,
                          replicate_experts: bool = True, styles: TPStyles | None = None) -> None:
    """Shard `model` (a whole model or a pipeline stage of one) over `tp_mesh` in place.

    MoE layers (which need sequence parallelism) are not split: each rank runs its own part
    of the sequence through them, like a data-parallel rank; their router and shared experts,
    and the routed experts unless expert parallelism will shard them (`replicate_experts`
    False), are replicated over `tp_mesh` with partial gradients (see `replicate_moe`).
    `styles`: the blocks' projection styles (train.fp8's float8 ones; PyTorch's by default)."""
    sp = sequence_parallel
    styles = styles or TPStyles()
    seq = Shard(1) if sp else Replicate()  # layout of the residual stream between sub-layers
    plan: dict = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
        if model.pos_embeddings is not None and sp:
            # Position embeddings (T, C), or (B, T, C) when positions restart at each
            # document, are small and stay replicated; under SP each rank keeps the rows of
            # its own part of the sequence (dim -2: a local slice, no communication).
            plan["pos_embeddings"] = PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(-2),
                use_local_output=True,
            )
    if model.output is not None:
        if sp:
            plan["norm"] = SequenceParallel()
        # Logits stay sharded over the vocabulary (a DTensor) for the vocab-parallel loss.
        plan["output"] = ColwiseParallel(
            input_layouts=seq, output_layouts=Shard(-1), use_local_output=False
        )
    parallelize_module(model, tp_mesh, plan)
    if model.output is not None and sp:
        # The head's input gathered once, before the loss may split it into pieces
        # (parallel.loss_chunks): each piece is then a slice of the whole sequence. The same
        # all-gather the output projection's column-parallel input would make.
        model.norm.register_forward_hook(_gather_sequence)
    if model.output is not None and model.vocab_mask is not None:
        # The -inf of the vocabulary's padding ids, sharded like the logits (Shard(-1)); on
        # meta here, filled per rank by Transformer.init_buffers after materialisation.
        model.vocab_mask = distribute_tensor(model.vocab_mask, tp_mesh, [Shard(0)])

    for block in model.layers.values():
        if isinstance(block.feed_forward, MoE):
            replicate_moe(block.feed_forward, tp_mesh, replicate_experts)
            block_plan = _attention_plan(block, sp, styles)
            # The MoE layer takes this rank's part of the sequence as a plain tensor.
            block_plan["feed_forward"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                use_local_output=True)
            parallelize_module(block, tp_mesh, block_plan)
            continue
        block_plan = _attention_plan(block, sp, styles)
        ff = block.feed_forward
        block_plan.update({
            "feed_forward.w1": styles.colwise(ff.w1),
            "feed_forward.w2": styles.rowwise(ff.w2, output_layouts=seq),
        })
        if ff.w3 is not None:
            block_plan["feed_forward.w3"] = styles.colwise(ff.w3)
        if sp:
            # Gather the sequence before the MLP.
            block_plan["feed_forward"] = styles.prepare_input(
                [ff.w1, ff.w3], input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        parallelize_module(block, tp_mesh, block_plan)
    # parallelize_module replaced the embedding and the output weight separately: tie again.
    model.tie_weights()


def _gather_sequence(_module: torch.nn.Module, _args: tuple, out: DTensor) -> DTensor:
    """A sequence-sharded DTensor made whole on every tensor-parallel rank."""
    return out.redistribute(out.device_mesh, [Replicate()] * out.device_mesh.ndim)


def _attention_plan(block: torch.nn.Module, sp: bool, styles: TPStyles) -> dict:
    """A block's attention and norms (the MLP's plan is the caller's)."""
    seq = Shard(1) if sp else Replicate()
    att = block.attention
    plan: dict = {
        "attention.wq": styles.colwise(att.wq),
        "attention.wk": styles.colwise(att.wk),
        "attention.wv": styles.colwise(att.wv),
        "attention.wo": styles.rowwise(att.wo, output_layouts=seq),
    }
    if block.attention.q_norm is not None and block.attention.per_head_norm:
        # QK-norm runs on each rank's own heads (B, T, H/tp, hd): its weight is replicated
        # and its gradient, partial per rank, summed over tp. SequenceParallel does both
        # for a module whose input is sharded along `sequence_dim` (here the heads).
        for norm in ("attention.q_norm", "attention.k_norm"):
            plan[norm] = SequenceParallel(sequence_dim=2, use_local_output=True)
    elif block.attention.q_norm is not None:
        # Over the whole projection (OLMo 2): its weight split like the projection's
        # columns, its mean square summed over the ranks' heads.
        for norm in ("attention.q_norm", "attention.k_norm"):
            plan[norm] = ColumnShardedNorm()
    if sp:
        # Norms on the residual stream run on this rank's positions: before the sub-layers,
        # after them (model.norm_placement), or both. A norm after a sub-layer hands its
        # output to the residual add, which holds this rank's positions as a plain tensor.
        plan.update({name: SequenceParallel(use_local_output=name.startswith("post_"))
                     for name in SEQUENCE_NORMS if getattr(block, name) is not None})
        plan.update({
            # Gather the sequence before attention (x, freqs, mask, sharded).
            "attention": styles.prepare_input(
                [att.wq, att.wk, att.wv], input_layouts=(Shard(1), None, None, None),
                desired_input_layouts=(Replicate(), None, None, None),
            ),
        })
    return plan


SEQUENCE_NORMS = ("attention_norm", "post_attention_norm", "ffn_norm", "post_ffn_norm")
"""A block's norms on the residual stream (those its model.norm_placement gives it)."""


class ColumnShardedNorm(ParallelStyle):
    """A norm over a last dimension that a column-parallel projection split over the tp
    ranks (`tessel.models.attention.ProjectionNorm`): its weight Shard(0), its input this
    rank's columns as a Shard(-1) DTensor, so the norm's sum of squares over the last
    dimension becomes one all-reduce of a value per token; its output this rank's columns
    again, as a plain tensor."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard(_name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for key, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

        def columns(_mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            (x,) = inputs
            return (DTensor.from_local(x, mesh, [Shard(x.dim() - 1)], run_check=False),)

        def local(_mod: nn.Module, out: DTensor, _mesh: DeviceMesh) -> torch.Tensor:
            return out.to_local()

        return distribute_module(module, device_mesh, shard, columns, local)


def replicate_moe(moe: MoE, tp_mesh: DeviceMesh, experts: bool) -> None:
    """The MoE layer's parameters as Replicate DTensors on `tp_mesh` (on the meta device: no
    communication). Each rank computes with its local copy on its own tokens, so its
    gradient is one part of a sum: the layer's `MeshExperts` takes them with partial
    gradients, which FSDP (or clip_grad_norm) sums over the tp ranks, and sums the balance
    statistics over the tp ranks, which share the micro-batch's tokens."""
    modules = [moe.router, *([moe.shared] if moe.shared is not None else []),
               *([moe.experts] if experts else [])]
    for module in (sub for m in modules for sub in m.modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(
                distribute_tensor(param, tp_mesh, [Replicate()], src_data_rank=None)))
    exchange = mesh_experts(moe)
    exchange.token_group, exchange.token_shards = tp_mesh.get_group(), tp_mesh.size()


@contextlib.contextmanager
def loss_context(enabled: bool) -> Iterator[None]:
    """Where the loss is computed and differentiated on vocabulary-sharded logits."""
    with loss_parallel() if enabled else contextlib.nullcontext():
        yield


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (the vocab-parallel loss) as a plain tensor; others unchanged."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_lora(model: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Place the LoRA adapters (`tessel.models.lora`) of the tensor-parallel projections
    of `model` (on meta, after `apply_tensor_parallel`), so each rank computes its share of
    the adapter's term with the projection's own input and output layouts:

    - column-parallel projection (weight Shard(0): wq/wk/wv, w1/w3): A replicated, B split
      by output rows like the weight; the term comes out split by columns like the
      projection's output. A's gradient is partial per rank (its output gradient is split),
      summed where the replicated gradients of QK-norm are (FSDP, or clip_grad_norm).
    - row-parallel projection (weight Shard(1): wo, w2): A split by input columns like the
      weight, B replicated; A x is partial per rank and is all-reduced at rank r (small)
      before B, and the term is then laid out as the projection's output (replicated, or
      split along the sequence under sequence parallelism: a local slice).

    Parity with the single-process model is checked in tests/distributed/test_layouts.py."""
    from tessel.models.lora import adapted_modules

    out_layout = Shard(1) if sequence_parallel else Replicate()
    for linear in adapted_modules(model).values():
        weight = linear.weight
        if not isinstance(weight, DTensor):
            continue  # not split (e.g. an MoE layer's replicated shared expert): nothing to do
        column = weight.placements[0] == Shard(0)
        placements = ([Replicate()], [Shard(0)]) if column else ([Shard(1)], [Replicate()])
        for child, placement in zip((linear.lora_A, linear.lora_B), placements):
            child.weight = torch.nn.Parameter(
                distribute_tensor(child.weight, tp_mesh, placement, src_data_rank=None),
                requires_grad=child.weight.requires_grad)
        adapter = linear.lora_adapter
        if column:
            adapter.after = lambda y: y.to_local()
        else:
            adapter.between = lambda h: h.redistribute(placements=[Replicate()])
            adapter.after = lambda y, _o=out_layout: y.redistribute(placements=[_o]).to_local()
