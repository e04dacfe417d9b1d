"""The report page: summary cards, plots, tables and the run's files, as one HTML document."""

from __future__ import annotations

import json
import math
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tessel.errors import TesselError
from tessel.fileio import write_text_atomic
from tessel.observe.report.experts import expert_heatmaps, expert_plots, is_moe
from tessel.observe.report.plots import build_plots, esc, page_head, render_heatmap, render_plot
from tessel.observe.report.preference import preference_plots
from tessel.observe.report.run import Run, event_message, num, read_run
from tessel.observe.report.summary import fmt, summary
from tessel.observe.secrets import Redactor

MAX_EVENT_ROWS = 2000

_CSS = """
:root { color-scheme: light; }
* { box-sizing: border-box; }
body { margin: 0; background: #f1f5f9; color: #0f172a;
  font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; }
main { max-width: 1240px; margin: 0 auto; padding: 24px; }
h1 { font-size: 24px; margin: 0 0 4px; word-break: break-all; }
h2 { font-size: 17px; margin: 28px 0 10px; }
.sub { color: #475569; margin: 0 0 16px; }
.warn { background: #fef3c7; border: 1px solid #f59e0b; border-radius: 6px; padding: 8px 12px; }
.cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(190px, 1fr)); gap: 10px; }
.card { background: #fff; border: 1px solid #e2e8f0; border-radius: 8px; padding: 10px 12px; }
.card .label { color: #64748b; font-size: 12px; text-transform: uppercase; letter-spacing: .03em; }
.card .value { font-size: 17px; font-weight: 600; margin-top: 2px; word-break: break-word; }
.plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(540px, 1fr)); gap: 14px; }
figure.plot { margin: 0; background: #fff; border: 1px solid #e2e8f0; border-radius: 8px;
  padding: 10px 12px; }
figure.plot figcaption { font-weight: 600; margin-bottom: 4px; }
figure.plot svg { width: 100%; height: auto; display: block; }
.nodata { fill: #64748b; font-size: 13px; }
table { border-collapse: collapse; width: 100%; background: #fff; border: 1px solid #e2e8f0; }
th, td { text-align: left; padding: 5px 9px; border-bottom: 1px solid #e2e8f0; vertical-align: top; }
th { background: #f8fafc; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.time { white-space: nowrap; font-variant-numeric: tabular-nums; }
td.msg { word-break: break-word; }
td.extra { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12px; color: #475569;
  overflow-wrap: anywhere; }
table.narrow { width: auto; min-width: 420px; }
.kind { display: inline-block; padding: 0 7px; border-radius: 9px; font-size: 12px;
  background: #e2e8f0; color: #0f172a; white-space: nowrap; }
.kind-alert { background: #fef3c7; color: #92400e; }
.kind-rollback, .kind-recovery_gave_up, .kind-watchdog { background: #fee2e2; color: #991b1b; }
.kind-restart { background: #ede9fe; color: #5b21b6; }
.kind-start, .kind-finish { background: #dcfce7; color: #166534; }
.kind-resume { background: #e0f2fe; color: #075985; }
.kind-world_shrink, .kind-world_grow, .kind-replicas_lost, .kind-replicas_joined,
.kind-replica_healed { background: #ffedd5; color: #9a3412; }
pre { background: #fff; border: 1px solid #e2e8f0; border-radius: 8px; padding: 12px;
  overflow-x: auto; font: 12px/1.4 ui-monospace, Menlo, Consolas, monospace; margin: 0; }
.nan { color: #b91c1c; font-weight: 600; }
footer { color: #64748b; margin-top: 28px; font-size: 12px; }
"""


def _utc(t: Any) -> str:
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        try:
            return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        except (OverflowError, OSError, ValueError):
            pass
    return str(t)


def _cell(value: float | None) -> str:
    text = fmt(value)
    cls = "num nan" if value is not None and not math.isfinite(value) else "num"
    return f'<td class="{cls}">{esc(text)}</td>'


def _events_table(run: Run, redact: Redactor) -> str:
    if not run.events:
        note = "no events.jsonl" if not (run.path / "events.jsonl").is_file() else "no events"
        return f'<p id="events-none">{esc(note)}</p>'
    rows = run.events
    note = ""
    if len(rows) > MAX_EVENT_ROWS:
        half = MAX_EVENT_ROWS // 2
        note = (f"<p>{len(rows):,} events: the first and last {half:,} are shown; "
                f"events.jsonl holds them all.</p>")
        rows = rows[:half] + rows[-half:]
    body = []
    for ev in rows:
        kind = str(ev.get("kind", "?"))
        css = re.sub(r"[^a-z0-9_]", "", kind.lower())
        extra = {k: v for k, v in ev.items() if k not in ("time", "step", "kind", "message")}
        extra_text = json.dumps(extra, sort_keys=True, default=str) if extra else ""
        body.append(
            f'<tr data-kind="{esc(kind)}"><td class="time">{esc(_utc(ev.get("time")))}</td>'
            f'<td class="num">{esc(ev.get("step", ""))}</td>'
            f'<td><span class="kind kind-{css}">{esc(kind)}</span></td>'
            f'<td class="msg">{esc(redact.text(event_message(ev)))}</td>'
            f'<td class="extra">{esc(redact.text(extra_text))}</td></tr>')
    return (f'{note}<table id="events"><thead><tr><th>time (UTC)</th><th>step</th><th>kind</th>'
            f'<th>message</th><th>details</th></tr></thead><tbody>{"".join(body)}</tbody></table>')


