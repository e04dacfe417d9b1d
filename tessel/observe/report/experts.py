"""The report's "Expert load" section, for Mixture-of-Experts runs only: which figures it
shows, read from the MoE metrics the trainer logs (`tessel.train.moe_balance`).

    moe_load_imbalance_l{i}   max / mean tokens per expert of MoE layer i (1 = even)
    moe_aux_loss_l{i}         its balance loss (1 = even), moe_z_loss the mean router z-loss
    moe_dropped_frac          share of token slots dropped (with a capacity factor only)
    moe_expert_share_l{i}     each expert's share of layer i's token slots: a list

Line plots over steps (one line per MoE layer), and a heatmap per layer of the experts'
shares over steps. A dense run has none of these keys, and so no section.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence
from typing import Any

from tessel.observe.report.plots import Heatmap, Line, Plot
from tessel.observe.report.run import Run, num

MAX_LAYER_LINES = 6
"""Up to this many MoE layers, one line each (the palette's six colours); beyond, the worst,
median and best layer per step, so that lines stay tellable apart."""
MAX_HEAT_CELLS = 12_000
"""All heatmaps together (one SVG rect each): keeps a long run of a large model's page in
the low megabytes."""
MAX_HEAT_COLUMNS = 60
MIN_HEAT_COLUMNS = 8

_LAYER_KEY = re.compile(r"moe_(?:load_imbalance|aux_loss|expert_share)_l(\d+)")


def is_moe(run: Run) -> bool:
    return any(k.startswith("moe_") for r in run.train for k in r)


def moe_layers(train: Sequence[dict[str, Any]]) -> list[int]:
    """The MoE layers the records name, in order."""
    return sorted({int(m.group(1)) for r in train for k in r if (m := _LAYER_KEY.fullmatch(k))})


def expert_plots(run: Run) -> list[Plot]:
    """Load imbalance, balance loss, z-loss and dropped fraction over steps."""
    train, layers = run.train, moe_layers(run.train)
    model = (run.config or {}).get("model")
    capacity = model.get("moe_capacity_factor") if isinstance(model, dict) else None
    dropped_reason = ("dropless routing (no model.moe_capacity_factor): no token slot is dropped"
                      if capacity is None else "metrics.jsonl has no moe_dropped_frac values")
    return [
        Plot("plot-moe_load_imbalance", "Load imbalance per MoE layer (max / mean tokens per expert)",
             "max / mean", _per_layer(train, layers, "moe_load_imbalance"),
             "metrics.jsonl has no moe_load_imbalance_l* values"),
        Plot("plot-moe_aux_loss", "Balance loss per MoE layer (1 = even; unweighted)",
             "balance loss", _per_layer(train, layers, "moe_aux_loss"),
             "metrics.jsonl has no moe_aux_loss_l* values"),
        Plot("plot-moe_z_loss", "Router z-loss (mean over MoE layers; unweighted)", "z-loss",
             [Line.of(train, "moe_z_loss", "z-loss")], "metrics.jsonl has no moe_z_loss values"),
        Plot("plot-moe_dropped_frac", "Dropped token slots (capacity factor)", "% of slots",
             [Line.of(train, "moe_dropped_frac", "dropped", 100.0)], dropped_reason),
    ]


def _per_layer(train: Sequence[dict[str, Any]], layers: list[int], prefix: str) -> list[Line]:
    if len(layers) <= MAX_LAYER_LINES:
        return [Line.of(train, f"{prefix}_l{i}", f"layer {i}") for i in layers] or \
            [Line(prefix, prefix, [])]
    worst, median, best = [], [], []
    for r in train:
        values = [v for i in layers if (v := num(r.get(f"{prefix}_l{i}"))) is not None
                  and math.isfinite(v)]
        if values:
            worst.append((r["step"], max(values)))
            median.append((r["step"], statistics.median(values)))
            best.append((r["step"], min(values)))
    n = len(layers)
    return [Line(f"{prefix}_max", f"worst of {n} layers", worst),
            Line(f"{prefix}_median", "median layer", median),
            Line(f"{prefix}_min", "best layer", best)]


def expert_heatmaps(run: Run) -> tuple[list[Heatmap], str]:
    """One heatmap of the experts' token shares over steps per MoE layer (evenly chosen
    layers when all of them would pass MAX_HEAT_CELLS), and a note saying which are shown."""
    train, layers = run.train, moe_layers(run.train)
    model = (run.config or {}).get("model")
    experts = model.get("moe_experts") if isinstance(model, dict) else None
    shares = {i: _shares(train, i, experts) for i in layers}
    width = max((len(v) for rows in shares.values() for _, v in rows), default=0)
    note = ""
    shown = layers
    if width and len(layers) * width * MIN_HEAT_COLUMNS > MAX_HEAT_CELLS:
        keep = max(1, MAX_HEAT_CELLS // (width * MIN_HEAT_COLUMNS))
        shown = sorted({layers[round(j * (len(layers) - 1) / max(keep - 1, 1))] for j in range(keep)})
        note = (f"{len(shown)} of the {len(layers)} MoE layers are shown (evenly spaced), to keep "
                "this page small; metrics.jsonl holds them all.")
    columns = min(MAX_HEAT_COLUMNS, max(MIN_HEAT_COLUMNS, MAX_HEAT_CELLS // max(len(shown) * width, 1)))
    heatmaps = []
    for i in shown:
        bounds, values = _columns(shares[i], columns)
        heatmaps.append(Heatmap(
            f"heatmap-moe-l{i}", f"Token share per expert, MoE layer {i}", "expert", bounds,
            values, f"metrics.jsonl has no moe_expert_share_l{i} values (runs before tessel "
            "logged them)", {"data-layer": i}))
    return heatmaps, note


def _shares(train: Sequence[dict[str, Any]], layer: int,
            experts: Any) -> list[tuple[int, list[float | None]]]:
    """(step, shares) of the records whose `moe_expert_share_l{layer}` is a list of numbers
    of the model's expert count (others, e.g. damaged lines, are left out)."""
    out = []
    for r in train:
        value = r.get(f"moe_expert_share_l{layer}")
        if not isinstance(value, list) or not value:
            continue
        if isinstance(experts, int) and len(value) != experts:
            continue
        shares = [num(v) for v in value]
        out.append((r["step"], [v if v is not None and math.isfinite(v) else None for v in shares]))
    return out


def _columns(rows: list[tuple[int, list[float | None]]], limit: int
             ) -> tuple[list[tuple[int, int]], list[list[float | None]]]:
    """At most `limit` columns of consecutive records, each the mean of its records' shares:
    (first step, last step) per column and the values [expert][column]."""
    if not rows:
        return [], []
    width = max(len(v) for _, v in rows)
    size = math.ceil(len(rows) / limit)
    bounds: list[tuple[int, int]] = []
    values: list[list[float | None]] = [[] for _ in range(width)]
    for start in range(0, len(rows), size):
        chunk = rows[start:start + size]
        bounds.append((chunk[0][0], chunk[-1][0]))
        for e in range(width):
            got = [x for _, v in chunk if e < len(v) and (x := v[e]) is not None]
            values[e].append(sum(got) / len(got) if got else None)
    return bounds, values
