"""Context parallelism: per-rank activation memory and step time against sequence length at
cp = 1, 2, 4, in one invocation (every figure from the same machine and moment).

Command (on CPU: gloo processes; on a GPU machine with >= 4 GPUs it uses CUDA and NCCL):

    .venv/bin/python benchmarks/context_parallel.py --seq 1024,2048,4096,8192 --cp 1,2,4

Method
- the model is tessel's (Llama shape: RoPE, GQA, SwiGLU; `--d-model`, `--layers`, `--heads`,
  `--kv-heads`), placed on a cp mesh with `tessel.parallel.context.apply_context_parallel`
  exactly as the trainer places it, fp32 on CPU / bf16 autocast on CUDA, one sequence per
  rank-step (micro-batch 1), no optimizer (the attention and the exchange are what changes);
- per-rank activation memory: the bytes autograd saves for backward during one forward
  (saved-tensor hooks, counted once per storage, weights excluded): the largest over ranks;
  on CUDA also torch.cuda.max_memory_allocated() of the forward+backward;
- step time: forward + backward of one micro-batch, the median of `--repeats` after one
  warm-up, the slowest rank's; `speed-up` = the cp = 1 time / this time. On a 2-core CPU
  cp processes share 2 cores (cp = 4 is oversubscribed), so CPU times show that the code
  runs and how memory scales, not how fast CP is on GPUs.
Never run as a timed test in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def _saved_bytes(fn, params: set[int]) -> int:  # noqa: ANN001
    """Bytes of the distinct storages autograd saves while `fn()` runs (weights excluded)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = getattr(t, "elem", t)  # an in-flight collective's result wraps the tensor
        storage = local.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tessel.config import Config
    from tessel.models import build_model
    from tessel.parallel.context import apply_context_parallel

    cuda = torch.cuda.is_available()
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    longest = max(args.seq)
    cfg = Config.load(None, {
        "model.preset": "tiny-llama", "model.n_layers": args.layers, "model.d_model": args.d_model,
        "model.n_heads": args.heads, "model.n_kv_heads": args.kv_heads,
        "model.ffn_hidden": 4 * args.d_model, "model.max_seq_len": longest,
        "train.seq_len": longest}).model
    model = build_model(cfg, device, seed=0)
    cp = None
    if world > 1:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))
        cp = apply_context_parallel(model, mesh["cp"], args.mode, balanced=True)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    rows = []
    for T in args.seq:
        gen = torch.Generator().manual_seed(T)
        x = torch.randint(0, cfg.vocab_size, (1, T), generator=gen).to(device)
        y = torch.randint(0, cfg.vocab_size, (1, T), generator=gen).to(device)
        positions = None
        if cp is not None:
            x, y, positions = cp.shard(x, y)

        def step(measure: bool = False, x: torch.Tensor = x, y: torch.Tensor = y,
                 positions: torch.Tensor | None = positions) -> int:  # this length's batch
            def forward() -> torch.Tensor:
                with torch.autocast(device.type, torch.bfloat16, enabled=cuda):
                    logits = model(x, None, positions)
                return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            saved, loss = _saved_bytes(forward, params) if measure else (0, forward())
            loss.backward()
            model.zero_grad(set_to_none=True)
            return saved

        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        saved = step(measure=True)
        peak = torch.cuda.max_memory_allocated(device) if cuda else 0
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        mine = torch.tensor([saved, peak, statistics.median(times)], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        rows.append({"seq": T, "cp": world, "saved_bytes": mine[0].item(),
                     "cuda_peak_bytes": mine[1].item(), "step_s": mine[2].item()})
    if rank == 0:
        Path(args.out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=lambda s: [int(v) for v in s.split(",")],
                        default=[1024, 2048, 4096, 8192])
    parser.add_argument("--cp", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2, 4])
    parser.add_argument("--mode", choices=["allgather", "ulysses"], default="allgather")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for cp in args.cp:
            out = Path(tmp) / f"cp{cp}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={cp}", __file__, "--worker", "--out", str(out),
                   "--seq", ",".join(map(str, args.seq)), "--mode", args.mode,
                   "--d-model", str(args.d_model), "--layers", str(args.layers),
                   "--heads", str(args.heads), "--kv-heads", str(args.kv_heads),
                   "--repeats", str(args.repeats)]
            env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // cp))}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                print(f"cp={cp}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
                continue
            results += json.loads(out.read_text())
    base = {r["seq"]: r for r in results if r["cp"] == 1}
    print(f"mode {args.mode}, d_model {args.d_model}, {args.layers} layers, {args.heads} heads / "
          f"{args.kv_heads} KV heads, micro-batch 1, "
          f"{'cuda' if torch.cuda.is_available() else 'cpu'}\n")
    print("| seq | cp | saved for backward, MiB/rank | vs cp=1 | step s | speed-up |")
    print("|---|---|---|---|---|---|")
    for r in sorted(results, key=lambda r: (r["seq"], r["cp"])):
        b = base.get(r["seq"])
        ratio = f"{r['saved_bytes'] / b['saved_bytes']:.2f}" if b else "-"
        speed = f"{b['step_s'] / r['step_s']:.2f}" if b else "-"
        print(f"| {r['seq']} | {r['cp']} | {r['saved_bytes'] / 2**20:.1f} | {ratio} | "
              f"{r['step_s']:.3f} | {speed} |")


if __name__ == "__main__":
    main()
