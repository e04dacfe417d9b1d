"""The report's plots: which series each shows (`build_plots`), drawn as inline SVG
(`render_plot`) with nice ticks, gaps and red crosses for nan/inf, and event markers; and
heatmaps (`render_heatmap`: the MoE experts' token shares over steps)."""

from __future__ import annotations

import html
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tessel.observe.metrics import SCORE_PREFIX
from tessel.observe.report.run import Run, event_message, num, series
from tessel.observe.secrets import Redactor

MAX_POINTS = 2000  # per series; longer series are reduced to per-bucket min/max

# Plot geometry (SVG user units; the SVG scales to its column's width).
_W, _H = 600, 290
_X0, _X1, _Y0, _Y1 = 64, _W - 16, 40, _H - 42  # the plot area inside; legend above, ticks below
_PALETTE = ("#2563eb", "#ea580c", "#16a34a", "#9333ea", "#0891b2", "#be185d")
# Events drawn as vertical markers on the loss plot.
_MARKERS = {"rollback": "#dc2626", "alert": "#ca8a04", "restart": "#7c3aed", "resume": "#64748b",
            "world_shrink": "#ea580c", "world_grow": "#0d9488", "replicas_lost": "#ea580c",
            "replicas_joined": "#0d9488", "replica_healed": "#0891b2"}
_NONFINITE = "#b91c1c"
# Memory series by key (any other mem_*_gib key is plotted too, under its own name).
_MEMORY_LABELS = {"mem_allocated_gib": "allocated", "mem_reserved_gib": "reserved",
                  "mem_peak_gib": "peak allocated", "mem_gib": "peak allocated",
                  "mem_rss_gib": "host RSS", "mem_rss_peak_gib": "host RSS peak"}


@dataclass
class Line:
    key: str
    label: str
    points: list[tuple[int, float]]  # (step, value); nan/inf values are drawn as gaps
    dots: bool = False  # sparse series (validation) also get a dot per point

    @classmethod
    def of(cls, records: Sequence[dict[str, Any]], key: str, label: str, scale: float = 1.0,
           dots: bool = False) -> Line:
        """The line of metric `key` over `records` (values scaled by `scale`), steps without
        the metric left out."""
        return cls(key, label, [(s, v * scale) for s, v in series(records, key) if v is not None],
                   dots)

    @property
    def finite(self) -> list[tuple[int, float]]:
        return [(x, y) for x, y in self.points if math.isfinite(y)]

    @property
    def nonfinite(self) -> list[tuple[int, float]]:
        return [(x, y) for x, y in self.points if not math.isfinite(y)]


@dataclass
class Marker:
    step: int
    kind: str
    message: str


@dataclass
class Plot:
    id: str
    title: str
    ylabel: str
    lines: list[Line]
    empty_reason: str
    markers: list[Marker] = field(default_factory=list)


@dataclass
class Heatmap:
    """Rows x columns of shares, coloured against the even share 1 / rows."""

    id: str
    title: str
    ylabel: str
    columns: list[tuple[int, int]]  # (first step, last step) of the records in each column
    values: list[list[float | None]]  # [row][column]; None: no finite value there
    empty_reason: str
    attrs: dict[str, str | int] = field(default_factory=dict)  # more data-* attributes


