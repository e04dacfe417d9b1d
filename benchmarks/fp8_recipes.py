"""Does an FP8 run learn as the bf16 run does? The tiny recipe under bf16, and under each
train.fp8 recipe (emulated on a CPU: torchao's float8 casts and scales, the matmul of the
dequantised operands in float32), on the same batches.

    .venv/bin/python benchmarks/fp8_recipes.py [--steps 200] [--recipes tensorwise,rowwise]

(rowwise_with_gw_hp is refused under bf16 on a CPU; on a GPU add it to --recipes.)

Each run is its own process (`--one RECIPE`), so its peak resident memory is its own. Prints,
per run: the mean training loss of the first and the last 10 steps, the final validation
loss, its gap to bf16's (absolute and relative) and the peak RSS. On a CPU the float8 path is
emulated: its memory and time say what the emulation costs, not what FP8 saves on a GPU.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from tessel.config import Config
from tessel.observe.metrics import read_metrics
from tessel.train import Trainer

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"


def one(recipe: str, steps: int, root: Path) -> dict:
    """Train the tiny recipe once (`recipe`: bf16 or a train.fp8 recipe); its figures."""
    run = root / recipe
    cfg = Config.load(RECIPE, {"train.steps": steps, "train.precision": "bf16",
                               "train.eval_interval": 0, "train.fp8": recipe != "bf16" and recipe,
                               "run.dir": str(run), "run.sample_tokens": 0,
                               "checkpoint.interval": 0, "metrics.tensorboard": False,
                               "metrics.log_interval": 1})
    Trainer(cfg, console=False).train()
    recs = read_metrics(run / "metrics.jsonl")
    losses = [r["loss"] for r in recs if "loss" in r]
    val = [r["val_loss"] for r in recs if "val_loss" in r][-1]
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"recipe": recipe, "first10": sum(losses[:10]) / 10, "last10": sum(losses[-10:]) / 10,
            "val_loss": val, "peak_rss_mib": peak_kib / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--recipes", default="tensorwise,rowwise")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.steps, Path(a.root))))
        return
    root = Path(tempfile.mkdtemp(prefix="tessel-fp8-bench-"))
    rows = []
    for recipe in ["bf16", *a.recipes.split(",")]:
        out = subprocess.run([sys.executable, __file__, "--one", recipe, "--steps", str(a.steps),
                              "--root", str(root)], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = rows[0]["val_loss"]
    print(f"tiny recipe ({RECIPE.name}), {a.steps} steps, bf16 autocast, one process; FP8 "
          f"emulated off CUDA")
    print(f"{'run':20} {'loss 1-10':>9} {'loss last10':>11} {'val loss':>9} {'gap':>8} "
          f"{'gap %':>6} {'peak RSS':>9}")
    for r in rows:
        gap = r["val_loss"] - base
        print(f"{r['recipe']:20} {r['first10']:9.4f} {r['last10']:11.4f} {r['val_loss']:9.4f} "
              f"{gap:+8.4f} {100 * gap / base:+6.2f} {r['peak_rss_mib']:7.0f} MiB")


if __name__ == "__main__":
    main()
