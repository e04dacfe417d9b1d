"""Long context: the layouts the planner chooses for Llama 3 8B, 70B and 405B at 8K, 32K and
128K positions on H100s, the rule-of-thumb table in docs/planning.md (derived from its memory
and time model, not from a rule of thumb).

    .venv/bin/python benchmarks/long_context_plans.py
    .venv/bin/python benchmarks/long_context_plans.py --gpu h200

Each row is the fastest layout predicted to fit (`tessel plan`'s first line) for a model on a
GPU count, at a fixed number of tokens per step whatever the sequence length (8B: 2M, 70B: 4M,
405B: 16M, Llama 3 405B's own), so longer sequences mean fewer of them; then its predicted
memory per GPU and MFU, and the fastest layout without context parallelism (cp = 1) for
comparison ("-" where none fits). model.max_seq_len is raised to the sequence length (the
RoPE scaling a long-context stage would use changes no shape).
"""

from __future__ import annotations

import argparse
import time

from tessel.config import Config
from tessel.planner.hardware import get_profile
from tessel.planner.memory import GIB
from tessel.planner.search import Plan, search

ROWS = (  # model, tokens per step, GPU counts
    ("llama3-8b", 2**21, (8, 64)),
    ("llama3-70b", 2**22, (64, 512)),
    ("llama3-405b", 2**24, (2048, 16384)),
)
SEQ_LENS = (8192, 32768, 131072)


def layout_text(p: Plan) -> str:
    lay = p.layout
    parts = [f"tp{lay.tp}", f"cp{lay.cp}" + ("/ulysses" if lay.cp_mode == "ulysses" else ""),
             f"pp{lay.pp}", f"dp{lay.dp}"]
    extra = [f"z{lay.zero}"] if lay.dp * lay.cp > 1 else []
    if lay.pp > 1 and lay.pp_virtual_stages > 1:
        extra.append(f"v{lay.pp_virtual_stages}")
    extra.append(f"mbs{lay.micro_batch}")
    if lay.activation_checkpointing != "none":
        extra.append(f"ac-{lay.activation_checkpointing}")
    if lay.offload != "none":
        extra.append(f"off-{lay.offload}")
    return " ".join(parts) + " (" + ", ".join(extra) + ")"


def row(preset: str, gpus: int, seq_len: int, tokens: int, gpu: str) -> str:
    cfg = Config.load(None, {"model.preset": preset, "model.max_seq_len": seq_len,
                             "train.seq_len": seq_len, "train.global_batch_size": tokens // seq_len,
                             "train.micro_batch_size": 1})
    plans = search(cfg, gpus, get_profile(gpu), keep=10**9).plans
    whole = next((p for p in plans if p.layout.cp == 1), None)
    without = f"{layout_text(whole)} {whole.mfu:.0%}" if whole else "-"
    if not plans:
        return f"| {preset} | {gpus:,} | {seq_len // 1024}K | - | | | | | {without} |"
    best = plans[0]
    lay = best.layout
    return (f"| {preset} | {gpus:,} | {seq_len // 1024}K | {layout_text(best)} | {lay.cp} | "
            f"{lay.tp} | {best.memory.total / GIB:.1f} | {best.mfu:.0%} | {without} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpu", default="h100-sxm")
    args = p.parse_args()
    start = time.perf_counter()
    print(f"{args.gpu}, bf16; the fastest layout predicted to fit, its memory and MFU, and the "
          "fastest without context parallelism\n")
    print("| model | GPUs | seq | layout | cp | tp | GiB/GPU | MFU | best with cp = 1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for preset, tokens, counts in ROWS:
        for gpus in counts:
            for seq_len in SEQ_LENS:
                print(row(preset, gpus, seq_len, tokens, args.gpu), flush=True)
    print(f"\n({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