def build_plots(run: Run) -> list[Plot]:
    """The report's plots, always all of them: loss (with event markers), lr, grad norm,
    throughput, MFU, memory, step time, and compute vs exposed communication; one without
    data says why in `empty_reason`. A run with benchmark scores (lm_eval) also gets their
    plot, one line per task metric."""
    train, val = run.train, run.val

    def line(key: str, label: str, records: Sequence[dict[str, Any]] = train, scale: float = 1.0,
             dots: bool = False) -> Line:
        return Line.of(records, key, label, scale, dots)

    device = (run.run_info or {}).get("device_name") or (run.run_info or {}).get("device")
    mfu_known = any(num(r.get("mfu")) is not None for r in train)
    if mfu_known or not any("mfu" in r for r in train):
        mfu_reason = "metrics.jsonl has no MFU values"
        if not mfu_known and device:
            mfu_reason += f" (no dense BF16 peak known for device {device!r})"
    else:
        mfu_reason = f"MFU unknown: no dense BF16 peak known for device {device or '?'!r}"

    mem_keys = sorted({k for r in train for k in r if re.fullmatch(r"mem_\w+_gib|mem_gib", k)},
                      key=lambda k: (list(_MEMORY_LABELS).index(k) if k in _MEMORY_LABELS else 99, k))
    memory = [line(k, _MEMORY_LABELS.get(k, k.removeprefix("mem_").removesuffix("_gib")))
              for k in mem_keys]
    tps = line("tokens_per_s", "tokens/s (all devices)")
    tps_dev = line("tokens_per_s_per_device", "tokens/s per device")
    throughput = [tps]
    if tps_dev.points and dict(tps_dev.points) != dict(tps.points):
        throughput.append(tps_dev)
    timing = [line(k, label) for k, label in (
        ("step_time_s", "step"), ("time_data_s", "data"), ("time_compute_s", "compute"),
        ("time_optimizer_s", "optimizer")) if any(k in r for r in train)]

    comm = [Line("computation_s", "computation (compute + optimizer, less exposed comm.)",
                 _computing(train)),
            line("time_comm_exposed_s", "exposed communication"),
            line("time_comm_s", "all communication (hidden or exposed)")]

    markers = [Marker(e["step"], str(e.get("kind")), event_message(e))
               for e in run.events if e.get("kind") in _MARKERS
               and isinstance(e.get("step"), int) and not isinstance(e.get("step"), bool)]
    plots = [
        Plot("plot-loss", "Loss", "loss",
             [line("loss", "train loss"), line("val_loss", "val loss", val, dots=True)],
             "metrics.jsonl has no loss values yet", markers),
        Plot("plot-lr", "Learning rate", "lr", [line("lr", "lr")],
             "metrics.jsonl has no lr values"),
        Plot("plot-grad_norm", "Gradient norm (before clipping)", "grad norm",
             [line("grad_norm", "grad norm")], "metrics.jsonl has no grad_norm values"),
        Plot("plot-tokens_per_s", "Throughput", "tokens/s", throughput,
             "metrics.jsonl has no tokens_per_s values"),
        Plot("plot-mfu", "Model FLOPs utilisation", "MFU (%)", [line("mfu", "MFU", scale=100.0)],
             mfu_reason),
        Plot("plot-memory", "Memory", "GiB", memory or [Line("memory", "memory", [])],
             "no memory metrics in metrics.jsonl (none are logged for this device)"),
        Plot("plot-step_time", "Step time", "seconds", timing or [Line("step_time_s", "step", [])],
             "metrics.jsonl has no step timings"),
        Plot("plot-comm", "Compute vs exposed communication", "seconds per step", comm,
             "metrics.jsonl has no communication figures (metrics.comm_sample_interval = 0, or "
             "a run older than them)"),
    ]
    if run.scores:  # a run without lm_eval tasks has no such plot
        keys = sorted({k for r in run.scores for k in r if k.startswith(SCORE_PREFIX)})
        plots.append(Plot("plot-scores", "Benchmark scores (lm_eval)", "score",
                          [line(k, k.removeprefix(SCORE_PREFIX), run.scores, dots=True)
                           for k in keys], "metrics.jsonl has no benchmark scores"))
    return plots


def _computing(train: Sequence[dict[str, Any]]) -> list[tuple[int, float]]:
    """(step, seconds) of the compute and optimizer phases less the exposed communication
    inside them, at the log steps that have the communication figures (sampled steps,
    metrics.comm_sample_interval)."""
    out = []
    for r in train:
        exposed, compute, optimizer = (num(r.get(k)) for k in (
            "time_comm_exposed_s", "time_compute_s", "time_optimizer_s"))
        if exposed is not None and compute is not None and optimizer is not None:
            out.append((r["step"], max(compute + optimizer - exposed, 0.0)))
    return out


def _nice_step(span: float, target: int = 5) -> float:
    raw = span / max(target, 1)
    mag = 10 ** math.floor(math.log10(raw))
    for mult in (1, 2, 2.5, 5, 10):
        if raw <= mult * mag:
            return mult * mag
    return 10 * mag


