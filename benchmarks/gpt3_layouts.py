"""What `tessel plan` picks for the GPT-3 family, next to the common rule of thumb and the
configurations Megatron-LM and the GPT-3 paper published. CPU only, about a minute:

    .venv/bin/python benchmarks/gpt3_layouts.py              # docs/planning.md's table

Method
- models: tessel's gpt3-* presets (GPT-3 paper, Brown et al. 2020, Table 2.1: tied
  embeddings, GPT-2's 50,257-token vocabulary padded to a multiple of model.vocab_pad_to),
  seq 2048, the paper's batch sizes (1M tokens = 512 sequences for 1.3B and 2.7B, 2M for
  6.7B and 13B, 3.2M for 175B), bf16, on the a100-80gb and h100-sxm profiles.
- picked: the fastest layout of `tessel plan`'s search that is predicted to fit.
- rule of thumb: 1-10B data parallel; 10-100B tensor + data; 100B+ tensor + pipeline + data.
  "best within the rule" is the fastest fitting layout of the rule's class (tp = 1 and pp = 1
  for DP; tp > 1, pp = 1 for TP+DP; tp > 1 and pp > 1 for 3D), and its speed relative to the
  pick says how much the rule would cost according to the planner's model.
- its tp x pp here: the fastest fitting layout with the published tensor and pipeline
  degrees on this GPU count (data parallelism and the rest as the search finds best).
- published: Megatron-LM (Narayanan et al., SC21, Table 1: GPT models on A100-80GB of
  1.7B / 3.6B / 7.5B / 18.4B / 145.6B parameters, the nearest in size to each preset) and, for
  175B, the MegaScale Megatron-LM baseline (Jiang et al., NSDI'24, Table 2). The GPT-3 paper
  says only that it used "a mixture of model parallelism within each matrix multiply and
  model parallelism across the layers of the network" on V100s, without degrees.

These are the planner's predictions, not measurements (see docs/planning.md for how its time
model compares with published runs).
"""

from __future__ import annotations

import argparse

from tessel.config import Config
from tessel.models.transformer import param_count
from tessel.planner.hardware import get_profile
from tessel.planner.search import Plan, search

# GPT-3 paper, Table 2.1: batch size in tokens (sequences of 2048).
BATCH = {"gpt3-1.3b": 512, "gpt3-2.7b": 512, "gpt3-6.7b": 1024, "gpt3-13b": 1024,
         "gpt3-175b": 1536}
GPUS = (8, 64, 512, 1024)
# Megatron-LM 2021 (Table 1), nearest published size: (size, tp, pp, GPUs).
MEGATRON = {"gpt3-1.3b": ("1.7B", 1, 1, 32), "gpt3-2.7b": ("3.6B", 2, 1, 64),
            "gpt3-6.7b": ("7.5B", 4, 1, 128), "gpt3-13b": ("18.4B", 8, 1, 256),
            "gpt3-175b": ("175B, MegaScale", 8, 8, "256-12,288")}


def rule(params: float) -> str:
    return "DP" if params < 10e9 else "TP+DP" if params < 100e9 else "TP+PP+DP"


def layout_class(p: Plan) -> str:
    lay = p.layout
    if lay.tp > 1 and lay.pp > 1:
        return "TP+PP+DP" if lay.dp > 1 else "TP+PP"
    if lay.tp > 1:
        return "TP+DP" if lay.dp > 1 else "TP"
    if lay.pp > 1:
        return "PP+DP" if lay.dp > 1 else "PP"
    return "DP"


def in_rule(p: Plan, wanted: str) -> bool:
    lay = p.layout
    return {"DP": lay.tp == 1 and lay.pp == 1, "TP+DP": lay.tp > 1 and lay.pp == 1,
            "TP+PP+DP": lay.tp > 1 and lay.pp > 1}[wanted]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=list(GPUS))
    ap.add_argument("--gpu", nargs="+", default=["a100-80gb", "h100-sxm"])
    args = ap.parse_args()
    print("| model | batch | GPUs | picked by tessel plan | class | MFU | rule of thumb | "
          "best within the rule (vs pick) | Megatron-LM published | its tp x pp here (vs pick) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for preset, batch in BATCH.items():
        cfg = Config.load(None, {"model.preset": preset, "train.seq_len": 2048,
                                 "train.global_batch_size": batch, "train.precision": "bf16"})
        n = param_count(cfg.model)
        wanted = rule(n)
        size, mtp, mpp, mgpus = MEGATRON[preset]
        published = f"{size}: tp={mtp} pp={mpp} on {mgpus} A100"
        for gpu in args.gpu:
            hw = get_profile(gpu)
            for gpus in args.gpus:
                result = search(cfg, gpus, hw, keep=1_000_000)
                label = f"{gpus:,} {gpu}"
                if not result.plans:
                    print(f"| {preset} | {batch} | {label} | none fits | | | {wanted} | | "
                          f"{published} | |")
                    continue
                best = result.plans[0]
                within = next((p for p in result.plans if in_rule(p, wanted)), None)
                if within is None:
                    note = "none fits"
                elif within is best:
                    note = "the pick"
                else:
                    note = (f"{within.layout.short()} "
                            f"({within.tokens_per_s / best.tokens_per_s:.2f}x)")
                theirs = next((p for p in result.plans
                               if p.layout.tp == mtp and p.layout.pp == mpp), None)
                same = ("none fits" if theirs is None else "the pick" if theirs is best else
                        f"{theirs.layout.short()} ({theirs.tokens_per_s / best.tokens_per_s:.2f}x)")
                print(f"| {preset} | {batch} | {label} | {best.layout.short()} | "
                      f"{layout_class(best)} | {best.mfu:.0%} | {wanted} | {note} | "
                      f"{published} | {same} |")


if __name__ == "__main__":
    main()
