"""Per-step bookkeeping of the Mixture-of-Experts layers a rank holds: the gradient scale of
their auxiliary losses before the step; after it, the step's token counts summed over every
rank, the auxiliary-loss-free bias update (DeepSeek-V3) and the metrics (aux loss, load
imbalance, dropped tokens), per MoE layer.

One all-reduce of a small (MoE layers, experts + 3) tensor per step over the whole world: a
data-parallel replica adds its counts, a pipeline stage its own layers' rows (the others are
zero), so every rank ends with the same global counts and so the same bias (under tensor
parallelism each tp rank routes its own part of the sequence, so its counts are its own too,
and likewise each context-parallel rank). Nothing here syncs with the host:
the metrics stay device tensors until they are logged.
"""

from __future__ import annotations

from typing import Any

import torch

from tessel.models.moe import MoE
from tessel.parallel.dist import all_reduce_sum


class MoEBalance:
    def __init__(self, models: list[Any], distributed: bool, dp: int, cp: int = 1):
        """`models`: this rank's unwrapped Transformer parts (pipeline stages);
        `dp`: the data-parallel degree (the number of replicas that count each layer);
        `cp`: the context-parallel degree (each rank's auxiliary losses are its share of the
        micro-batch's, and the data-parallel reduction averages over the cp ranks: scaled by
        cp like the token loss)."""
        self.cp = cp
        cfg = models[0].cfg
        self.n_experts = cfg.moe_experts
        self.rate = cfg.moe_bias_update_rate
        self.moe_ids = [i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)]
        self.layers: dict[int, MoE] = {
            int(name): block.feed_forward
            for m in models for name, block in m.layers.items()
            if isinstance(block.feed_forward, MoE)
        }
        self.distributed = distributed
        self.dp = dp
        self.summary: torch.Tensor | None = None
        """After a step: (MoE layers, 4) = load imbalance (max/mean tokens per expert),
        balance loss, z-loss, dropped fraction; on the device."""
        self.shares: torch.Tensor | None = None
        """After a step: (MoE layers, experts) each expert's share of the layer's token
        slots (rows sum to 1); on the device."""

    @property
    def active(self) -> bool:
        return bool(self.moe_ids)

    def before_step(self, micro_batches: int, loss_scale: float = 1.0) -> None:
        """Each micro-batch's auxiliary losses weigh 1/micro_batches of the step (like its
        token loss), times the fp16 loss scale the token loss is multiplied by."""
        for layer in self.layers.values():
            layer.grad_scale = loss_scale * self.cp / micro_batches

    def skip_first_forward(self) -> None:
        """The next training forward of each layer is not a micro-batch (a pipeline
        schedule's metadata inference): leave it out of the statistics."""
        for layer in self.layers.values():
            layer.skip_stats = 1

    @torch.no_grad()
    def after_step(self, micro_batches: int, device: torch.device, move_bias: bool = True) -> None:
        """Read and reset the layers' statistics, all-reduce them, move the balancing bias.
        Call after the optimizer step, on every rank; `move_bias=False` for a step the fp16
        loss scaler skipped (inf/nan gradients): its statistics are still read, reset and
        reported, but the bias stays where the weights stayed."""
        E = self.n_experts
        stats = torch.zeros(len(self.moe_ids), E + 3, device=device)
        for row, i in enumerate(self.moe_ids):
            layer = self.layers.get(i)
            if layer is not None:
                stats[row, :E] = layer.tokens_per_expert
                stats[row, E:E + 2] = layer.aux_sum
                stats[row, E + 2] = layer.dropped
                layer.reset_stats()
        if self.distributed:
            all_reduce_sum(stats)
        counts = stats[:, :E]  # (L, E) token slots per expert over the whole step
        mean = counts.mean(-1, keepdim=True)
        if self.rate > 0 and move_bias:
            # Under-loaded experts move up, over-loaded ones down, by a fixed step.
            step = self.rate * torch.sign(mean - counts)
            for row, i in enumerate(self.moe_ids):
                layer = self.layers.get(i)
                if layer is not None:
                    layer.expert_bias.add_(step[row].to(layer.expert_bias.device))
        self.shares = counts / counts.sum(-1, keepdim=True).clamp_min(1)
        passes = micro_batches * self.dp  # forwards that added to each row
        self.summary = torch.stack([
            counts.amax(-1) / mean.squeeze(-1).clamp_min(1e-9),
            stats[:, E] / passes,
            stats[:, E + 1] / passes,
            stats[:, E + 2] / counts.sum(-1).clamp_min(1),
        ], dim=-1)

    def metrics(self, with_dropped: bool) -> dict[str, float | list[float]]:
        """The last step's figures (a host sync): per MoE layer, and summarised (mean aux
        loss, worst imbalance); per MoE layer also each expert's share of its token slots,
        as one list (`moe_expert_share_l{i}`, what the report's heatmaps draw)."""
        if self.summary is None or self.shares is None:
            return {}
        s = self.summary.tolist()
        rec: dict[str, float | list[float]] = {
            "moe_aux_loss": sum(r[1] for r in s) / len(s),
            "moe_z_loss": sum(r[2] for r in s) / len(s),
            "moe_load_imbalance": max(r[0] for r in s),
        }
        if with_dropped:
            rec["moe_dropped_frac"] = sum(r[3] for r in s) / len(s)
        for i, r, share in zip(self.moe_ids, s, self.shares.tolist()):
            rec[f"moe_load_imbalance_l{i}"] = r[0]
            rec[f"moe_aux_loss_l{i}"] = r[1]
            # 4 significant digits keep a line short (experts x MoE layers numbers per record)
            # and are finer than a heatmap's colours.
            rec[f"moe_expert_share_l{i}"] = [float(f"{x:.4g}") for x in share]
        return rec
