"""MoE layer forward+backward throughput: the grouped path (`torch._grouped_mm` over the
tokens sorted by expert) next to the per-expert loop and the padded bmm batch (the path
under torch.compile in fp32), side by side in one run.

    .venv/bin/python benchmarks/moe_layer.py [--device cpu|cuda] [--dtype fp32|bf16]
                                              [--tokens 4096] [--rounds 5]

All paths run the same `tessel.models.moe.MoE` layer (same weights, same routing: only
`experts.path` differs), checked equal before timing. Each shape is timed in alternating
rounds (grouped, loop, padded, grouped, ...); the median tokens/s of each and the ratios to
the loop are printed. Eager mode (no torch.compile). On CUDA the grouped path needs bf16
(`--dtype bf16`); the loop is what tessel falls back to eagerly where `_grouped_mm` does not
run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tessel.config import ModelConfig
from tessel.models.moe import MoE

SHAPES = {
    # name: (d_model, experts, expert hidden, top_k)
    "tiny-moe layer (d64, 8x64, top-2)": (64, 8, 64, 2),
    "Mixtral-like, narrow (d512, 8x1792, top-2)": (512, 8, 1792, 2),
    "fine-grained (d512, 64x256, top-8)": (512, 64, 256, 8),
    "Qwen3-like, narrow (d256, 128x96, top-8)": (256, 128, 96, 8),
}


def layer_for(d: int, experts: int, hidden: int, top_k: int, device: torch.device) -> MoE:
    cfg = ModelConfig(preset=None, n_layers=1, d_model=d, n_heads=4, mlp="swiglu",
                      norm="rmsnorm", position="rope", bias=False, moe_experts=experts,
                      moe_top_k=top_k, moe_ffn_hidden=hidden, moe_aux_loss_coef=0.01)
    layer = MoE(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return layer.to(device)


PATHS = ("grouped", "loop", "padded")


def step_time(layer: MoE, x: torch.Tensor, path: str, autocast: torch.dtype | None) -> float:
    layer.experts.path = path  # type: ignore[assignment]
    layer.zero_grad(set_to_none=True)
    sync = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with torch.autocast(x.device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
        out = layer(x)
    out.float().square().mean().backward()
    sync()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    device = torch.device(a.device)
    autocast = torch.bfloat16 if a.dtype == "bf16" else None
    print(f"torch {torch.__version__}, {device}, {a.dtype} compute, {a.tokens} tokens, "
          f"{torch.get_num_threads()} threads, median of {a.rounds} rounds (after 1 warm-up)")
    print(f"{'shape':<44} {'grouped tok/s':>14} {'loop tok/s':>11} {'padded tok/s':>13} "
          f"{'grouped/loop':>13} {'padded/loop':>12}")
    for name, (d, experts, hidden, top_k) in SHAPES.items():
        layer = layer_for(d, experts, hidden, top_k, device)
        x = torch.randn(1, a.tokens, d, device=device, requires_grad=True)
        with torch.no_grad():  # the same result on every path before timing anything
            layer.experts.path = "loop"
            ref = layer(x)
            tol = 1e-4 if autocast is None else 3e-2
            for path in ("grouped", "padded"):
                layer.experts.path = path  # type: ignore[assignment]
                torch.testing.assert_close(layer(x), ref, rtol=tol, atol=tol)
        times: dict[str, list[float]] = {p: [] for p in PATHS}
        for path in PATHS:
            step_time(layer, x, path, autocast)  # warm-up
        for _ in range(a.rounds):
            for path in PATHS:
                times[path].append(step_time(layer, x, path, autocast))
        g, lp, pd = (a.tokens / statistics.median(times[p]) for p in PATHS)
        print(f"{name:<44} {g:>14,.0f} {lp:>11,.0f} {pd:>13,.0f} {g / lp:>12.2f}x "
              f"{pd / lp:>11.2f}x")

if __name__ == "__main__":
    main()
