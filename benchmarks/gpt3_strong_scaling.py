"""Predicted strong scaling of GPT-3 175B on 96 to 4,608 H100s at a fixed global batch of
1,152 sequences, next to Megatron-LM's published curve. CPU only, about three minutes:

    .venv/bin/python benchmarks/gpt3_strong_scaling.py            # docs/performance.md's tables
    .venv/bin/python benchmarks/gpt3_strong_scaling.py --html gpt3-strong.html

The same sweep as `tessel scale configs/gpt3-175b.toml --gpus 96,192,384,768,1536,3072,4608
--train.global_batch_size=1152` (`--model.vocab_size=131072` for the second table).

Published (NVIDIA/Megatron-LM README, "Training Speed and Scalability"): "We also strong
scaled the standard GPT-3 model (our version has slightly more than 175 billion parameters
due to larger vocabulary size) from 96 H100 GPUs to 4608 GPUs, using the same batch size of
1152 sequences throughout. Communication becomes more exposed at larger scale, leading to a
reduction in MFU from 47% to 42%." The same section: "All models use a vocabulary size of
131,072", and data-parallel, tensor-parallel and pipeline communication overlapped with
computation (--overlap-grad-reduce --overlap-param-gather --tp-comm-overlap). The text
gives the two ends only; the points between are in a figure, not read here.

Two predictions, each the fastest layout `tessel scale` finds at each GPU count:
- recipe: configs/gpt3-175b.toml (the GPT-3 paper's shape, GPT-2's 50,257-token vocabulary
  padded to 50,304, tied embeddings, seq 2048) at batch 1,152;
- Megatron's vocabulary: the same with 131,072 tokens, as the published run had; seq 2048
  assumed (GPT-3's; the README's "sequence length of 4096" is said of its weak-scaling
  models, and a batch of 1,152 sequences of 4,096 is not "the standard GPT-3").

These are predictions of the planner's time model (docs/planning.md), not measurements.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tessel.config import Config
from tessel.planner.hardware import get_profile
from tessel.planner.scaling import STRONG, Sweep, run_sweep

ROOT = Path(__file__).resolve().parents[1]
GPUS = (96, 192, 384, 768, 1536, 3072, 4608)
BATCH = 1152
PUBLISHED_MFU = {96: 0.47, 4608: 0.42}
MEGATRON_VOCAB = 131072
VARIANTS = {"recipe": [], "Megatron's vocabulary": [f"--model.vocab_size={MEGATRON_VOCAB}"]}


def predict(overrides: list[str], gpus: tuple[int, ...] = GPUS) -> Sweep:
    """The strong-scaling sweep of the GPT-3 175B recipe at batch 1,152 (what `tessel scale`
    runs for these arguments)."""
    cfg = Config.load(ROOT / "configs/gpt3-175b.toml",
                      [f"--train.global_batch_size={BATCH}", *overrides])
    return run_sweep([(n, cfg) for n in gpus], get_profile("h100-sxm"), STRONG,
                     "configs/gpt3-175b.toml")


def table(sweep: Sweep) -> list[str]:
    rows = ["| GPUs | layout (tessel scale's pick) | MFU | published MFU | efficiency | "
            "step: compute | tp | pp bubble | pp send | dp exposed | optimizer |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in sweep.points:
        if p.plan is None:
            rows.append(f"| {p.gpus:,} | {p.reason} | | | | | | | | | |")
            continue
        s, total = p.plan.step, p.plan.step.total
        lay = p.plan.layout
        hsdp = f" (replicas {lay.dp_replicate} x shards {lay.dp_shard})" if lay.zero else ""
        published = f"{PUBLISHED_MFU[p.gpus]:.0%}" if p.gpus in PUBLISHED_MFU else "-"
        shares = " | ".join(f"{v / total:.1%}" for v in (
            s.compute_s, s.tp_comm_s, s.bubble_s, s.pp_comm_s, s.dp_comm_s, s.optimizer_s))
        rows.append(f"| {p.gpus:,} | {lay.short()}{hsdp} | {p.plan.mfu:.1%} | {published} | "
                    f"{sweep.efficiency(p):.2f} | {shares} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--html", metavar="FILE", help="also write the Megatron-vocabulary sweep's page")
    args = ap.parse_args()
    for name, overrides in VARIANTS.items():
        start = time.perf_counter()
        sweep = predict(overrides)
        took = time.perf_counter() - start
        command = " ".join(["tessel scale configs/gpt3-175b.toml --gpus",
                            ",".join(map(str, GPUS)), f"--train.global_batch_size={BATCH}",
                            *overrides])
        print(f"\n{name} ({took:.0f} s): `{command}`\n")
        print("\n".join(table(sweep)))
        first, last = sweep.points[0].plan, sweep.points[-1].plan
        if first is not None and last is not None:
            print(f"\nMFU {first.mfu:.1%} -> {last.mfu:.1%} (published 47% -> 42%); efficiency "
                  f"at {GPUS[-1]:,}: {last.mfu / first.mfu:.2f} (published {42 / 47:.2f})")
        if args.html and overrides:
            from tessel.fileio import write_text_atomic
            from tessel.planner.scaling_page import render

            write_text_atomic(Path(args.html), render(sweep))


if __name__ == "__main__":
    main()
