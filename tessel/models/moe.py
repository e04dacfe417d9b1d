"""Mixture-of-Experts layer: router, token permutation by expert, grouped expert MLPs.

    x (N tokens, C) -> router logits (N, E) in fp32 -> scores (softmax or sigmoid)
    -> top-k experts per token (scores + expert_bias, for the choice only)
    -> sort the N*k (token, expert) slots by expert -> one matmul per expert group
       (`torch._grouped_mm` over the whole sorted batch, or a loop over contiguous slices)
    -> weighted sum back to token order (index_add) + shared experts

Nothing here knows about parallelism; no Python loop over tokens, and on the grouped path no
host sync (the group offsets stay a device tensor), so a compiled block keeps one graph.
Where the layer meets other ranks is one port, `MoE.exchange` (an `ExpertExchange`, as
attention's `SequenceExchange`): the weights this rank computes with, the balance statistics
summed over the ranks that share the micro-batch's tokens, and the token dispatch/combine to
the ranks that hold the experts. Here it is `LocalExperts` (every token and expert on this
rank: nothing to exchange); `tessel.parallel.expert` places the distributed one.

The load-balancing loss and the router z-loss do not go through the model's output: each
MoE layer adds their gradient in its own backward (`AuxLossScaler`, Megatron-core's
MoEAuxLossAutoScaler), so they train every layout, a pipeline stage whose loss function
only sees the last stage's logits included. The trainer sets `grad_scale` (1/micro-batches
per step, times the fp16 loss scale) and reads the per-step statistics the layer keeps in
non-persistent buffers (`tessel.train.moe_balance`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from tessel.config import ModelConfig


class AuxLossScaler(torch.autograd.Function):
    """Identity on `output`; in backward, gives `aux` the gradient `scale`, as if
    scale * aux had been added to the loss (Megatron-core's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:  # noqa: ANN001
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


Weights = Callable[[torch.Tensor], torch.Tensor]
"""A parameter -> the tensor this rank computes with (`ExpertExchange.local`)."""


def whole(w: torch.Tensor) -> torch.Tensor:
    """Every weight whole on this rank: the parameter itself."""
    return w


class ExpertExchange(Protocol):
    """How a MoE layer meets the ranks it shares tokens or experts with (placed by
    `tessel.parallel.expert`; `LocalExperts` when there are none)."""

    token_shards: int
    """Ranks the micro-batch's tokens are split over (context x tensor parallelism): the
    balance loss is over all of their tokens. 1: every token is here."""

    def local(self, w: torch.Tensor) -> torch.Tensor:
        """The tensor this rank computes with for one of the layer's parameters (its share
        of sharded experts; its copy of a replicated weight, whose gradient from this rank's
        tokens is then one part of a sum); `w` itself when it is whole here."""
        ...

    def token_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """(E,) float32 slots per expert of this rank's tokens -> summed over the
        `token_shards` ranks (a new tensor: `counts` is left as it is)."""
        ...

    def experts(self, experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor,
                expert_of: torch.Tensor, max_rows: int) -> torch.Tensor:
        """Run `experts` on this rank's token slots: x (S, C) sorted by expert, counts (E,)
        int64 slots per expert, expert_of (S,) each slot's expert, max_rows the most slots
        one expert can get -> the experts' outputs (S, C) in the same order, wherever the
        experts live (dispatch there, combine back)."""
        ...


class LocalExperts:
    """The `ExpertExchange` of a layer whose tokens and experts are all on this rank."""

    token_shards = 1

    def local(self, w: torch.Tensor) -> torch.Tensor:
        return w

    def token_counts(self, counts: torch.Tensor) -> torch.Tensor:
        return counts

    def experts(self, experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor,
                expert_of: torch.Tensor, max_rows: int) -> torch.Tensor:
        return experts(x, counts, expert_of, max_rows)


def grouped_mm_supported(device: torch.device, dtype: torch.dtype, *dims: int,
                         compiling: bool = False) -> bool:
    """Whether `torch._grouped_mm` runs for this device, dtype and these inner sizes.

    CUDA: bf16 on compute capability 8.0+ (torch's documented constraint; sm90 has the
    CUTLASS kernel, sm80 a fallback). CPU (torch 2.13): fp32, bf16 and fp16 run, forward and
    backward. Both need every row stride to be a multiple of 16 bytes. `compiling`: under
    torch.compile, whose tracing uses the meta kernel, which accepts bf16 only (torch 2.13's
    _meta_registrations.py), even where the CPU kernel runs fp32."""
    if not hasattr(torch, "_grouped_mm") or (compiling and dtype != torch.bfloat16):
        return False
    if device.type == "cuda":
        ok = dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (8, 0)
    elif device.type == "cpu":
        ok = dtype in (torch.float32, torch.bfloat16, torch.float16)
    else:
        return False
    size = torch.empty((), dtype=dtype).element_size()
    return ok and all(d * size % 16 == 0 for d in dims)


class GroupedExperts(nn.Module):
    """E expert MLPs as 3-D weights (experts, in, out): w1/w3 (E, C, F), w2 (E, F, C);
    SwiGLU (w2(silu(x w1) * x w3)) or GELU (w2(gelu(x w1))), no biases."""

    def __init__(self, n_experts: int, d_model: int, hidden: int, gated: bool):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.w3 = nn.Parameter(torch.empty(n_experts, d_model, hidden)) if gated else None
        self.path: Literal["auto", "grouped", "loop", "padded"] = "auto"
        """auto: `torch._grouped_mm` where it runs (grouped_mm_supported), else the loop
        over experts, or under torch.compile the padded batch (no host sync, no graph
        break); the others force one path (the benchmark and tests compare them)."""

    def forward(self, x: torch.Tensor, counts: torch.Tensor, experts: torch.Tensor,
                max_rows: int, local: Weights = whole) -> torch.Tensor:
        """x: (S, C) token slots sorted by expert; counts: (E,) int64 slots per expert
        (summing to S); experts: (S,) the expert of each slot; max_rows: the most slots one
        expert can get (the token count: top-k experts are distinct); local: the weights
        this rank computes with (`ExpertExchange.local`) -> (S, C)."""
        dtype = (torch.get_autocast_dtype(x.device.type)
                 if torch.is_autocast_enabled(x.device.type) else x.dtype)
        path = self.path
        if path == "auto":
            compiling = torch.compiler.is_compiling()
            if grouped_mm_supported(x.device, dtype, *local(self.w1).shape[1:],
                                    compiling=compiling):
                path = "grouped"
            else:
                path = "padded" if compiling else "loop"
        if path == "grouped":
            offs = counts.cumsum(0).to(torch.int32)  # end of each expert's rows, on device
            return self._mlp(x.to(dtype), lambda a, w: torch._grouped_mm(a, w.to(dtype),
                                                                           offs=offs), local)
        if path == "padded":
            return self._padded(x, counts, experts, max_rows, local)
        # One matmul per expert on its contiguous slice. The sizes must be Python ints: a
        # host sync, and under torch.compile a graph break (hence "padded" there).
        return torch.cat([self._mlp(chunk, lambda a, w, e=e: a @ w[e], local)
                          for e, chunk in enumerate(x.split(counts.tolist()))])

    def _mlp(self, x: torch.Tensor, mm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
             local: Weights) -> torch.Tensor:
        """The expert MLP with `mm(activations, 3-D weight)` as its matmul."""
        h = mm(x, local(self.w1))
        if self.w3 is not None:
            h = F.silu(h) * mm(x, local(self.w3))
        else:
            h = F.gelu(h, approximate="tanh")
        return mm(h, local(self.w2))

    def _padded(self, x: torch.Tensor, counts: torch.Tensor, experts: torch.Tensor,
                max_rows: int, local: Weights) -> torch.Tensor:
        """Each expert's slots in a zero-padded (E, max_rows, C) batch, one bmm per weight:
        static shapes and no host sync, at E x max_rows / S (= experts / top_k) times the
        routed FLOPs."""
        S, C = x.shape
        start = counts.cumsum(0) - counts  # (E,) first slot of each expert
        row = torch.arange(S, device=x.device) - start[experts]  # (S,) slot's row in its expert
        batch = x.new_zeros((counts.shape[0], max_rows, C)).index_put((experts, row), x)
        return self._mlp(batch, torch.bmm, local)[experts, row]


class MoE(nn.Module):
    """Router + routed experts + shared experts, in place of a block's FeedForward."""

    def __init__(self, cfg: ModelConfig, shared: nn.Module | None = None):
        """`shared`: the shared experts, a dense MLP of moe_shared_experts x moe_ffn_hidden
        units (built by the caller, which owns the MLP class), or None."""
        super().__init__()
        assert cfg.moe_ffn_hidden is not None
        self.n_experts, self.top_k = cfg.moe_experts, cfg.moe_top_k
        self.scoring = cfg.moe_router
        self.aux_coef, self.z_coef = cfg.moe_aux_loss_coef, cfg.moe_z_loss_coef
        self.capacity_factor = cfg.moe_capacity_factor
        self.router = nn.Linear(cfg.d_model, self.n_experts, bias=False)
        self.experts = GroupedExperts(self.n_experts, cfg.d_model, cfg.moe_ffn_hidden,
                                      cfg.mlp == "swiglu")
        self.shared = shared
        self.exchange: ExpertExchange = LocalExperts()
        """Where this layer meets other ranks (tessel.parallel.expert: expert, tensor and
        context parallelism); `LocalExperts` = every token and expert is here."""
        self.grad_scale = 1.0
        """Gradient of the auxiliary losses per unit weight: 1/micro-batches per step (times
        the fp16 loss scale), set by the trainer before each step."""
        self.skip_stats = 0
        """Training forwards to leave out of the statistics: the trainer sets 1 before a
        pipeline step that starts with torch.distributed.pipelining's metadata-inference
        forward (the first, and the first after an evaluation), which is not a micro-batch."""
        # The aux-loss-free balancing bias (DeepSeek-V3): state of training, so persistent
        # (checkpointed); changed only by `tessel.train.moe_balance` after optimizer steps.
        self.register_buffer("expert_bias", torch.zeros(self.n_experts))
        # This step's statistics, summed over its micro-batches (training forwards only).
        # Not persistent: derived, zeroed by init_buffers and after each step is read.
        self.register_buffer("tokens_per_expert", torch.zeros(self.n_experts), persistent=False)
        self.register_buffer("aux_sum", torch.zeros(2), persistent=False)  # (balance, z)
        self.register_buffer("dropped", torch.zeros(()), persistent=False)

    def reset_stats(self) -> None:
        self.tokens_per_expert.zero_()
        self.aux_sum.zero_()
        self.dropped.zero_()

    def _shared(self, h: torch.Tensor) -> torch.Tensor:
        """The shared experts; under tensor parallelism on this rank's copies of their
        (replicated) weights, with partial gradients (`ExpertExchange.local`)."""
        assert self.shared is not None
        params = dict(self.shared.named_parameters())
        local = {name: self.exchange.local(p) for name, p in params.items()}
        if all(local[name] is p for name, p in params.items()):  # all whole here
            return self.shared(h)
        return torch.func.functional_call(self.shared, local, (h,))

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                              torch.Tensor]:
        """h: (N, C) -> (logits (N, E) fp32, scores (N, E) fp32, chosen experts (N, k),
        their combine weights (N, k) fp32)."""
        with torch.autocast(h.device.type, enabled=False):
            router = self.exchange.local(self.router.weight).float()
            logits = F.linear(h.float(), router)  # (N, E)
        scores = logits.softmax(-1) if self.scoring == "softmax" else logits.sigmoid()
        # The bias steers the choice only; the weights come from the unbiased scores.
        _, chosen = (scores + self.expert_bias).topk(self.top_k, dim=-1)  # (N, k)
        weights = scores.gather(-1, chosen)
        if self.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, scores, chosen, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = x.reshape(-1, C)  # (N, C)
        N, E, k = h.shape[0], self.n_experts, self.top_k
        logits, scores, chosen, weights = self.route(h)

        # Permutation: the N*k slots sorted by expert (stable: token order within an expert).
        flat = chosen.reshape(-1)  # (N*k,)
        order = torch.argsort(flat, stable=True)
        token_of = order // k  # token of each sorted slot
        counts = torch.zeros(E, dtype=torch.int64, device=h.device).scatter_add_(
            0, flat, torch.ones_like(flat))  # (E,) static shape, unlike bincount
        slot_w = weights.reshape(-1)[order]  # (N*k,)
        dropped = None
        if self.capacity_factor is not None:
            capacity = math.ceil(self.capacity_factor * N * k / E)
            start = counts.cumsum(0) - counts  # first sorted slot of each expert
            position = torch.arange(N * k, device=h.device) - start[flat[order]]
            keep = position < capacity
            dropped = (~keep).sum()
            # Dropped slots are still computed (static shapes) but weigh nothing.
            slot_w = slot_w * keep

        # (N*k, C), on this rank's experts or through the ranks that hold them
        y = self.exchange.experts(self.experts, h[token_of], counts, flat[order], N)
        out = torch.zeros((N, C), dtype=y.dtype, device=h.device).index_add_(
            0, token_of, y * slot_w[:, None].to(y.dtype))
        if self.shared is not None:
            out = out + self._shared(h).to(out.dtype)

        if self.training:
            # Switch/GShard balance: E * sum_i f_i P_i, with P from the normalised scores,
            # over the micro-batch's tokens. Under tensor parallelism this rank holds 1/tp of
            # them: f from the counts summed over the tp ranks, P and the z-loss from this
            # rank's tokens over the whole count, so the ranks' terms add up to the loss.
            probs = scores if self.scoring == "softmax" else scores / scores.sum(-1, keepdim=True)
            total_counts = self.exchange.token_counts(counts.float())
            n_total = N * self.exchange.token_shards
            balance = E * (total_counts / (n_total * k) * probs.sum(0) / n_total).sum()
            z = torch.logsumexp(logits, -1).square().sum() / n_total
            if torch.is_grad_enabled() and (self.aux_coef > 0 or self.z_coef > 0):
                out = AuxLossScaler.apply(out, self.aux_coef * balance + self.z_coef * z,
                                          self.grad_scale)
            if self.skip_stats:
                self.skip_stats -= 1
            elif not _in_backward():  # activation checkpointing's recompute: counted once
                with torch.no_grad():
                    self.tokens_per_expert.add_(counts.float())
                    self.aux_sum.add_(torch.stack([balance.detach(), z.detach()]))
                    if dropped is not None:
                        self.dropped.add_(dropped.float())
        return out.view(B, T, C)


def _in_backward() -> bool:
    """True while the autograd engine runs a backward pass (e.g. activation checkpointing
    recomputing a block's forward). Under torch.compile a checkpointed region is recomputed
    inside the compiled backward graph, which does not replay the statistics' in-place
    updates, so the traced forward always counts (and the query, a graph break, is skipped)."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1

