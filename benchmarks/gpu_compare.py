"""tessel against a plain PyTorch training loop on one GPU, for several model sizes.

Command (on one H100/H200; about 10 minutes):

    python benchmarks/gpu_compare.py --presets gpt2-124m gpt2-350m gpt3-1.3b --seq-len 2048 \\
        --precision bf16 --compile --json gpu_compare.json

For each preset it runs `benchmarks/overhead.py`'s comparison: the tessel `Trainer` step and
a nanoGPT-style loop (regional `torch.compile`, fused AdamW, SDPA attention, bf16 autocast,
pinned non-blocking copies) on the same model, the same initial weights and the same
batches, interleaved in one process, warm-up excluded, synchronised timing. It prints one row
per preset: tokens/s of each side, their ratio, and each side's MFU against the device's
dense BF16 peak (PaLM FLOP count, see `tessel.models.flops_per_token`). Micro-batch sizes
default to what fits with both models on an 80 GB GPU at --seq-len 2048 (--micro-batch-size
sets one for all). Runs on a CPU too (e.g. `--presets tiny --seq-len 64 --precision fp32`),
which only checks that the script works.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import overhead  # noqa: E402

from tessel.config import Config  # noqa: E402
from tessel.models import flops_per_token  # noqa: E402
from tessel.planner.prelaunch import device_peak_flops  # noqa: E402

# Sequences per micro-batch at seq 2048 that leave room for both sides on 80 GB.
DEFAULT_MBS = {"gpt2-124m": 16, "gpt2-350m": 8, "gpt3-1.3b": 4}


def compare(a: argparse.Namespace, preset: str) -> dict[str, Any]:
    mbs = a.micro_batch_size or DEFAULT_MBS.get(preset, 4)
    ns = argparse.Namespace(
        preset=preset, seq_len=a.seq_len, micro_batch_size=mbs, global_batch_size=mbs * a.accum,
        steps=a.steps, warmup=a.warmup, rounds=a.rounds, device=a.device, precision=a.precision,
        compile=a.compile, full_train=False,
    )
    r = overhead.run(ns)
    model = Config.load(None, {"model.preset": preset}).model
    device = torch.device("cuda" if r["device"].startswith("cuda") else "cpu")
    peak = device_peak_flops(device)
    fpt = flops_per_token(model, a.seq_len)
    for side in ("tessel", "plain"):
        r[f"{side}_mfu"] = fpt * r[f"{side}_tok_s"] / peak if peak else None
    return r


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["gpt2-124m", "gpt2-350m", "gpt3-1.3b"])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=0, help="0: the per-preset default")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--precision", default="bf16", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument("--compile", action="store_true")
    p.add_argument("--json", metavar="OUT.json")
    a = p.parse_args(argv)
    rows = []
    for preset in a.presets:
        r = compare(a, preset)
        rows.append(r)
        pct = lambda v: f"{100 * v:.1f}%" if v is not None else "unknown"  # noqa: E731
        print(f"{preset:>10} {r['params']:>14,} {r['device_name']:>24} mbs {r['micro_batch_size']:>2}  "
              f"tessel {r['tessel_tok_s']:>10,.0f} tok/s (MFU {pct(r['tessel_mfu'])})  "
              f"plain {r['plain_tok_s']:>10,.0f} tok/s (MFU {pct(r['plain_mfu'])})  "
              f"ratio {r['ratio']:.3f}", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
