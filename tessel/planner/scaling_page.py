"""The HTML page of `tessel scale --html`: one self-contained file (inline CSS and inline SVG,
no script; a Content-Security-Policy forbids fetching anything), drawn in the style of the
run report (`tessel report`): the same figure cards, plot size, colours and fonts.

Curves against the GPU count: tokens/s per GPU, MFU and scaling efficiency (with the ideal,
1). The GPU counts sit one slot apart, so a sweep of doublings reads as a log axis. The
step-time split is a stacked bar per count: each part's share of the step. A count where
nothing fits leaves a gap in the curves and a labelled empty bar. Every figure carries
data-* attributes saying what it shows (the tests read them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

from tessel.observe.report.plots import esc, page_head
from tessel.planner.memory import GIB
from tessel.planner.report import columns
from tessel.planner.scaling import (
    COMMUNICATION,
    SPLIT,
    STRONG,
    Point,
    Sweep,
    header,
    point_record,
    rank_word,
    seconds,
    short_by,
    split,
)

# The report's plot geometry (SVG user units) and colours.
W, H = 600, 270
LEFT, RIGHT, TOP, BOTTOM = 64, W - 16, 12, H - 42
BLUE, ORANGE, GREY = "#2563eb", "#ea580c", "#94a3b8"
PART_COLOURS = {"compute_s": BLUE, "dp_exposed_s": ORANGE, "tp_s": "#9333ea",
                "pp_bubble_s": GREY, "pp_send_s": "#0891b2", "cp_s": "#16a34a",
                "ep_all_to_all_s": "#be185d", "optimizer_s": "#ca8a04", "offload_s": "#475569"}

CSS = """
* { box-sizing: border-box; }
body { margin: 0; background: #f1f5f9; color: #0f172a;
  font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; }
main { max-width: 1240px; margin: 0 auto; padding: 24px; }
h1 { font-size: 24px; margin: 0 0 4px; }
h2 { font-size: 17px; margin: 28px 0 10px; }
p.sub { color: #475569; margin: 0 0 16px; }
div.plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(540px, 1fr)); gap: 14px; }
figure.plot { margin: 0; background: #fff; border: 1px solid #e2e8f0; border-radius: 8px;
  padding: 10px 12px; }