def _val_table(run: Run) -> str:
    if not run.val:
        return '<p id="validation-none">no validation records</p>'
    rows = "".join(f'<tr><td class="num">{r["step"]:,}</td>{_cell(num(r.get("val_loss")))}'
                   f'{_cell(num(r.get("val_ppl")))}</tr>' for r in run.val)
    return (f'<table class="narrow" id="validation"><thead><tr><th>step</th><th>val loss</th><th>val ppl</th>'
            f"</tr></thead><tbody>{rows}</tbody></table>")


def _nonfinite_table(run: Run) -> str:
    found = [(r["step"], k, v) for r in [*run.train, *run.val] for k, raw in r.items()
             if k != "step" and (v := num(raw)) is not None and not math.isfinite(v)]
    if not found:
        return '<p id="nonfinite-none">none: every logged value is finite</p>'
    found.sort(key=lambda t: (t[0], t[1]))
    rows = "".join(f'<tr><td class="num">{s:,}</td><td>{esc(k)}</td>{_cell(v)}</tr>'
                   for s, k, v in found[:MAX_EVENT_ROWS])
    more = f"<p>... and {len(found) - MAX_EVENT_ROWS:,} more</p>" if len(found) > MAX_EVENT_ROWS else ""
    return (f'<table class="narrow" id="nonfinite"><thead><tr><th>step</th><th>metric</th><th>value</th></tr>'
            f"</thead><tbody>{rows}</tbody></table>{more}")


def _pre(id_: str, text: str | None, missing: str) -> str:
    if text is None:
        return f'<p id="{id_}-none">{esc(missing)}</p>'
    return f'<pre id="{id_}">{esc(text)}</pre>'


def _expert_load(run: Run, redact: Redactor) -> str:
    """The Mixture-of-Experts section: load imbalance, auxiliary losses, dropped slots and
    each layer's token share per expert over steps (the last step of each log interval)."""
    heatmaps, note = expert_heatmaps(run)
    return "".join([
        '<h2 id="expert-load-title">Expert load</h2>',
        '<p class="sub">Figures of the last step of each log interval, over all ranks. Load '
        "imbalance: the most tokens an expert got over the mean (1 = even). Heatmaps: each "
        "expert's share of its layer's token slots; white is the even share.</p>",
        f'<p class="sub" id="expert-load-note">{esc(note)}</p>' if note else "",
        '<div class="plots" id="expert-load">',
        *(render_plot(p, redact) for p in expert_plots(run)),
        *(render_heatmap(h) for h in heatmaps),
        "</div>",
    ])


def render(run: Run) -> str:
    """The report page for `run` as one HTML document."""
    redact = Redactor.for_config(run.config, run.config_text)
    name = run.path.resolve().name or str(run.path)
    info = run.run_info or {}
    where = ", ".join(f"{k} {info[k]}" for k in ("device_name", "world_size", "layout", "torch")
                      if info.get(k) not in (None, ""))
    generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")

    parts = [
        *page_head(f"tessel report: {name}", _CSS),
        f'<h1 id="title">tessel report: {esc(name)}</h1>',
        f'<p class="sub">{esc(redact.text(str(run.path)))}'
        f'{" · " + esc(redact.text(where)) if where else ""} · generated {generated}</p>',
    ]
    if run.warnings:
        items = "".join(f"<li>{esc(redact.text(w))}</li>" for w in run.warnings)
        parts.append(f'<div class="warn" id="warnings"><ul>{items}</ul></div>')

    parts.append('<h2>Summary</h2><div class="cards" id="summary">')
    for key, label, value in summary(run):
        parts.append(f'<div class="card" data-key="{esc(key)}"><div class="label">{esc(label)}</div>'
                     f'<div class="value">{esc(value)}</div></div>')
    parts.append("</div>")

    parts.append('<h2>Plots</h2><div class="plots" id="plots">')
    parts.extend(render_plot(p, redact) for p in build_plots(run) + preference_plots(run))
    parts.append("</div>")

    if is_moe(run):  # a dense run has no such section
        parts.append(_expert_load(run, redact))

    parts.append(f'<h2>Events</h2>{_events_table(run, redact)}')
    parts.append(f'<h2>Validation</h2>{_val_table(run)}')
    parts.append(f'<h2>Non-finite values</h2>{_nonfinite_table(run)}')
    config_text = None if run.config_text is None else redact.toml(run.config_text)
    parts.append(f'<h2>Config (config.toml)</h2>{_pre("config", config_text, "no config.toml")}')
    run_text = run.run_info_text
    if run.run_info is not None:
        run_text = json.dumps(run.run_info, indent=2, sort_keys=True, default=str)
    parts.append("<h2>Run (run.json)</h2>"
                 + _pre("run-json", None if run_text is None else redact.text(run_text), "no run.json"))
    if run.skipped_text is not None:
        parts.append("<h2>Skipped batches (skipped_batches.json)</h2>"
                     + _pre("skipped-batches", redact.text(run.skipped_text), ""))
    parts.append(f"<footer>written by <code>tessel report</code> from {esc(name)}; "
                 "one self-contained file: it loads nothing from the network.</footer>")
    parts.append("</main></body></html>\n")
    return "\n".join(parts)


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    """Write the report of `run_dir` to `out` (default RUN_DIR/report.html), atomically."""
    run = read_run(run_dir)
    out = out if out is not None else run_dir / "report.html"
    if out.is_dir():
        raise TesselError(f"--out {str(out)!r} is a directory; pass a file name, e.g. {out / 'report.html'}")
    write_text_atomic(out, render(run))
    return out