def _ticks(lo: float, hi: float, target: int = 5) -> tuple[float, float, list[float]]:
    """A nice axis range covering [lo, hi] and its ticks."""
    if hi == lo:
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    step = _nice_step(hi - lo, target)
    start, stop = math.floor(lo / step) * step, math.ceil(hi / step) * step
    n = int(round((stop - start) / step))
    return start, stop, [start + i * step for i in range(n + 1)]


def _tick_labels(ticks: Sequence[float]) -> list[str]:
    """Labels for evenly spaced ticks: as many decimals as the spacing needs, k/M/G for large
    values, a shared exponent for tiny ones (learning rates)."""
    step = abs(ticks[1] - ticks[0]) if len(ticks) > 1 else 1.0
    top = max(abs(t) for t in ticks) or 1.0
    if top >= 1e4:
        scale, suffix = next((s, x) for s, x in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))
                             if top >= s)
        return [_fixed(t / scale, step / scale) + (suffix if _fixed(t / scale, step / scale) != "0"
                                                   else "") for t in ticks]
    if step < 1e-3:
        exp = math.floor(math.log10(top))
        labels = [_fixed(t / 10**exp, step / 10**exp) for t in ticks]
        return [label if label == "0" else f"{label}e{exp}" for label in labels]
    return [_fixed(t, step) for t in ticks]


def _fixed(value: float, step: float) -> str:
    decimals = 0
    while decimals < 8 and abs(round(step, decimals) - step) > step * 1e-6:
        decimals += 1
    text = f"{value:.{decimals}f}"
    return "0" if float(text) == 0 else text


