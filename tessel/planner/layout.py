"""A candidate parallel layout: exactly the `parallel.*` settings (and micro-batch) a run
takes, so a plan can be launched as it is."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tessel.config import Config


@dataclass(frozen=True)
class Layout:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int
    zero: int
    micro_batch: int
    activation_checkpointing: str = "none"
    offload: str = "none"
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    pp_layers_first: int = 0
    pp_layers_last: int = 0
    sequence_parallel: bool = True
    ep: int = 1
    """Expert-parallel degree: ranks borrowed from dp_shard x cp x tp (adds no processes)."""
    cp_mode: str = "allgather"
    """How the cp ranks meet in attention: all-gather of keys/values, or Ulysses' all-to-all."""
    cp_load_balance: bool = True
    """Head-tail chunks (every cp rank the same causal work), else contiguous pieces."""
    activation_checkpointing_every: int = 1
    """Checkpointing applies to every N-th block only (the others keep everything)."""
    loss_chunks: int = 0
    """Pieces the output projection and loss run in (parallel.loss_chunks; 0: automatic)."""

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def expert_dp_shard(self) -> int:
        """The routed experts' own FSDP shard group (efsdp) under ZeRO >= 1: with ep > 1 the
        dp_shard x cp x tp ranks that ep does not split the experts over (ParallelDims.efsdp);
        with ep = 1 the dense weights' group (dp_shard x cp). Replicated over dp_replicate
        like the dense weights."""
        if self.ep == 1:
            return self.dp_shard * self.cp
        return max(self.dp_shard * self.cp * self.tp // self.ep, 1)

    @classmethod
    def from_config(cls, cfg: Config, world_size: int) -> Layout:
        from tessel.parallel.dims import ParallelDims, resolve_zero

        p = cfg.parallel
        dims = ParallelDims.from_config(p, world_size)
        return cls(
            dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, dims.cp, resolve_zero(p),
            cfg.train.micro_batch_size, p.activation_checkpointing, p.offload, p.pp_schedule,
            p.pp_virtual_stages, p.pp_layers_first, p.pp_layers_last, p.sequence_parallel,
            p.ep, p.cp_mode, p.cp_load_balance, p.activation_checkpointing_every,
            p.loss_chunks,
        )

    def applied(self, cfg: Config) -> Config:
        """`cfg` running this layout, without re-validating the whole config (the planner
        checks thousands of layouts): the parallel section takes every setting of the layout
        (parallel.auto off), train.micro_batch_size its micro-batch. Its combination rules,
        which a copy skips, are `parallel.check_combinations()`; `cfg.with_overrides(
        self.overrides())` is the validated way to the same layout."""
        settings = {k: v for k, v in asdict(self).items() if k != "micro_batch"}
        parallel = cfg.parallel.model_copy(update={**settings, "auto": False})
        train = cfg.train.model_copy(update={"micro_batch_size": self.micro_batch})
        return cfg.model_copy(update={"parallel": parallel, "train": train})

    def overrides(self) -> dict[str, Any]:
        """The config settings that select this layout."""
        out = {f"parallel.{k}": v for k, v in asdict(self).items() if k != "micro_batch"}
        if self.cp == 1:  # the context-parallel settings mean nothing without cp
            del out["parallel.cp_mode"], out["parallel.cp_load_balance"]
        for key, default in (("activation_checkpointing_every", 1), ("loss_chunks", 0)):
            if out[f"parallel.{key}"] == default:  # said only where chosen
                del out[f"parallel.{key}"]
        out["train.micro_batch_size"] = self.micro_batch
        return out

    def short(self) -> str:
        """One line, e.g. `dp=8 (hsdp 4x2) tp=4 pp=8 interleaved-1f1b/v2 zero=3 mbs=1 ac=full`
        (`ep=N` after pp when experts are split; `cp=N` after the pipeline when sequences are,
        with `/ulysses` or `/contiguous` where cp_mode or cp_load_balance is not the default)."""
        dp = f"dp={self.dp}"
        if self.dp_replicate > 1 and self.dp_shard > 1:
            dp += f" (hsdp {self.dp_replicate}x{self.dp_shard})"
        parts = [dp, f"tp={self.tp}", f"pp={self.pp}"] + ([f"ep={self.ep}"] if self.ep > 1 else [])
        if self.pp > 1:
            virtual = f"/v{self.pp_virtual_stages}" if self.pp_virtual_stages > 1 else ""
            parts.append(self.pp_schedule + virtual)
            if self.pp_layers_first or self.pp_layers_last:
                parts.append(f"first/last {self.pp_layers_first}/{self.pp_layers_last} layers")
        if self.cp > 1:
            parts.append(f"cp={self.cp}" + ("/ulysses" if self.cp_mode == "ulysses" else "")
                         + ("" if self.cp_load_balance else "/contiguous"))
        parts += [f"zero={self.zero}", f"mbs={self.micro_batch}"]
        if self.activation_checkpointing != "none":
            every = self.activation_checkpointing_every
            parts.append(f"ac={self.activation_checkpointing}"
                         + (f"/every{every}" if every > 1 else ""))
        if self.loss_chunks:
            parts.append(f"loss/{self.loss_chunks}")
        if self.offload != "none":
            parts.append(f"offload={self.offload}")
        if self.tp > 1 and not self.sequence_parallel:
            parts.append("no-sp")
        return " ".join(parts)
