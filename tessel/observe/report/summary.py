"""The figures at the top of the report, and how numbers are written there."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from tessel.observe.report.run import Run, finite, num, series

# Throughput and MFU medians leave out the first records (compilation, allocator warm-up),
# as the planner's calibration does.
WARMUP_RECORDS = 2
# The summary's peak memory: the first of these with data.
_PEAK_MEMORY = ((("mem_peak_gib", "mem_gib"), "peak allocated"), (("mem_reserved_gib",), "reserved"),
                (("mem_allocated_gib",), "allocated"), (("mem_rss_peak_gib",), "host RSS peak"),
                (("mem_rss_gib",), "host RSS"))


def fmt(value: float | None, digits: int = 4) -> str:
    """A figure for a reader: `digits` significant digits, exponent notation when very large
    or small, nan/inf as such, "—" for no value."""
    if value is None:
        return "—"
    if not math.isfinite(value):
        return str(value)  # nan, inf, -inf
    if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-3):
        return f"{value:.{digits - 1}e}"
    return f"{value:.{digits}g}"


def _fmt_count(n: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.0f}"


def _fmt_duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else f"{m}m {s:02d}s"


def summary(run: Run) -> list[tuple[str, str, str]]:
    """(key, label, value) figures for the top of the page."""
    train, val = run.train, run.val
    out: list[tuple[str, str, str]] = []

    steps = [r["step"] for r in train] or [r["step"] for r in run.val]
    train_cfg = (run.config or {}).get("train")
    planned = train_cfg.get("steps") if isinstance(train_cfg, dict) else None
    done = max(steps) if steps else None
    if isinstance(planned, int) and planned > 0 and done is not None:
        steps_text = f"{done:,} / {planned:,} ({100 * done / planned:.0f}%)"
    else:
        steps_text = f"{done:,}" if done is not None else "—"
        if isinstance(planned, int):
            steps_text += f" / {planned:,}"
    out.append(("steps", "steps done / train.steps", steps_text))

    tokens = finite(num(r.get("tokens_seen")) for r in [*train, *val])
    out.append(("tokens_seen", "tokens seen",
                f"{max(tokens):,.0f} ({_fmt_count(max(tokens))})" if tokens else "—"))

    losses = series(train, "loss")
    out.append(("final_loss", "final train loss",
                f"{fmt(losses[-1][1])} at step {losses[-1][0]:,}" if losses else "—"))

    vals = [(v, s) for s, v in series(val, "val_loss") if v is not None and math.isfinite(v)]
    if vals:
        best, at = min(vals)
        out.append(("best_val_loss", "best val loss", f"{fmt(best)} at step {at:,}"))
    else:
        out.append(("best_val_loss", "best val loss", "no validation" if not val else "no finite value"))

    tps = finite(v for _, v in series(train, "tokens_per_s"))
    tps = tps[WARMUP_RECORDS:] if len(tps) > WARMUP_RECORDS else tps
    out.append(("tokens_per_s", "median tokens/s",
                f"{statistics.median(tps):,.0f}" if tps else "—"))

    mfu = finite(v for _, v in series(train, "mfu"))
    mfu = mfu[WARMUP_RECORDS:] if len(mfu) > WARMUP_RECORDS else mfu
    out.append(("mfu", "median MFU", f"{100 * statistics.median(mfu):.1f}%" if mfu else "unknown"))

    out.append(("peak_memory", "peak memory", _peak_memory(train)))

    elapsed = finite(num(r.get("elapsed_s")) for r in [*train, *val])
    out.append(("wall_time", "wall time", _fmt_duration(max(elapsed)) if elapsed else "—"))

    kinds = [str(e.get("kind")) for e in run.events]
    for kind, label in (("alert", "alerts"), ("rollback", "rollbacks"), ("restart", "restarts")):
        out.append((f"{kind}s", label, str(kinds.count(kind))))
    # an elastic run's lost and returned nodes (events world_shrink, world_grow)
    out.append(("world_changes", "world size changes",
                f"{kinds.count('world_shrink')} shrink, {kinds.count('world_grow')} grow"))
    # fault tolerance: replica groups lost and back, and this group's recoveries from a peer
    if any(k.startswith("replica") for k in kinds):
        out.append(("replica_changes", "replica groups",
                    f"{kinds.count('replicas_lost')} lost, {kinds.count('replicas_joined')} "
                    f"joined, {kinds.count('replica_healed')} recovered from a peer"))
    return out


def _peak_memory(train: Sequence[dict[str, Any]]) -> str:
    for keys, label in _PEAK_MEMORY:
        values = finite(num(r.get(k)) for r in train for k in keys)
        if values:
            return f"{max(values):.2f} GiB ({label})"
    return "no data"

