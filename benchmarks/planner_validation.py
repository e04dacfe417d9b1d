"""The planner's time model against published large-scale runs, row by row, and the fit of
its one fitted constant (the matmul efficiency). CPU only, a few seconds:

    .venv/bin/python benchmarks/planner_validation.py            # docs/planning.md's table
    .venv/bin/python benchmarks/planner_validation.py --fit      # refit the efficiency
    .venv/bin/python benchmarks/planner_validation.py --holdout  # fit on Megatron 2021 only

Rows and sources: tessel/planner/published.py. Predictions use the built-in hardware
profiles (tessel/planner/hardware.py) and the layout each source states (assumptions for
what it leaves out are printed under the table).
"""

from __future__ import annotations

import argparse
import statistics

from tessel.planner.hardware import MATMUL_EFFICIENCY
from tessel.planner.published import MEGATRON_2021
from tessel.planner.validation import check_all, fit_matmul_efficiency


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fit", action="store_true", help="refit the matmul efficiency first")
    p.add_argument("--holdout", action="store_true",
                   help="fit on the Megatron-LM 2021 rows only; the other sources are held out")
    args = p.parse_args()
    efficiency = MATMUL_EFFICIENCY
    if args.fit:
        efficiency = fit_matmul_efficiency()
    if args.holdout:
        efficiency = fit_matmul_efficiency(sources={MEGATRON_2021})
    checks = check_all(efficiency)
    print(f"matmul efficiency {efficiency:.3f}\n")
    print("| run | GPUs | layout (tessel) | published tokens/s | predicted | error | fitted |")
    print("|---|---|---|---|---|---|---|")
    for c in checks:
        lay = c.plan.layout
        print(f"| {c.run.name} | {c.run.gpus:,} {c.run.gpu} | {lay.short()} | "
              f"{c.run.tokens_per_s:,.0f} | {c.plan.tokens_per_s:,.0f} | {c.error:+.1%} | "
              f"{'yes' if c.run.fit else 'no'} |")
    fitted = [abs(c.error) for c in checks if c.run.fit]
    print(f"\nfitted rows: {len(fitted)}, median |error| {statistics.median(fitted):.1%}, "
          f"max {max(fitted):.1%}")
    if args.holdout:
        held = [abs(c.error) for c in checks if c.run.fit and c.run.source != MEGATRON_2021]
        print(f"held-out rows (fit on Megatron-LM 2021's {len(fitted) - len(held)} only): "
              f"{len(held)}, median |error| {statistics.median(held):.1%}, max {max(held):.1%}")
    sources = {c.run.source for c in checks}
    print("\nsources:")
    for s in sorted(sources):
        print(f"- {s}")
    notes = {c.run.caveat for c in checks if c.run.caveat}
    notes |= {f"{c.run.name}: {c.run.assumed}" for c in checks if c.run.assumed}
    print("\nassumed / not fitted:")
    for n in sorted(notes):
        print(f"- {n}")


if __name__ == "__main__":
    main()
