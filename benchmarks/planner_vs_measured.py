"""The planner against measurement on this machine: data, tensor and pipeline parallelism on
2 CPU processes, each measured with `tessel scale --measure` (the command a user runs) and
predicted by the planner calibrated on the same sweep's one-process run.

Command (about 4 minutes on two idle CPU cores for the demo model, 3 rounds):

    .venv/bin/python benchmarks/planner_vs_measured.py --rounds 3 \\
        -- --model.preset=demo --data.source=synthetic

Method
- for each dimension (--over dp, tp, pp) one sweep `tessel scale configs/tiny.toml --measure
  --nproc 1,2 --over X --json` with the overrides after `--`: one process, then two in that
  dimension; the planner's profile of this machine is measured by the sweep (one process's
  matmul and memory rate, gloo's latency and bandwidth between two processes) and its matmul
  efficiency calibrated on the one-process run, so the two-process errors are the planner's
  errors in scaling;
- per point: measured tokens/s (the unprofiled timed steps) and exposed communication (the
  profiled ones: time blocked in collectives, which includes a pipeline stage's wait for its
  neighbour), beside the planner's tokens/s and its time blocked on communication (exposed
  collectives + pipeline sends + bubble); errors are predicted / measured - 1;
- --rounds repeats every sweep; the table gives each round's error and the median. The
  load average is printed before and after: on a shared machine two processes do not get
  two cores, and the errors then measure the sharing, not the planner.
Never a timed test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def waiting(split: dict[str, float]) -> float:
    """The planner's seconds blocked on communication, from a point's predicted split."""
    return sum(split.get(k, 0.0) for k in ("dp_exposed_s", "tp_s", "pp_send_s", "pp_bubble_s",
                                           "cp_s", "ep_all_to_all_s"))


def sweep(config: str, over: str, overrides: list[str], out: Path, warmup: int,
          steps: int) -> dict:
    cmd = [sys.executable, "-m", "tessel", "scale", config, "--measure", "--nproc", "1,2",
           "--over", over, "--warmup", str(warmup), "--steps", str(steps), "--out", str(out),
           "--json", *overrides]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/tiny.toml")
    p.add_argument("--over", default="dp,tp,pp")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--json", help="also write every sweep's record to this file")
    p.add_argument("overrides", nargs="*", help="after --: overrides of the config")
    a = p.parse_args()
    print(f"load average before: {os.getloadavg()}")
    rows, records = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for over in a.over.split(","):
                rec = sweep(a.config, over, a.overrides, Path(tmp) / f"{over}-{r}", a.warmup,
                            a.steps)
                records.append(rec)
                one, two = rec["points"]
                m1, m2 = one["measured"], two["measured"]
                pred = two["predicted"]
                rows.append({
                    "over": over, "round": r, "layout": two["layout"],
                    "measured_1": m1["tokens_per_s"], "measured_2": m2["tokens_per_s"],
                    "predicted_2": pred["tokens_per_s"],
                    "error": pred["tokens_per_s"] / m2["tokens_per_s"] - 1,
                    "comm_measured": m2["comm_exposed_s"],
                    "comm_predicted": waiting(pred["split_s"]),
                    "step_measured": m2["step_time_s"], "step_predicted": pred["step_time_s"],
                    "gloo": rec["measurement"]["machine"]["gloo"],
                })
    print(f"load average after: {os.getloadavg()}")
    print("\n| layout (2 processes) | round | 1 proc tokens/s | 2 procs measured | predicted | "
          "error | comm. measured s | predicted s | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        cm, cp = row["comm_measured"], row["comm_predicted"]
        comm_err = f"{cp / cm - 1:+.0%}" if cm else "-"
        print(f"| {row['layout']} | {row['round']} | {row['measured_1']:,.0f} | "
              f"{row['measured_2']:,.0f} | {row['predicted_2']:,.0f} | {row['error']:+.1%} | "
              f"{cm if cm is not None else float('nan'):.4f} | {cp:.4f} | {comm_err} |")
    print("\nmedian over rounds:")
    for over in a.over.split(","):
        mine = [r for r in rows if r["over"] == over]
        err = statistics.median(r["error"] for r in mine)
        comm = [r["comm_predicted"] / r["comm_measured"] - 1 for r in mine if r["comm_measured"]]
        print(f"  {over}: tokens/s error {err:+.1%}"
              + (f", communication error {statistics.median(comm):+.0%}" if comm else ""))
    if a.json:
        Path(a.json).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