figure.plot figcaption { font-weight: 600; margin-bottom: 4px; }
figure.plot svg { width: 100%; height: auto; display: block; }
div.legend { font-size: 12px; color: #1e293b; }
span.key { display: inline-flex; align-items: center; gap: 5px; margin-right: 14px; }
span.key svg { width: 18px; }
table { border-collapse: collapse; width: 100%; background: #fff; border: 1px solid #e2e8f0; }
th, td { text-align: left; padding: 5px 9px; border-bottom: 1px solid #e2e8f0; }
th { background: #f8fafc; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.reason { color: #991b1b; }
td.layout { font: 12px/1.4 ui-monospace, Menlo, Consolas, monospace; min-width: 260px; }
div.wide { overflow-x: auto; }
footer, details { color: #64748b; margin-top: 20px; font-size: 12px; }
"""


@dataclass
class Series:
    key: str
    label: str
    colour: str
    values: list[float | None]  # one per GPU count; None: no layout there
    dashed: bool = False


def _axis(top: float) -> list[float]:
    """Ticks from 0 to a round value at or above `top`, 1, 2 or 5 x a power of ten apart."""
    top = top if top > 0 and math.isfinite(top) else 1.0
    unit = 10.0 ** math.floor(math.log10(top / 5))
    step = next(m * unit for m in (1, 2, 5, 10) if 5 * m * unit >= top)
    return [i * step for i in range(math.ceil(top / step - 1e-9) + 1)]


def _slot(i: int, n: int) -> float:
    return LEFT + (i + 0.5) * (RIGHT - LEFT) / n


def _frame(labels: Sequence[str], ticks: list[float], ylabel: str,
           fmt: Callable[[float], str], unit: str) -> tuple[str, Callable[[float], float]]:
    """Grid, axes, tick labels and axis titles (`unit`: what the x axis counts, GPUs or
    processes); and the value -> SVG y mapping."""
    top = ticks[-1]

    def y(v: float) -> float:
        return BOTTOM - v / top * (BOTTOM - TOP)

    out = ['<g class="grid" stroke="#e2e8f0" stroke-width="1">']
    out += [f'<line x1="{LEFT}" x2="{RIGHT}" y1="{y(t):.1f}" y2="{y(t):.1f}"/>' for t in ticks]
    out.append(f'</g><g class="axes" stroke="#475569" stroke-width="1">'
               f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{BOTTOM}"/>'
               f'<line x1="{LEFT}" x2="{RIGHT}" y1="{BOTTOM}" y2="{BOTTOM}"/></g>'
               '<g class="yticks" font-size="11" fill="#334155" text-anchor="end">')
    out += [f'<text x="{LEFT - 6}" y="{y(t) + 4:.1f}">{esc(fmt(t))}</text>' for t in ticks]
    out.append('</g><g class="xticks" font-size="11" fill="#334155" text-anchor="middle">')
    out += [f'<text x="{_slot(i, len(labels)):.1f}" y="{BOTTOM + 16}">{esc(label)}</text>'
            for i, label in enumerate(labels)]
    out.append(f'</g><text x="{(LEFT + RIGHT) / 2}" y="{H - 6}" font-size="12" fill="#334155" '
               f'text-anchor="middle">{unit}</text><text transform="translate(14 '
               f'{(TOP + BOTTOM) / 2}) rotate(-90)" font-size="12" fill="#334155" '
               f'text-anchor="middle">{esc(ylabel)}</text>')
    return "".join(out), y


def _legend(items: list[tuple[str, str, str]]) -> str:
    """The keys above a plot, as HTML: (label, colour, "line" | "dashed" | "box")."""
    keys = []
    for label, colour, style in items:
        if style == "box":
            mark = f'<rect x="3" y="1" width="12" height="10" fill="{colour}"/>'
        else:
            dash = ' stroke-dasharray="5 3"' if style == "dashed" else ""
            mark = f'<line x1="0" x2="18" y1="6" y2="6" stroke="{colour}" stroke-width="2"{dash}/>'
        keys.append(f'<span class="key"><svg width="18" height="12">{mark}</svg>{esc(label)}</span>')
    return f'<div class="legend">{"".join(keys)}</div>'


def _figure(fig_id: str, title: str, attrs: dict[str, str | int], legend: str, body: str) -> str:
    head = " ".join(f'{k}="{esc(v)}"' for k, v in {"class": "plot", "id": fig_id, **attrs}.items())
    return (f"<figure {head}><figcaption>{esc(title)}</figcaption>{legend}"
            f'<svg viewBox="0 0 {W} {H}" role="img" aria-label="{esc(title)}">{body}</svg></figure>')


def line_chart(fig_id: str, title: str, ylabel: str, labels: list[str], series: list[Series],
               fmt: Callable[[float], str], reasons: list[str | None], unit: str = "GPUs") -> str:
    """A curve per series over the GPU counts (a gap where a value is None), a dot at each
    value with its figure as a tooltip, and a grey cross on the axis at counts without a
    layout (`reasons`)."""
    values = [v for s in series for v in s.values if v is not None]
    ticks = _axis(max(values, default=0.0) * 1.08)
    frame, y = _frame(labels, ticks, ylabel, fmt, unit)
    out = [frame]
    n = len(labels)
    for s in series:
        runs: list[list[tuple[float, float]]] = [[]]
        for i, v in enumerate(s.values):
            if v is None:
                runs.append([])
            else:
                runs[-1].append((_slot(i, n), y(v)))
        dash = ' stroke-dasharray="6 4"' if s.dashed else ""
        out += [f'<polyline class="series" data-series="{esc(s.key)}" fill="none" '
                f'stroke="{s.colour}" stroke-width="2"{dash} stroke-linejoin="round" '
                f'points="{" ".join(f"{a:.1f},{b:.1f}" for a, b in run)}"/>'
                for run in runs if len(run) > 1]
        if not s.dashed:
            out.append(f'<g class="dots" data-series="{esc(s.key)}" fill="{s.colour}">')
            out += [f'<circle cx="{_slot(i, n):.1f}" cy="{y(v):.1f}" r="3.2"><title>'
                    f"{esc(labels[i])} {unit}: {esc(s.label)} {esc(fmt(v))}</title></circle>"
                    for i, v in enumerate(s.values) if v is not None]
            out.append("</g>")
    for i, reason in enumerate(reasons):
        if reason is not None:
            x = _slot(i, n)
            out.append(f'<path class="nofit" d="M{x - 5:.1f},{BOTTOM - 13} l10,10 m0,-10 l-10,10" '
                       f'stroke="{GREY}" stroke-width="2"><title>{esc(labels[i])} {unit}: '
                       f"{esc(reason)}</title></path>")
    legend = _legend([(s.label, s.colour, "dashed" if s.dashed else "line") for s in series])
    drawn = sum(v is not None for v in series[0].values)
    return _figure(fig_id, title, {"data-series": " ".join(s.key for s in series),
                                   "data-points": drawn, "data-nofit": sum(r is not None for r in reasons)},
                   legend, "".join(out))


def split_chart(sweep: Sweep, labels: list[str], unit: str = "GPUs") -> str:
    """The step-time split: a bar per GPU count, each part's share of the step stacked from
    compute at the bottom, each segment's seconds as a tooltip."""
    ticks = [0.0, 20.0, 40.0, 60.0, 80.0, 100.0]
    frame, y = _frame(labels, ticks, "share of the step (%)", lambda v: f"{v:g}", unit)
    out = [frame]
    n = len(labels)
    width = min(48.0, 0.6 * (RIGHT - LEFT) / n)
    used: set[str] = set()
    for i, point in enumerate(sweep.points):
        x = _slot(i, n) - width / 2
        if point.plan is None:
            out.append(f'<rect class="nofit" x="{x:.1f}" y="{TOP}" width="{width:.1f}" '
                       f'height="{BOTTOM - TOP}" fill="none" stroke="{GREY}" '
                       f'stroke-dasharray="4 3"><title>{esc(labels[i])} {unit}: '
                       f"{esc(point.reason)}</title></rect>"
                       f'<text x="{x + width / 2:.1f}" y="{(TOP + BOTTOM) / 2}" font-size="11" '
                       f'fill="#64748b" text-anchor="middle">no fit</text>')
            continue
        parts, total, below = split(point.plan.step), point.plan.step.total, 0.0
        for key, name, _ in SPLIT:
            if parts[key] <= 0:
                continue
            used.add(key)
            share = 100 * parts[key] / total
            out.append(f'<rect class="part" data-part="{key}" data-gpus="{point.gpus}" '
                       f'data-seconds="{parts[key]!r}" x="{x:.1f}" y="{y(below + share):.2f}" '
                       f'width="{width:.1f}" height="{y(below) - y(below + share):.2f}" '
                       f'fill="{PART_COLOURS[key]}"><title>{esc(labels[i])} {unit}: {esc(name)} '
                       f"{esc(seconds(parts[key]))} s ({share:.1f}% of "
                       f"{esc(seconds(total))} s)</title></rect>")
            below += share
    legend = _legend([(name, PART_COLOURS[key], "box") for key, name, _ in SPLIT if key in used])
    planned = sum(p.plan is not None for p in sweep.points)
    return _figure("plot-split", "Step time split (share of each step)",
                   {"data-parts": " ".join(k for k, _, _ in SPLIT if k in used),
                    "data-points": planned}, legend, "".join(out))


def _count(v: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= scale:
            return f"{v / scale:g}{suffix}"
    return f"{v:g}"


def _units(sweep: Sweep) -> tuple[str, str]:
    """What the points count and what one of them is: GPUs, or processes on CPU processes."""
    rank = rank_word(sweep.device_type)
    return ("GPUs" if rank == "GPU" else "processes"), rank


def plots(sweep: Sweep) -> list[str]:
    labels = [f"{p.gpus:,}" for p in sweep.points]
    unit, rank = _units(sweep)
    used = columns(sweep.device_type)[1]
    reasons = [p.reason if p.plan is None else None for p in sweep.points]
    per_gpu = [None if p.plan is None else p.plan.tokens_per_s / p.gpus for p in sweep.points]
    mfu = [None if p.plan is None else 100 * p.plan.mfu for p in sweep.points]
    efficiency = [sweep.efficiency(p) for p in sweep.points]
    ideal = Series("ideal", "ideal (1)", GREY, [1.0] * len(labels), dashed=True)
    rate = [Series("tokens_per_s_per_gpu", "predicted", BLUE, per_gpu)]
    scaled = [Series("efficiency", "predicted", BLUE, efficiency), ideal]
    if sweep.measured:  # `tessel scale --measure`: each run's measurement beside its prediction
        runs = [sweep.measured.get(p.gpus) or {} for p in sweep.points]
        rate.append(Series("measured_tokens_per_s_per_gpu", "measured", ORANGE,
                           [m.get("tokens_per_s_per_process") for m in runs]))
        scaled.insert(1, Series("measured_efficiency", "measured", ORANGE,
                                [m.get("efficiency") for m in runs]))
    return [
        line_chart("plot-tokens_per_gpu", f"Tokens/s per {rank}", f"tokens/s per {rank}", labels,
                   rate, _count, reasons, unit),
        line_chart("plot-efficiency", "Scaling efficiency", "efficiency", labels,
                   scaled, lambda v: f"{v:.2f}", reasons, unit),
        line_chart("plot-mfu", "Model FLOPs utilisation" if used == "MFU" else
                   "Model FLOP/s over the profile's peak", f"{used} (%)", labels,
                   [Series("mfu", "predicted", BLUE, mfu)], lambda v: f"{v:g}", reasons, unit),
        split_chart(sweep, labels, unit),
    ]


def _table(sweep: Sweep) -> str:
    """Every point: the layout and its figures, and the step split in seconds (the parts
    some point has), or why nothing fits."""
    planned = [split(p.plan.step) for p in sweep.points if p.plan is not None]
    parts = [(k, name) for k, name, _ in SPLIT if k == "compute_s" or any(s[k] for s in planned)]
    unit, rank = _units(sweep)
    memory, used = columns(sweep.device_type)
    heads = [unit, "model", "global batch", "layout", memory, "step s",
             "tokens/s/GPU" if rank == "GPU" else "tokens/s/proc", used, "efficiency", "comm"] + [
                 f"{name} s" for _, name in parts]
    rows = []
    for point in sweep.points:
        rec = point_record(sweep, point)
        cells = [f'<td class="num">{point.gpus:,}</td><td>{esc(rec["model"])}</td>'
                 f'<td class="num">{rec["global_batch_size"]:,}</td>']
        pred = rec["predicted"]
        if pred is None:
            closest = rec["closest"]
            why = point.reason + ("" if closest is None else
                                  f" (closest: {closest['layout']}, "
                                  f"{short_by(closest['shortfall_gib'], rank)})")
            cells.append(f'<td class="reason" colspan="{len(heads) - 3}">{esc(why)}</td>')
        else:
            cells += [f'<td class="layout">{esc(rec["layout"])}</td>',
                      f'<td class="num">{pred["memory_gib"]["total"]:.1f}</td>',
                      f'<td class="num">{seconds(pred["step_time_s"])}</td>',
                      f'<td class="num">{pred["tokens_per_s_per_gpu"]:,.0f}</td>',
                      f'<td class="num">{pred["mfu"]:.1%}</td>',
                      f'<td class="num">{pred["efficiency"]:.2f}</td>',
                      f'<td class="num">{pred["communication_share"]:.1%}</td>']
            cells += [f'<td class="num">{seconds(pred["split_s"][k])}</td>' for k, _ in parts]
        rows.append(f'<tr data-gpus="{point.gpus}">{"".join(cells)}</tr>')
    return (f'<div class="wide"><table id="points"><thead><tr>'
            f'{"".join(f"<th>{esc(h)}</th>" for h in heads)}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></div>')


def render(sweep: Sweep) -> str:
    """The page of `sweep` as one HTML document."""
    from tessel.planner.report import ASSUMPTIONS

    generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    unit, rank = _units(sweep)
    what = (f"the same global batch on more {unit}" if sweep.mode == STRONG
            else f"the same batch per {rank} on more {unit}")
    ratio = "MFU" if rank == "GPU" else f"model FLOP/s per {rank}"
    notes = ", ".join(k.removesuffix("_s").replace("_", " ") for k in COMMUNICATION)
    parts = [
        *page_head(f"tessel scale: {sweep.mode} scaling", CSS),
        f'<h1 id="title">tessel scale: {esc(sweep.mode)} scaling ({esc(what)})</h1>',
        f'<p class="sub">{esc(header(sweep).removeprefix("tessel scale: "))}'
        f'{" · " + esc(sweep.config_path) if sweep.config_path else ""} · predicted by the '
        f"planner{' and measured by real runs' if sweep.measured else ''} · generated "
        f"{generated}</p>",
        '<h2>Curves</h2><div class="plots" id="plots">', *plots(sweep), "</div>",
        "<h2>Points</h2>", _table(sweep),
        f'<p class="sub">Efficiency: {ratio} over the first point\'s with a layout (for one '
        f"model, tokens/s per {rank} over its; 1 is linear scaling). comm: exposed "
        f"communication ({esc(notes)}) as a share of the step. Memory: predicted peak per {rank}, of "
        f"{sweep.hw.memory_gib:.1f} GiB ({_gib_note(sweep.points)}).</p>",
        "<details><summary>the planner's assumptions</summary><ul>",
        *(f"<li>{esc(a)}</li>" for a in ASSUMPTIONS),
        "</ul></details>",
        "<footer>written by <code>tessel scale --html</code>; one self-contained file: it "
        "loads nothing from the network.</footer>",
        "</main></body></html>\n",
    ]
    return "\n".join(parts)


def _gib_note(points: list[Point]) -> str:
    used = [f"{p.plan.memory.total / GIB:.1f}" for p in points if p.plan is not None]
    if not used:
        return "no point fits"
    low, high = min(used, key=float), max(used, key=float)
    return f"{low} GiB used" if low == high else f"{low} to {high} GiB used"
