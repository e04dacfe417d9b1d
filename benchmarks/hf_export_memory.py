"""Peak host memory of `tessel convert tessel-to-hf` on a ~1B-parameter model, against the
model's size (the target: under 1.3x).

    .venv/bin/python benchmarks/hf_export_memory.py                  # llama3-1b, fp32
    .venv/bin/python benchmarks/hf_export_memory.py --preset gpt2-774m --max-shard-size 2GB

Method: a child process builds the model (random weights) and saves a tessel checkpoint
(DCP); a second child runs the real command on it; its peak resident memory is that
child's own ru_maxrss (os.wait4). The baseline is the same measurement for a process that
only imports tessel and torch. Needs about 3x the model's size in free disk. Never run as a
timed test in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SAVE = """
import sys, torch
from pathlib import Path
from tessel.checkpoint import save_checkpoint
from tessel.config import Config
from tessel.models import build_model
cfg = Config.load(None, {"model.preset": sys.argv[1]})
model = build_model(cfg.model, seed=0)
save_checkpoint(Path(sys.argv[2]), 1, model, None, {"config": cfg.to_dict()})
print(sum(p.numel() for p in model.parameters()))
"""


def peak_rss_of(cmd: list[str], log: Path) -> tuple[float, float, str]:
    """(peak RSS in bytes, seconds, stdout) of `cmd` run as a child process: os.wait4 gives
    that child's own ru_maxrss (output goes through a file so nothing else reaps it)."""
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    took = time.perf_counter() - start
    text = log.read_text()
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{' '.join(cmd[:4])}... failed:\n{text[-2000:]}")
    return usage.ru_maxrss * 1024, took, text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama3-1b")
    p.add_argument("--max-shard-size", default="5GB")
    args = p.parse_args()
    py = sys.executable
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        root = Path(tmp)
        base, _, _ = peak_rss_of([py, "-c", "import torch, tessel.checkpoint.hf_convert"],
                                 root / "base.log")
        _, _, out = peak_rss_of([py, "-c", SAVE, args.preset, str(root / "ckpt")], root / "save.log")
        n = int(out.split()[-1])
        ckpt = root / "ckpt" / "step_00000001"
        peak, took, _ = peak_rss_of([py, "-m", "tessel", "convert", "tessel-to-hf", str(ckpt),
                                     str(root / "hf"), "--max-shard-size", args.max_shard_size],
                                    root / "export.log")
        model_bytes = 4 * n
        files = sorted(f.name for f in (root / "hf").iterdir())
        result = {
            "preset": args.preset, "parameters": n, "model_gib": model_bytes / 2**30,
            "max_shard_size": args.max_shard_size, "export_s": round(took, 1),
            "peak_rss_gib": peak / 2**30, "baseline_rss_gib": base / 2**30,
            "peak_over_model": peak / model_bytes,
            "peak_above_baseline_over_model": (peak - base) / model_bytes, "files": files,
        }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
