"""The MoE balancing bias on export to Hugging Face.

DeepSeek-V3's auxiliary-loss-free bias (`model.moe_bias_update_rate`; the buffer
`layers.N.feed_forward.expert_bias`) is added to the router's scores for the choice of each
token's top-k experts only, never to their weights. Mixtral and Qwen3-MoE have no such bias:
their export routes on the scores alone. It computes the same as tessel exactly when the bias
cannot change a choice, i.e. when it is the same for every expert of a layer (zero included);
otherwise the export is refused, unless asked for without it (`--drop-expert-bias`), and then
says how far the logits move: measured on a fixed probe, with and without the bias, one block
at a time (the host holds one block's weights, as the export does).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessel.checkpoint.hf_arch import HFError
from tessel.config import ModelConfig

PROBE_TOKENS = 128  # positions of the probe (the model's context, if shorter)


def bias_name(layer: int) -> str:
    return f"layers.{layer}.feed_forward.expert_bias"


def bias_spread(source: Any, m: ModelConfig) -> tuple[float, int]:
    """(the largest gap between two experts' bias in one layer, layers where it is nonzero)
    of the weights `source` holds (a WeightSource; a source without buffers holds none)."""
    buffer = getattr(source, "buffer", None)
    if not m.moe_experts or buffer is None:
        return 0.0, 0
    spreads = []
    for i in range(m.n_layers):
        if m.is_moe_layer(i):
            bias = buffer(bias_name(i), (m.moe_experts,))
            spreads.append(float(bias.max() - bias.min()) if bias is not None else 0.0)
    return max(spreads, default=0.0), sum(s > 0 for s in spreads)


def check_expert_bias(source: Any, m: ModelConfig, hf_class: str, drop: bool) -> str:
    """Refuse (HFError) to export weights whose balancing bias changes routing, unless `drop`;
    then the note for the summary, with the measured change of the logits ("" when the
    export is exact)."""
    spread, layers = bias_spread(source, m)
    if not layers:
        return ""
    where = (f"the MoE balancing bias (expert_bias, model.moe_bias_update_rate) differs "
             f"between experts by up to {spread:.3g} in {layers} of {m.n_moe_layers} MoE layers")
    if not drop:
        raise HFError(
            f"{str(source.path)!r}: {where}; {hf_class} routes without it, so the export would "
            "choose other experts for some tokens and compute other logits. Pass "
            "--drop-expert-bias to export without it (checkpoint.hf_export_drop_expert_bias "
            "during training); it says how far the logits move")
    diff, changed, positions = logit_shift(source, m)
    return (f"; {where} and is not written (--drop-expert-bias): on {positions} random "
            f"tokens the logits move by up to {diff:.3g} and the most likely next token "
            f"changes at {changed} of {positions} positions")


def probe_tokens(m: ModelConfig) -> torch.Tensor:
    """(1, T) token ids, the same for every model of this vocabulary and context."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, m.vocab_size, (1, min(m.max_seq_len, PROBE_TOKENS)),
                         generator=generator)


def logit_shift(source: Any, m: ModelConfig) -> tuple[float, int, int]:
    """(max |logit difference|, positions whose most likely next token differs, positions)
    between the model with its balancing bias and without it (as the export computes), on
    `probe_tokens(m)`, in float32 on the CPU."""
    from tessel.models.init import materialise
    from tessel.models.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(m)
    model.layers = nn.ModuleDict({"0": _BothRoutings(model.layers, source)})
    materialise(model, torch.device("cpu"), 0, source.get)  # embeddings, final norm, head
    model.eval()
    with torch.no_grad():
        logits = model(probe_tokens(m).expand(2, -1))[..., : m.vocab_size]  # (2, T, vocab)
    with_bias, without = logits[0], logits[1]
    changed = int((with_bias.argmax(-1) != without.argmax(-1)).sum())
    return float((with_bias - without).abs().max()), changed, logits.shape[1]


class _BothRoutings(nn.Module):
    """The model's blocks, each read from `source` when its turn comes and freed after:
    batch row 0 is routed with the balancing bias, row 1 without."""

    # The Transformer asks each block whether it is a sliding-window layer; the blocks here
    # take the global layers' mask (a model with a balancing bias has no windows).
    local = False

    def __init__(self, blocks: nn.ModuleDict, source: Any):
        super().__init__()
        self.blocks = list(blocks.items())  # a plain list: not materialised with the model
        self.source = source

    def forward(self, h: torch.Tensor, freqs: torch.Tensor | None, mask: Any = None,
                sharded: bool = False) -> torch.Tensor:
        from tessel.models.moe import MoE

        for i, block in self.blocks:
            block.to_empty(device=torch.device("cpu"))
            for name, p in block.named_parameters():
                p.copy_(self.source.get(f"layers.{i}.{name}", tuple(p.shape)))
            for buf in block.buffers():
                buf.zero_()
            block.eval()
            moe = block.feed_forward if isinstance(block.feed_forward, MoE) else None
            bias = (self.source.buffer(bias_name(i), tuple(moe.expert_bias.shape))
                    if moe is not None else None)
            if moe is None or bias is None:
                h = block(h, freqs, mask, sharded)
            else:
                moe.expert_bias.copy_(bias)
                first = block(h[:1], freqs, mask, sharded)
                moe.expert_bias.zero_()
                h = torch.cat([first, block(h[1:], freqs, mask, sharded)])
            block.to_empty(device=torch.device("meta"))
        return h
