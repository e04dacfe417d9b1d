"""What the content checksums cost at save time, next to the save itself, in one run.

    .venv/bin/python benchmarks/checkpoint_save.py [--preset gpt2-124m] [--rounds 3]

Saves the model and AdamW state of a preset (one process, fp32) `rounds` times with
`tessel.checkpoint.save_checkpoint` (which hashes every file before publishing: CRC-32 on a
thread pool), and times the same hashing of the same files on its own, and SHA-256 (one
thread, the earlier choice) for comparison; prints the median save time, the checksum time
and their ratio, and the throughputs. The page cache is warm for all (the files were just
written), as in a real save.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tessel.checkpoint import save_checkpoint
from tessel.checkpoint.checksum import file_digests
from tessel.config import ModelConfig, OptimConfig
from tessel.models import build_model
from tessel.optim.groups import build_optimizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt2-124m")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    model = build_model(ModelConfig(preset=a.preset), seed=0)
    opt = build_optimizer(model, OptimConfig(), torch.device("cpu"))
    for p in model.parameters():  # materialise AdamW's state with one step
        p.grad = torch.zeros_like(p)
    opt.step()
    root = Path(tempfile.mkdtemp(prefix="tessel-ckpt-bench-"))
    saves, hashes, shas, size = [], [], [], 0
    try:
        for step in range(1, a.rounds + 1):
            t0 = time.perf_counter()
            path = save_checkpoint(root, step, model, opt, {}, keep_last=1)
            saves.append(time.perf_counter() - t0)
            files = [f for f in path.iterdir() if f.is_file() and f.name != "state.json"]
            size = sum(f.stat().st_size for f in files)
            t0 = time.perf_counter()
            file_digests(files)
            hashes.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for f in files:
                with f.open("rb") as fh:
                    hashlib.file_digest(fh, "sha256")
            shas.append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    save, digest = statistics.median(saves), statistics.median(hashes)
    sha = statistics.median(shas)
    print(f"{a.preset}: checkpoint {size / 2**30:.2f} GiB; save (incl. checksums) {save:.2f} s; "
          f"CRC-32 checksums alone {digest:.2f} s = {100 * digest / save:.1f}% of the save "
          f"({size / 2**20 / digest:.0f} MiB/s); save without them ~{save - digest:.2f} s; "
          f"SHA-256 (one thread) would take {sha:.2f} s = {100 * sha / save:.1f}% "
          f"({size / 2**20 / sha:.0f} MiB/s)")


if __name__ == "__main__":
    main()
