"""Peak bytes held for backward under each activation checkpointing policy and loss-piece
count, measured (autograd's saved tensors and selective checkpointing's cache, counted once
per storage while held: tests/saved_memory.py) beside the planner's prediction, on CPU, at a
Llama 3 vocabulary (128,256) and seq 2,048.

    .venv/bin/python benchmarks/checkpointing_memory.py            # about two minutes
    .venv/bin/python benchmarks/checkpointing_memory.py --layers 2 --d-model 128

Columns: `saved at end of forward` is what the planner's `saved` predicts (the bytes held
when the backward starts); `peak` is the most held at any moment of forward + backward (a
piece of the loss made again in backward, a block recomputed); `planner activations` adds the
planner's transient (the largest recomputed block, or the logits of one piece) to its
`saved`. Never a timed test in CI.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from saved_memory import SavedTensorMeter, metered_contexts  # noqa: E402

import tessel.parallel.checkpointing as checkpointing  # noqa: E402
from tessel.config import ModelConfig  # noqa: E402
from tessel.models.loss import loss_pieces, token_loss_sum  # noqa: E402
from tessel.models.transformer import build_model  # noqa: E402
from tessel.planner.layout import Layout  # noqa: E402
from tessel.planner.memory import estimate_memory  # noqa: E402

MIB = 2**20


def measure(m: ModelConfig, policy: str, chunks: int, seq: int, mbs: int) -> tuple[int, int]:
    """(bytes held at the end of the forward, peak over forward + backward)."""
    torch.manual_seed(0)
    model = build_model(m, seed=0)
    checkpointing.apply_activation_checkpointing(model, policy)
    model.loss_chunks = chunks
    x = torch.randint(0, m.vocab_size, (mbs, seq))
    y = torch.randint(0, m.vocab_size, (mbs, seq))
    meter = SavedTensorMeter.for_modules([model])
    with meter.measuring():
        loss = model(x, targets=y).sum() if chunks > 1 else token_loss_sum(model(x), y)
        at_forward = meter.current
        loss.backward()
    return at_forward, meter.peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=1)
    args = p.parse_args()
    checkpointing.create_selective_checkpoint_contexts = metered_contexts(
        checkpointing.create_selective_checkpoint_contexts)
    torch.set_num_threads(2)
    d = args.d_model
    m = ModelConfig(preset="tiny-llama", n_layers=args.layers, d_model=d, n_heads=d // 32,
                    n_kv_heads=max(d // 128, 1), ffn_hidden=int(3.5 * d), vocab_size=128256,
                    max_seq_len=args.seq_len)
    auto = loss_pieces(0, args.micro_batch * args.seq_len, m.padded_vocab_size)
    print(f"Llama-shaped: {args.layers} layers, d_model {d}, vocab {m.vocab_size:,}, seq "
          f"{args.seq_len}, micro-batch {args.micro_batch}, fp32, one CPU process "
          f"(automatic loss pieces here: {auto})\n")
    print("| policy | loss pieces | saved at end of forward MiB | planner saved MiB | error | "
          "peak MiB | planner activations MiB |")
    print("|---|---|---|---|---|---|---|")
    cases = [(pol, 1) for pol in ("none", "matmuls", "selective", "full")]
    cases += [("selective", n) for n in (2, 8, 32)] + [("full", 8)]
    for policy, chunks in cases:
        at_forward, peak = measure(m, policy, chunks, args.seq_len, args.micro_batch)
        layout = Layout(1, 1, 1, 1, 1, 0, args.micro_batch, policy, loss_chunks=chunks)
        mem = estimate_memory(m, layout, args.seq_len, args.micro_batch, "fp32")
        print(f"| {policy} | {chunks} | {at_forward / MIB:,.1f} | {mem.saved / MIB:,.1f} | "
              f"{at_forward / mem.saved - 1:+.1%} | {peak / MIB:,.1f} | "
              f"{mem.activations / MIB:,.1f} |")


if __name__ == "__main__":
    main()