def _decimate(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """At most about MAX_POINTS points: each bucket keeps its lowest and highest value (so
    spikes survive) and a gap if it held a non-finite one."""
    if len(points) <= MAX_POINTS:
        return points
    size = math.ceil(len(points) / (MAX_POINTS // 2))
    out: list[tuple[int, float]] = []
    for i in range(0, len(points), size):
        chunk = points[i:i + size]
        good = [p for p in chunk if math.isfinite(p[1])]
        if good:
            lo, hi = min(good, key=lambda p: p[1]), max(good, key=lambda p: p[1])
            out.extend(sorted({lo, hi}))
        if len(good) < len(chunk):
            out.append((chunk[-1][0], math.nan))
    return out


def esc(text: Any) -> str:
    """`str(text)` escaped for HTML text and attribute values."""
    return html.escape(str(text), quote=True)


def page_head(title: str, css: str) -> list[str]:
    """The opening lines of a self-contained page, up to <main>: nothing on it is fetched
    (inline styles and inline SVG only, which its Content-Security-Policy enforces)."""
    return [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
        "style-src 'unsafe-inline'; img-src data:\">",
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{esc(title)}</title>",
        f"<style>{css}</style></head><body><main>",
    ]


def render_plot(plot: Plot, redact: Redactor) -> str:
    """A <figure id=plot.id> with an inline SVG chart, or its "no data: <reason>" placeholder.
    Its data-* attributes say what it shows: series, finite points, non-finite values,
    markers, and the data's range."""
    finite = [p for ln in plot.lines for p in ln.finite]
    attrs = {"class": "plot", "id": plot.id,
             "data-series": " ".join(ln.key for ln in plot.lines if ln.points),
             "data-points": len(finite),
             "data-nonfinite": sum(len(ln.nonfinite) for ln in plot.lines),
             "data-markers": len(plot.markers), "data-empty": "false" if finite else "true"}
    if finite:
        attrs.update({"data-xmin": min(x for x, _ in finite), "data-xmax": max(x for x, _ in finite),
                      "data-ymin": repr(min(y for _, y in finite)),
                      "data-ymax": repr(max(y for _, y in finite))})
        body = _chart(plot, redact)
    else:
        reason = redact.text(plot.empty_reason)
        if any(ln.points for ln in plot.lines):
            reason = "every logged value is non-finite (nan/inf)"
        attrs["data-reason"] = reason
        body = _placeholder(reason)
    head = " ".join(f'{k}="{esc(v)}"' for k, v in attrs.items())
    return (f'<figure {head}><figcaption>{esc(plot.title)}</figcaption>'
            f'<svg viewBox="0 0 {_W} {_H}" role="img" aria-label="{esc(plot.title)}">'
            f"{body}</svg></figure>")


def _placeholder(reason: str) -> str:
    return (f'<rect class="frame" x="{_X0}" y="{_Y0}" width="{_X1 - _X0}" height="{_Y1 - _Y0}" '
            f'fill="#f8fafc" stroke="#cbd5e1" stroke-dasharray="4 3"/>'
            f'<text class="nodata" x="{(_X0 + _X1) / 2}" y="{(_Y0 + _Y1) / 2}" text-anchor="middle" '
            f'dominant-baseline="middle">no data: {esc(reason)}</text>')


@dataclass
class _Scale:
    """Data coordinates (step, value) to SVG coordinates in the plot area."""

    x_lo: float
    x_hi: float
    y_lo: float
    y_hi: float

    def x(self, step: float) -> float:
        return _X0 + (step - self.x_lo) / (self.x_hi - self.x_lo) * (_X1 - _X0)

    def y(self, value: float) -> float:
        return _Y1 - (value - self.y_lo) / (self.y_hi - self.y_lo) * (_Y1 - _Y0)


def _chart(plot: Plot, redact: Redactor) -> str:
    xs = [x for ln in plot.lines for x, _ in ln.points] + [m.step for m in plot.markers]
    ys = [y for ln in plot.lines for _, y in ln.finite]
    x_lo, x_hi, x_ticks = _ticks(min(xs), max(xs), 6)
    y_lo, y_hi, y_ticks = _ticks(min(ys), max(ys), 5)
    scale = _Scale(x_lo, x_hi, y_lo, y_hi)
    return "".join([_axes(plot.ylabel, scale, x_ticks, y_ticks), _markers(plot.markers, scale, redact),
                    *(_line(ln, _PALETTE[i % len(_PALETTE)], scale) for i, ln in enumerate(plot.lines)),
                    _legend(plot)])


def _axes(ylabel: str, scale: _Scale, x_ticks: list[float], y_ticks: list[float]) -> str:
    out = ['<g class="grid" stroke="#e2e8f0" stroke-width="1">']
    out += [f'<line x1="{_X0}" x2="{_X1}" y1="{scale.y(t):.1f}" y2="{scale.y(t):.1f}"/>'
            for t in y_ticks]
    out.append(f'</g><g class="axes" stroke="#475569" stroke-width="1">'
               f'<line x1="{_X0}" x2="{_X0}" y1="{_Y0}" y2="{_Y1}"/>'
               f'<line x1="{_X0}" x2="{_X1}" y1="{_Y1}" y2="{_Y1}"/></g>')
    out.append('<g class="yticks" font-size="11" fill="#334155" text-anchor="end">')
    out += [f'<text x="{_X0 - 6}" y="{scale.y(t) + 4:.1f}">{esc(label)}</text>'
            for t, label in zip(y_ticks, _tick_labels(y_ticks))]
    out.append('</g><g class="xticks" font-size="11" fill="#334155" text-anchor="middle">')
    for t, label in zip(x_ticks, _tick_labels(x_ticks)):
        x = scale.x(t)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{_Y1}" y2="{_Y1 + 4}" stroke="#475569"/>'
                   f'<text x="{x:.1f}" y="{_Y1 + 16}">{esc(label)}</text>')
    out.append(f'</g><text class="xlabel" x="{(_X0 + _X1) / 2}" y="{_H - 6}" font-size="12" '
               f'fill="#334155" text-anchor="middle">step</text>'
               f'<text class="ylabel" transform="translate(14 {(_Y0 + _Y1) / 2}) rotate(-90)" '
               f'font-size="12" fill="#334155" text-anchor="middle">{esc(ylabel)}</text>')
    return "".join(out)


def _markers(markers: list[Marker], scale: _Scale, redact: Redactor) -> str:
    """Dashed vertical lines at events' steps; several at one step sit side by side."""
    count: dict[int, int] = {}
    for m in markers:
        count[m.step] = count.get(m.step, 0) + 1
    placed: dict[int, int] = {}
    out = []
    for m in markers:
        k = placed[m.step] = placed.get(m.step, -1) + 1
        x = scale.x(m.step) + 3.0 * (k - (count[m.step] - 1) / 2)
        out.append(f'<line class="marker" data-kind="{esc(m.kind)}" data-step="{m.step}" '
                   f'x1="{x:.1f}" x2="{x:.1f}" y1="{_Y0}" y2="{_Y1}" stroke="{_MARKERS[m.kind]}" '
                   f'stroke-width="1.5" stroke-dasharray="5 3"><title>{esc(m.kind)} at step '
                   f"{m.step}: {esc(redact.text(m.message))}</title></line>")
    return "".join(out)


def _line(ln: Line, color: str, scale: _Scale) -> str:
    """One series: a polyline per run of finite values (a nan/inf value leaves a gap and a
    red cross at the top edge); dots where a point has no neighbour, or for sparse series."""
    segments: list[list[tuple[float, float]]] = [[]]
    for x, y in _decimate(ln.points):
        if not math.isfinite(y):
            if segments[-1]:
                segments.append([])
        else:
            segments[-1].append((scale.x(x), scale.y(y)))
    out = [f'<polyline class="series" data-series="{esc(ln.key)}" fill="none" stroke="{color}" '
           f'stroke-width="1.6" stroke-linejoin="round" '
           f'points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in seg)}"/>'
           for seg in segments if len(seg) > 1]
    dots = [seg[0] for seg in segments if len(seg) == 1]
    if ln.dots:
        dots = [(scale.x(x), scale.y(y)) for x, y in ln.finite]
    if dots:
        out.append(f'<g class="dots" data-series="{esc(ln.key)}" fill="{color}">')
        out += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.8"/>' for x, y in dots]
        out.append("</g>")
    for x, y in ln.nonfinite:
        out.append(f'<path class="nonfinite" data-series="{esc(ln.key)}" data-step="{x}" '
                   f'd="M{scale.x(x) - 4:.1f},{_Y0 + 2} l8,8 m0,-8 l-8,8" stroke="{_NONFINITE}" '
                   f'stroke-width="2"><title>{esc(ln.label)} at step {x}: {y}</title></path>')
    return "".join(out)


def _legend(plot: Plot) -> str:
    """Above the plot area, wrapping to a second row when it is long."""
    items = [(ln.label + ("" if ln.points else " (no data)"), _PALETTE[i % len(_PALETTE)], "line")
             for i, ln in enumerate(plot.lines)]
    items += [(kind, _MARKERS[kind], "marker") for kind in sorted({m.kind for m in plot.markers})]
    if any(ln.nonfinite for ln in plot.lines):
        items.append(("nan/inf", _NONFINITE, "cross"))
    out = ['<g class="legend" font-size="11" fill="#1e293b">']
    x, y = float(_X0), 12
    for label, color, style in items:
        width = 23 + 6.3 * len(label) + 14
        if x + width > _W and x > _X0:
            x, y = float(_X0), y + 15
        if style == "cross":
            out.append(f'<path d="M{x + 5:.1f},{y - 4} l8,8 m0,-8 l-8,8" stroke="{color}" '
                       f'stroke-width="2"/>')
        else:
            dash = ' stroke-dasharray="5 3"' if style == "marker" else ""
            out.append(f'<line x1="{x:.1f}" x2="{x + 18:.1f}" y1="{y}" y2="{y}" stroke="{color}" '
                       f'stroke-width="2"{dash}/>')
        out.append(f'<text x="{x + 23:.1f}" y="{y + 4}">{esc(label)}</text>')
        x += width
    out.append("</g>")
    return "".join(out)


# ---- heatmaps -------------------------------------------------------------------------------

_UNDER, _OVER, _MISSING = (0x25, 0x63, 0xEB), (0xDC, 0x26, 0x26), "#cbd5e1"


def share_colour(share: float | None, rows: int) -> str:
    """White at the even share 1/rows, bluer below it (fully at 0), redder above it (fully
    at twice it or more); grey without a value."""
    if share is None or not math.isfinite(share):
        return _MISSING
    ratio = share * rows
    target, t = (_UNDER, 1.0 - max(ratio, 0.0)) if ratio <= 1 else (_OVER, min(ratio - 1.0, 1.0))
    r, g, b = (round(255 + (c - 255) * t) for c in target)
    return f"#{r:02x}{g:02x}{b:02x}"


def render_heatmap(heat: Heatmap) -> str:
    """A <figure id=heat.id> with an inline SVG heatmap (rows top to bottom, columns left to
    right) and its colour key, or the "no data: <reason>" placeholder; data-rows/-columns
    and the step range as attributes."""
    cells = sum(v is not None for row in heat.values for v in row)
    attrs: dict[str, str | int] = {
        "class": "plot heatmap", "id": heat.id, "data-rows": len(heat.values),
        "data-columns": len(heat.columns), "data-cells": cells,
        "data-empty": "false" if cells else "true", **heat.attrs}
    if cells:
        attrs.update({"data-xmin": heat.columns[0][0], "data-xmax": heat.columns[-1][1]})
        body = _heat_cells(heat) + _heat_axes(heat) + _heat_key(len(heat.values))
    else:
        attrs["data-reason"] = heat.empty_reason
        body = _placeholder(heat.empty_reason)
    head = " ".join(f'{k}="{esc(v)}"' for k, v in attrs.items())
    return (f'<figure {head}><figcaption>{esc(heat.title)}</figcaption>'
            f'<svg viewBox="0 0 {_W} {_H}" role="img" aria-label="{esc(heat.title)}">'
            f"{body}</svg></figure>")


def _heat_cells(heat: Heatmap) -> str:
    rows, cols = len(heat.values), len(heat.columns)
    w, h = (_X1 - _X0) / cols, (_Y1 - _Y0) / rows
    out = ['<g class="cells" shape-rendering="crispEdges">']
    for r, row in enumerate(heat.values):
        for c, value in enumerate(row):
            # A hair wider than the cell: no seams between neighbours when scaled.
            out.append(f'<rect x="{_X0 + c * w:.1f}" y="{_Y0 + r * h:.1f}" width="{w + 0.3:.1f}" '
                       f'height="{h + 0.3:.1f}" fill="{share_colour(value, rows)}"/>')
    out.append("</g>")
    return "".join(out)


def _heat_axes(heat: Heatmap) -> str:
    rows, cols = len(heat.values), len(heat.columns)
    w, h = (_X1 - _X0) / cols, (_Y1 - _Y0) / rows
    out = [f'<rect x="{_X0}" y="{_Y0}" width="{_X1 - _X0}" height="{_Y1 - _Y0}" fill="none" '
           f'stroke="#475569" stroke-width="1"/>',
           '<g class="yticks" font-size="11" fill="#334155" text-anchor="end">']
    every = max(1, math.ceil(rows / 16))  # at most 16 row labels
    out += [f'<text x="{_X0 - 6}" y="{_Y0 + (r + 0.5) * h + 4:.1f}">{r}</text>'
            for r in range(0, rows, every)]
    out.append('</g><g class="xticks" font-size="11" fill="#334155" text-anchor="middle">')
    every = max(1, math.ceil(cols / 7))  # at most 7 step labels, the last column's included
    for c in sorted({*range(0, cols, every), cols - 1}):
        first, last = heat.columns[c]
        x = _X0 + (c + 0.5) * w
        label = f"{first:,}" if first == last else f"{first:,}-{last:,}"
        out.append(f'<text x="{x:.1f}" y="{_Y1 + 16}">{esc(label)}</text>')
    out.append(f'</g><text class="xlabel" x="{(_X0 + _X1) / 2}" y="{_H - 6}" font-size="12" '
               f'fill="#334155" text-anchor="middle">step</text>'
               f'<text class="ylabel" transform="translate(14 {(_Y0 + _Y1) / 2}) rotate(-90)" '
               f'font-size="12" fill="#334155" text-anchor="middle">{esc(heat.ylabel)}</text>')
    return "".join(out)


def _heat_key(rows: int) -> str:
    """The colour scale above the heatmap: 0, the even share, twice it."""
    x, y, width = float(_X0), 8, 140
    stops = 12
    out = ['<g class="legend" font-size="11" fill="#1e293b">']
    out += [f'<rect x="{x + i * width / stops:.1f}" y="{y}" width="{width / stops + 0.3:.1f}" '
            f'height="10" fill="{share_colour(2 * i / (stops - 1) / rows, rows)}"/>'
            for i in range(stops)]
    out.append(f'<rect x="{x}" y="{y}" width="{width}" height="10" fill="none" stroke="#94a3b8"/>')
    out.append(f'<text x="{x + width + 8:.1f}" y="{y + 9}">token share: 0 (blue), 1/{rows} '
               f'even (white), 2/{rows}+ (red)</text></g>')
    return "".join(out)
