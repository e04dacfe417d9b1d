"""ParallelDims: the degrees of one run, checked against the world, the model and the batch,
and the one DeviceMesh every parallel mechanism takes its sub-meshes from.

Mesh dimensions, outermost first: pp, dp_replicate, dp_shard, cp, tp. Tensor parallelism is
innermost so that its frequent collectives stay between neighbouring ranks (one node);
pipeline parallelism is outermost because it only sends point-to-point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tessel.config import Config, ModelConfig, ParallelConfig, TrainConfig
from tessel.errors import TesselError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
FLAT_DIMS = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "dp_replicate_cp": ("dp_replicate", "cp"),
}
"""The flattened groups of build_mesh, by name."""


class ParallelError(TesselError):
    """A layout that cannot run; the message says which degree to change."""


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    ep: int = 1
    """Expert-parallel degree: borrowed from the dp_shard x cp x tp ranks (adds no processes)."""

    @classmethod
    def from_config(cls, p: ParallelConfig, world_size: int) -> ParallelDims:
        """Resolve dp_shard = -1 and check that the degrees multiply to the world size."""
        others = p.dp_replicate * p.cp * p.tp * p.pp
        dp_shard = p.dp_shard
        if dp_shard == -1:
            if world_size % others:
                raise ParallelError(
                    f"dp_replicate*cp*tp*pp = {others} does not divide the {world_size} "
                    f"processes started; start a multiple of {others} processes or change the "
                    "degrees"
                )
            dp_shard = world_size // others
        product = others * dp_shard
        replicate = p.dp_replicate
        if resolve_zero(p) == 0:
            # Nothing is sharded: every data-parallel rank is a replica.
            replicate, dp_shard = replicate * dp_shard, 1
        if product != world_size:
            raise ParallelError(
                f"tp*pp*dp*cp = {product} but {world_size} process"
                f"{'es were' if world_size != 1 else ' was'} started (tp={p.tp}, pp={p.pp}, "
                f"dp_replicate={p.dp_replicate}, dp_shard={dp_shard}, cp={p.cp}); start "
                f"{product} (tessel train --nproc {product}) or set parallel.dp_shard=-1"
            )
        return cls(replicate, dp_shard, p.cp, p.tp, p.pp, world_size, p.ep)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches one step sees."""
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def efsdp(self) -> int:
        """The experts' own shard group: the dp_shard x cp x tp ranks that hold the same experts
        (MoE layers run on each tensor-parallel rank's part of the sequence, so for them the
        tp ranks are data-parallel ranks too)."""
        return self.dp_shard * self.cp * self.tp // self.ep

    def describe(self) -> str:
        return (f"dp={self.dp} (replicate {self.dp_replicate} x shard {self.dp_shard}), "
                f"tp={self.tp}, pp={self.pp}, cp={self.cp}"
                + (f", ep={self.ep}" if self.ep > 1 else ""))

    def validate(self, cfg: Config) -> None:
        """Every check that needs only the config: divisibility of the model and the batch."""
        _check_model(self, cfg.model, cfg.parallel)
        _check_batch(self, cfg.train, cfg.parallel)
        p = cfg.parallel
        zero = resolve_zero(p)
        _check_experts(self, cfg.model, zero)
        _check_context(cfg)
        if cfg.model.moe_experts and self.tp > 1 and not p.sequence_parallel:
            raise ParallelError(
                "under tensor parallelism MoE layers run on each rank's part of the sequence; "
                "set parallel.sequence_parallel=true"
            )
        if p.dp_comm_hook != "none" and self.dp > 1 and (self.tp > 1 or self.pp > 1):
            raise ParallelError(
                f"parallel.dp_comm_hook={p.dp_comm_hook!r} compresses DDP's all-reduce, which "
                "wraps whole models only; with tp or pp > 1 set parallel.dp_comm_hook='none'"
            )

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The one mesh of the run, with the flattened groups the mechanisms need:
        `dp` (all data-parallel ranks: the loader and DDP), `dp_shard_cp` (FSDP's shard
        group: context-parallel ranks hold the same parameters) and `dp_cp` (gradient
        all-reduce and loss averaging)."""
        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIMS)
        for name in FLAT_DIMS:
            if name != "dp_replicate_cp" or self.cp > 1:  # only where it is used: a new group
                flat_mesh(mesh, name)
        return mesh

    def expert_meshes(self, mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh]:
        """(ep, the experts' FSDP mesh): the dp_shard x cp x tp ranks of `mesh` split into
        (efsdp, ep), ep innermost, so an ep group is ep neighbouring ranks (tp first); the
        efsdp ranks hold the same experts and shard them as ZeRO says, replicated over
        dp_replicate (HSDP: a (dp_replicate, efsdp) mesh). Call once per mesh: it creates
        the groups."""
        region = mesh["dp_shard", "cp", "tp"]._flatten("dp_shard_cp_tp")
        sparse = region._unflatten(0, (self.efsdp, self.ep), ("efsdp", "ep"))
        return sparse["ep"], self.hsdp(mesh, sparse["efsdp"])

    def hsdp(self, mesh: DeviceMesh, shard: DeviceMesh) -> DeviceMesh:
        """FSDP's mesh for the shard group `shard`: with dp_replicate > 1 the 2-D
        (dp_replicate, shard) mesh of HSDP."""
        if self.dp_replicate == 1:
            return shard
        return DeviceMesh._concatenate([mesh["dp_replicate"], shard])


    def replicate_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """FSDP's mesh for replicated data parallelism beside tp/pp (zero 0, dp_shard 1):
        (replicas, 1), the replicas being dp_replicate x cp (context-parallel ranks hold the
        same weights and sum their gradients)."""
        if self.cp == 1:
            return self.hsdp(mesh, flat_mesh(mesh, "dp_shard_cp"))
        replicas = flat_mesh(mesh, "dp_replicate_cp")
        return DeviceMesh._concatenate([replicas, mesh["dp_shard"]])


def flat_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """The flattened group `name` of FLAT_DIMS. torch deprecates slicing flattened dims out
    of the root mesh; `_flatten` of the same dims returns the one mesh it created first."""
    return mesh[FLAT_DIMS[name]]._flatten(name)


def resolve_zero(p: ParallelConfig) -> int:
    """The ZeRO stage parallel.zero names; `auto`: 0 (replicated: DDP's all-reduce, no
    gathers) for pure data parallelism, 1 (Megatron's distributed optimizer: the same traffic,
    optimizer state sharded) beside tp, pp, cp or ep or when dp_shard > 1 is asked for, 3 for
    offload='params' (FSDP2's CPU offload)."""
    if p.zero != "auto":
        return p.zero
    if p.offload == "params":
        return 3
    if p.dp_comm_hook != "none":
        return 0
    return 1 if p.tp > 1 or p.pp > 1 or p.cp > 1 or p.ep > 1 or p.dp_shard > 1 else 0


def resolved(cfg: Config) -> tuple[Config, str | None]:
    """`cfg` with parallel.zero an int, and a one-line note for the old reading of dp_shard
    (zero = 0 with dp_shard > 1 was DDP over dp_shard replicas; nothing is sharded)."""
    p = cfg.parallel
    note = None
    if p.zero == 0 and p.dp_shard > 1:
        note = (f"tessel: note: parallel.dp_shard={p.dp_shard} with parallel.zero=0 shards "
                f"nothing; read as parallel.dp_replicate={p.dp_replicate * p.dp_shard} "
                "(replicas); write that, or set parallel.zero >= 1 to shard")
    if p.zero == "auto":
        cfg = cfg.model_copy(update={"parallel": p.model_copy(update={"zero": resolve_zero(p)})})
    return cfg, note


def stage_layer_counts(n_layers: int, n_stages: int, first: int, last: int,
                       virtual: int = 1) -> list[int]:
    """Layers per pipeline stage, first to last (`n_stages` = pp x `virtual` stages per
    rank); raises ParallelError when impossible."""
    hint = "set parallel.pp_layers_first/last"
    if n_stages == 1:
        return [n_layers]
    fixed = [first or None] + [None] * (n_stages - 2) + [last or None]
    given = sum(c for c in fixed if c)
    free = sum(1 for c in fixed if c is None)
    rest = n_layers - given
    if rest < 0 or (free and (rest % free or rest // free == 0)) or (not free and rest):
        pp = n_stages // virtual
        stages = f"pp={pp} stages" if virtual == 1 else f"pp={pp} x {virtual} virtual = {n_stages} stages"
        raise ParallelError(
            f"{n_layers} layers cannot be split into {stages}"
            + (f" (first {first}, last {last})" if first or last else "")
            + f"; {hint}, or change parallel.pp / pp_virtual_stages"
        )
    each = rest // free if free else 0
    return [c if c else each for c in fixed]


def _check_model(d: ParallelDims, m: ModelConfig, p: ParallelConfig) -> None:
    if d.tp > 1:
        for label, value in (
            ("hidden size", m.d_model), ("attention heads", m.n_heads),
            ("key/value heads", m.n_kv_heads), ("ffn_hidden", m.ffn_hidden),
            ("padded vocabulary", m.padded_vocab_size),
        ):
            if value % d.tp and label == "padded vocabulary":
                # Megatron's --make-vocab-size-divisible-by, but independent of tp so that
                # checkpoint shapes do not depend on the layout.
                step = math.lcm(m.vocab_pad_to, d.tp)
                raise ParallelError(
                    f"the padded vocabulary ({m.vocab_size} ids padded to {value} rows, "
                    f"model.vocab_pad_to={m.vocab_pad_to}) is not divisible by tp={d.tp}; set "
                    f"model.vocab_pad_to to a multiple of tp (e.g. {step})"
                )
            if value % d.tp:
                raise ParallelError(
                    f"{label} {value} is not divisible by tp={d.tp}; choose a tp that divides it"
                )
    stage_layer_counts(m.n_layers, d.pp * p.pp_virtual_stages, p.pp_layers_first,
                       p.pp_layers_last, p.pp_virtual_stages)


def _check_experts(d: ParallelDims, m: ModelConfig, zero: int) -> None:
    if d.ep == 1:
        return
    if not m.moe_experts:
        raise ParallelError(
            f"parallel.ep={d.ep} splits the experts of Mixture-of-Experts layers, and this model "
            "has none (model.moe_experts=0); set parallel.ep=1"
        )
    if m.moe_experts % d.ep:
        raise ParallelError(
            f"parallel.ep={d.ep} does not divide model.moe_experts={m.moe_experts}; choose an ep "
            "that divides the number of experts"
        )
    if zero == 0:
        raise ParallelError(
            "parallel.zero=0 replicates every parameter and expert parallelism splits the "
            "experts; set parallel.zero >= 1 (or auto)"
        )
    if (d.dp_shard * d.cp * d.tp) % d.ep:
        raise ParallelError(
            f"parallel.ep={d.ep} borrows its ranks from the dp_shard x cp x tp = "
            f"{d.dp_shard * d.cp * d.tp} data-parallel shard, context- and tensor-parallel "
            "ranks, which it must divide; start more processes or lower ep"
        )
    efsdp = d.efsdp
    for label, size in (("model.d_model", m.d_model), ("model.moe_ffn_hidden", m.moe_ffn_hidden)):
        # FSDP2 shards each rank's experts along their second dimension (the first is split
        # by ep), which must divide evenly.
        if size and size % efsdp:
            raise ParallelError(
                f"{label}={size} is not divisible by the experts' shard group "
                f"dp_shard*cp*tp/ep = "
                f"{efsdp}; raise parallel.ep or choose sizes that divide"
            )


def _check_context(cfg: Config) -> None:
    """What must divide what under context parallelism; one line with the fix otherwise."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    if p.cp == 1:
        return
    pieces = 2 * p.cp if p.cp_load_balance else p.cp
    if t.seq_len % pieces:
        how = "2*cp" if p.cp_load_balance else "cp"
        raise ParallelError(
            f"context parallelism cuts train.seq_len={t.seq_len} into {how} = {pieces} equal "
            f"chunks; use a seq_len that is a multiple of {pieces} or change parallel.cp"
        )
    local = t.seq_len // p.cp
    if p.tp > 1 and p.sequence_parallel and local % p.tp:
        raise ParallelError(
            f"sequence parallelism splits each context-parallel rank's {local} positions "
            f"(train.seq_len / cp) over tp={p.tp}; use a seq_len that is a multiple of "
            f"cp*tp = {p.cp * p.tp} or set parallel.sequence_parallel=false"
        )
    if p.cp_mode == "ulysses":
        heads, kv_heads = m.n_heads // p.tp, (m.n_kv_heads or m.n_heads) // p.tp
        for label, key, count in (("attention heads", "model.n_heads", heads),
                                  ("key/value heads", "model.n_kv_heads", kv_heads)):
            if count % p.cp:
                per = f" per tensor-parallel rank (tp={p.tp})" if p.tp > 1 else ""
                raise ParallelError(
                    f"parallel.cp_mode='ulysses' splits the {count} {label}{per} ({key}) over "
                    f"cp={p.cp}, which must divide them; use parallel.cp_mode='allgather' or a "
                    "cp that divides the head counts"
                )


def _check_batch(d: ParallelDims, t: TrainConfig, p: ParallelConfig) -> None:
    per_step = t.micro_batch_size * d.dp
    if t.global_batch_size % per_step:
        raise ParallelError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by "
            f"micro_batch_size*dp = {t.micro_batch_size}*{d.dp}; use a multiple of {per_step}"
        )
    micro_batches = t.global_batch_size // per_step
    if d.pp > 1 and micro_batches < d.pp:
        raise ParallelError(
            f"{micro_batches} micro-batches per step cannot fill {d.pp} pipeline stages; raise "
            f"train.global_batch_size to at least {d.pp * per_step} or lower "
            "train.micro_batch_size"
        )
    if d.pp > 1 and p.pp_virtual_stages > 1 and micro_batches % d.pp:
        raise ParallelError(
            f"interleaved pipeline schedules need micro-batches per step ({micro_batches}) to be "
            f"a multiple of pp={d.pp}; change train.global_batch_size or micro_batch_size"
        )
    if d.tp > 1 and p.sequence_parallel and t.seq_len % d.tp:
        raise ParallelError(
            f"sequence parallelism splits train.seq_len={t.seq_len} over tp={d.tp}; use a "
            "multiple of tp or set parallel.sequence_parallel=false"
        )
