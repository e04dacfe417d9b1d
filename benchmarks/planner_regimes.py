"""The layouts the planner chooses across model sizes and GPU counts: the regime map in
docs/planning.md (derived from its memory and time model, not from a rule of thumb).

    .venv/bin/python benchmarks/planner_regimes.py            # H100 SXM, seq 4096
    .venv/bin/python benchmarks/planner_regimes.py --gpu a100-80gb --seq-len 2048

Each cell is the fastest layout predicted to fit for that model on that many GPUs, with a
global batch of --tokens tokens per step (1,024 sequences of 4,096 by default, about the
4M tokens of GPT-3 and Llama runs); "-" where nothing fits. GPT vocabularies get 50,304 rows
(model.vocab_pad_to=128, as Megatron pads) so that tensor parallelism can divide them.
"""

from __future__ import annotations

import argparse
import time

from tessel.config import Config
from tessel.models import param_count
from tessel.planner.hardware import get_profile
from tessel.planner.search import search

MODELS = ("gpt3-1.3b", "gpt3-6.7b", "llama3-8b", "gpt3-13b", "llama3-70b", "gpt3-175b",
          "llama3-405b")
GPUS = (8, 64, 512, 4096)


def cell(preset: str, gpus: int, gpu: str, seq_len: int, tokens: int) -> str:
    model = {"model.preset": preset, "model.tie_embeddings": False, "model.max_seq_len": seq_len}
    cfg = Config.load(None, {**model, "train.seq_len": seq_len,
                             "train.global_batch_size": tokens // seq_len, "train.micro_batch_size": 1})
    result = search(cfg, gpus, get_profile(gpu), keep=1)
    if not result.plans:
        return "-"
    p = result.plans[0]
    lay = p.layout
    parts = [f"tp{lay.tp}" if lay.tp > 1 else "", f"pp{lay.pp}" if lay.pp > 1 else "",
             f"cp{lay.cp}" if lay.cp > 1 else "", f"dp{lay.dp}" if lay.dp > 1 else ""]
    extra = [f"z{lay.zero}"] if lay.dp * lay.cp > 1 else []
    if lay.activation_checkpointing != "none":
        extra.append(f"ac-{lay.activation_checkpointing}")
    if lay.offload != "none":
        extra.append(f"off-{lay.offload}")
    return " ".join(x for x in parts if x) + " (" + ", ".join(extra) + f") {p.mfu:.0%}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpu", default="h100-sxm")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=1024 * 4096)
    args = p.parse_args()
    start = time.perf_counter()
    print(f"{args.gpu}, seq {args.seq_len}, {args.tokens:,} tokens per step, bf16; each cell: "
          "layout (ZeRO stage, checkpointing, offload) predicted MFU\n")
    print("| model | params | " + " | ".join(f"{g:,} GPUs" for g in GPUS) + " |")
    print("|---|---|" + "---|" * len(GPUS))
    for preset in MODELS:
        n = param_count(Config.load(None, {"model.preset": preset}).model)
        cells = [cell(preset, g, args.gpu, args.seq_len, args.tokens) for g in GPUS]
        print(f"| {preset} | {n / 1e9:.1f}B | " + " | ".join(cells) + " |")
    print(f"\n({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
