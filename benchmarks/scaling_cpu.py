"""Strong and weak scaling of a config measured on this machine's CPU processes, as
`tessel scale --measure` measures it (tessel.scaling.measure_sweep), plus gloo's all-reduce
latency and bandwidth between two processes (tessel.scaling.gloo.measure_gloo).

Command (about 2 minutes on two idle CPU cores, most of it process start-up):

    .venv/bin/python benchmarks/scaling_cpu.py --config configs/tiny.toml --nproc 1,2 \\
        --warmup 3 --steps 10 --rounds 1 --data.source=synthetic

Method
- each point is a real `tessel train CONFIG --nproc N` (torchrun for N > 1), one CPU thread per
  process (OMP_NUM_THREADS=1: each process stands for one device), pure data parallelism;
- strong scaling keeps the config's global batch; weak scaling multiplies it by N;
- figures are over the steps after --warmup: tokens over summed step time, the mean step time
  and its split (data, compute, optimizer); efficiency = tokens/s per process over the first
  point's (1.0 is perfect scaling).
On a machine with fewer cores than the largest N the processes share cores and efficiency
falls for that reason alone. Never run as a timed test in CI.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from tessel.scaling import MeasuredPoint, measure_sweep
from tessel.scaling.gloo import measure_gloo


def table(title: str, points: list[MeasuredPoint]) -> str:
    head = (f"{'procs':>5} {'batch':>5} {'tokens/s':>9} {'tok/s/proc':>10} {'step ms':>8} "
            f"{'data':>6} {'compute':>8} {'optim':>6} {'effic.':>6}")
    lines = [title, head]
    for p in points:
        if not p.ok:
            lines.append(f"{p.nproc:>5} {p.global_batch_size:>5} failed: {p.error}")
            continue
        s = {k: 1000 * v for k, v in p.split.items()}
        lines.append(
            f"{p.nproc:>5} {p.global_batch_size:>5} {p.tokens_per_s:>9,.0f} "
            f"{p.tokens_per_s_per_process:>10,.0f} {1000 * p.step_time_s:>8.1f} "
            f"{s.get('data', 0):>6.1f} {s.get('compute', 0):>8.1f} {s.get('optimizer', 0):>6.1f} "
            f"{p.efficiency:>6.2f}" + (" (short)" if p.short else ""))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/tiny.toml")
    p.add_argument("--nproc", default="1,2", help="process counts, e.g. 1,2,4")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--modes", default="strong,weak")
    p.add_argument("--out", help="sweep directory (default: a temporary one, removed after)")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat each sweep (strong, weak, strong, ...): on a shared machine the "
                        "spread between rounds says how far to trust one")
    p.add_argument("--json", action="store_true", help="also print every point as JSON")
    args, overrides = p.parse_known_args()
    nprocs = [int(n) for n in args.nproc.split(",")]
    medians = []
    with tempfile.TemporaryDirectory(prefix="tessel-scaling-") as tmp:
        root = Path(args.out or tmp)
        runs: dict[str, list[list[MeasuredPoint]]] = {}
        for r in range(args.rounds):
            for mode in args.modes.split(","):
                points = measure_sweep(Path(args.config), overrides, nprocs,
                                       root / f"{mode}-{r}", args.warmup, args.steps,
                                       strong=mode == "strong")
                runs.setdefault(mode, []).append(points)
                print(table(f"{mode} scaling, round {r + 1} ({args.config} "
                            f"{' '.join(overrides)})", points))
                if args.json:
                    print(json.dumps([pt.as_dict() for pt in points], indent=1))
                print()
        for mode, rounds in runs.items():
            effs = [[pt.efficiency for pt in col if pt.efficiency is not None]
                    for col in zip(*rounds)]
            medians.append(f"{mode}: median efficiency over {args.rounds} round(s): " + ", ".join(
                f"N={col[0].nproc} {statistics.median(e):.2f}" if e else f"N={col[0].nproc} -"
                for col, e in zip(zip(*rounds), effs)))
    print("\n".join(medians))
    gloo = measure_gloo(2)
    print(f"gloo all-reduce, 2 processes: latency {gloo['latency_s'] * 1e6:.0f} us, bus "
          f"bandwidth {gloo['bandwidth_Bps'] / 1e9:.2f} GB/s")
    for s in gloo["samples"]:
        print(f"  {s['bytes']:>9,} bytes  {s['seconds'] * 1e6:>8.0f} us")


if __name__ == "__main__":
    main()
