"""`tessel report RUN_DIR`: one self-contained HTML page about a run.

The page is a single file with inline CSS and inline SVG plots drawn here (no JavaScript,
no fonts, no network; a Content-Security-Policy forbids fetching anything), so it can be
mailed, attached to a ticket or opened from a cluster's shared disk. It reads what the
trainer leaves in the run directory, any of which may be missing except metrics.jsonl:

    metrics.jsonl         training and validation records (non-finite floats as "nan"/"inf")
    events.jsonl          start/resume/restart/alert/rollback/... with unix times
    config.toml           shown verbatim, with secrets (webhook URLs, passwords) redacted
    run.json              device, world size, layout, torch version
    skipped_batches.json  shown raw when present

Every plot section is always present: a metric without data gets a "no data: <reason>"
placeholder, so a reader sees what is missing rather than wondering.
"""

from __future__ import annotations

import html
import json
import math
import re
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tessel.errors import TesselError
from tessel.fileio import write_text_atomic
from tessel.observe.events import read_jsonl
from tessel.observe.metrics import latest_per_step

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# Config keys whose string values are never shown (webhook_url, smtp_password, ...).
SECRET_KEY = re.compile(r"password|passwd|secret|token_url|webhook|api_?key|access_token|auth_token",
                        re.IGNORECASE)
# Throughput and MFU medians leave out the first records (compilation, allocator warm-up),
# as the planner's calibration does.
WARMUP_RECORDS = 2
MAX_POINTS = 2000  # per series; longer series are reduced to per-bucket min/max
MAX_EVENT_ROWS = 2000

# Plot geometry (SVG user units; the SVG scales to its column's width).
_W, _H = 600, 290
_X0, _X1, _Y0, _Y1 = 64, _W - 16, 40, _H - 42  # the plot area inside; legend above, ticks below
_PALETTE = ("#2563eb", "#ea580c", "#16a34a", "#9333ea", "#0891b2", "#be185d")
# Events drawn as vertical markers on the loss plot.
_MARKERS = {"rollback": "#dc2626", "alert": "#ca8a04", "restart": "#7c3aed", "resume": "#64748b"}
_NONFINITE = "#b91c1c"
# Memory series by key (any other mem_*_gib key is plotted too, under its own name).
_MEMORY_LABELS = {"mem_allocated_gib": "allocated", "mem_reserved_gib": "reserved",
                  "mem_peak_gib": "peak allocated", "mem_gib": "peak allocated",
                  "mem_rss_gib": "host RSS", "mem_rss_peak_gib": "host RSS peak"}
# The summary's peak memory: the first of these with data.
_PEAK_MEMORY = ((("mem_peak_gib", "mem_gib"), "peak allocated"), (("mem_reserved_gib",), "reserved"),
                (("mem_allocated_gib",), "allocated"), (("mem_rss_peak_gib",), "host RSS peak"),
                (("mem_rss_gib",), "host RSS"))


# ---- reading the run directory -------------------------------------------------------------


@dataclass
class Run:
    """Everything the report shows, read from a run directory (missing parts are None)."""

    path: Path
    train: list[dict[str, Any]]
    val: list[dict[str, Any]]
    events: list[dict[str, Any]]
    config_text: str | None
    config: dict[str, Any] | None
    run_info: dict[str, Any] | None
    run_info_text: str | None
    skipped_text: str | None
    warnings: list[str] = field(default_factory=list)


def read_run(run_dir: Path) -> Run:
    """Read a run directory; TesselError when it is not one."""
    if not run_dir.exists():
        raise TesselError(f"{str(run_dir)!r} does not exist; pass a run directory, e.g. runs/demo")
    if not run_dir.is_dir():
        raise TesselError(f"{str(run_dir)!r} is not a directory; pass a run directory, e.g. runs/demo")
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise TesselError(f"{str(run_dir)!r} holds no metrics.jsonl; is it a tessel run directory?")
    warnings: list[str] = []
    rows, bad = read_jsonl(metrics_path)
    if bad:
        warnings.append(f"metrics.jsonl: {bad} unreadable line(s) skipped (a write cut short by a crash?)")
    records, no_step = latest_per_step(rows)
    if no_step:
        warnings.append(f"metrics.jsonl: {no_step} record(s) without an integer step skipped")
    train = [r for r in records if "val_loss" not in r]
    val = [r for r in records if "val_loss" in r]

    events: list[dict[str, Any]] = []
    events_path = run_dir / "events.jsonl"
    if events_path.is_file():
        events, bad = read_jsonl(events_path)
        if bad:
            warnings.append(f"events.jsonl: {bad} unreadable line(s) skipped")

    config_text = _read_text(run_dir / "config.toml", warnings)
    config = None
    if config_text is not None:
        try:
            config = tomllib.loads(config_text)
        except tomllib.TOMLDecodeError as exc:
            warnings.append(f"config.toml is not valid TOML ({exc}); shown as it is")

    run_info_text = _read_text(run_dir / "run.json", warnings)
    run_info = None
    if run_info_text is not None:
        try:
            loaded = json.loads(run_info_text)
            run_info = loaded if isinstance(loaded, dict) else None
        except json.JSONDecodeError:
            pass
        if run_info is None:
            warnings.append("run.json does not hold a JSON object; shown as it is")

    skipped_text = None
    skipped_path = run_dir / "skipped_batches.json"
    if skipped_path.is_file():
        skipped_text = _read_text(skipped_path, warnings)
    return Run(run_dir, train, val, events, config_text, config, run_info, run_info_text,
               skipped_text, warnings)


def _read_text(path: Path, warnings: list[str]) -> str | None:
    if not path.is_file():
        warnings.append(f"{path.name} is missing")
        return None
    return path.read_text(encoding="utf-8", errors="replace")


# ---- values ----------------------------------------------------------------------------------


def _num(value: Any) -> float | None:
    """A metric value as a float: numbers as they are, "nan"/"inf"/"-inf" strings as the
    non-finite floats they stand for, anything else (null, missing) as None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            parsed = float(value)
        except ValueError:
            return None
        return parsed if not math.isfinite(parsed) else None
    return None


def _finite(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def _fmt(value: float | None, digits: int = 4) -> str:
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


def _utc(t: Any) -> str:
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        try:
            return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        except (OverflowError, OSError, ValueError):
            pass
    return str(t)


# ---- secrets ----------------------------------------------------------------------------------


def redact_value(value: str) -> str:
    """A secret's stand-in: a URL keeps its scheme and host, anything else is ***."""
    try:
        parts = urlsplit(value.strip())
        host = parts.hostname
        port = parts.port
    except ValueError:
        return "***"
    if parts.scheme and host:
        return f"{parts.scheme}://{host}{f':{port}' if port else ''}/***"
    return "***"


def _secret_strings(tree: Any, secret: bool = False) -> set[str]:
    """Every non-empty string in `tree` under a key that names a secret."""
    found: set[str] = set()
    if isinstance(tree, dict):
        for key, value in tree.items():
            found |= _secret_strings(value, secret or bool(SECRET_KEY.search(str(key))))
    elif isinstance(tree, list):
        for value in tree:
            found |= _secret_strings(value, secret)
    elif isinstance(tree, str) and secret and tree.strip():
        found.add(tree)
    return found


_USERINFO = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.\-]*://)[^/\s:@\"']+:[^/\s@\"']+@")
_TOML_KEY_LINE = re.compile(r"^(\s*)((?:[A-Za-z0-9_\-]+|\"[^\"]*\"|'[^']*')"
                            r"(?:\s*\.\s*(?:[A-Za-z0-9_\-]+|\"[^\"]*\"|'[^']*'))*)(\s*=\s*)(.*)$")


class Redactor:
    """Hides secret config values wherever they appear in the report's text."""

    def __init__(self, config: dict[str, Any] | None, config_text: str | None = None):
        """`config`: the parsed config.toml; `config_text`: its text, whose `key = "value"`
        lines are read too, so secrets stay hidden when the file does not parse."""
        found = _secret_strings(config or {})
        for line in (config_text or "").splitlines():
            m = _TOML_KEY_LINE.match(line)
            if m and SECRET_KEY.search(m.group(2)):
                try:
                    found |= _secret_strings(tomllib.loads(f"v = {m.group(4)}")["v"], secret=True)
                except tomllib.TOMLDecodeError:
                    pass
        secrets = sorted(found, key=len, reverse=True)
        self._secrets = {s: redact_value(s) for s in secrets}
        self._pattern = re.compile("|".join(re.escape(s) for s in secrets)) if secrets else None

    def text(self, text: str) -> str:
        """Any text: known secret values replaced, passwords in URLs (user:pass@) hidden."""
        if self._pattern is not None:
            text = self._pattern.sub(lambda m: self._secrets[m.group(0)], text)
        return _USERINFO.sub(r"\1***@", text)

    def toml(self, text: str) -> str:
        """config.toml's text: as `text`, and every `key = "string"` line whose key names a
        secret has its value replaced (also when the file does not parse)."""
        lines = []
        for line in self.text(text).splitlines():
            m = _TOML_KEY_LINE.match(line)
            if m and SECRET_KEY.search(m.group(2)):
                line = m.group(1) + m.group(2) + m.group(3) + _redact_toml_value(m.group(4))
            lines.append(line)
        return "\n".join(lines) + ("\n" if text.endswith("\n") else "")


def _redact_toml_value(raw: str) -> str:
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        # A multi-line string or something unparsable: hide it unless it is clearly not text.
        return raw if re.fullmatch(r"\s*[-+0-9.eE_]+\s*(#.*)?|\s*(true|false)\s*(#.*)?", raw) \
            else '"***"'
    if isinstance(value, str):
        return json.dumps(redact_value(value)) if value.strip() else raw
    if isinstance(value, (list, dict)) and _secret_strings(value, secret=True):
        return '"***"'
    return raw


# ---- summary -----------------------------------------------------------------------------------


def _series(records: Sequence[dict[str, Any]], key: str) -> list[tuple[int, float | None]]:
    return [(r["step"], _num(r.get(key))) for r in records if key in r]


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

    tokens = _finite(_num(r.get("tokens_seen")) for r in [*train, *val])
    out.append(("tokens_seen", "tokens seen",
                f"{max(tokens):,.0f} ({_fmt_count(max(tokens))})" if tokens else "—"))

    losses = _series(train, "loss")
    out.append(("final_loss", "final train loss",
                f"{_fmt(losses[-1][1])} at step {losses[-1][0]:,}" if losses else "—"))

    vals = [(v, s) for s, v in _series(val, "val_loss") if v is not None and math.isfinite(v)]
    if vals:
        best, at = min(vals)
        out.append(("best_val_loss", "best val loss", f"{_fmt(best)} at step {at:,}"))
    else:
        out.append(("best_val_loss", "best val loss", "no validation" if not val else "no finite value"))

    tps = _finite(v for _, v in _series(train, "tokens_per_s"))
    tps = tps[WARMUP_RECORDS:] if len(tps) > WARMUP_RECORDS else tps
    out.append(("tokens_per_s", "median tokens/s",
                f"{statistics.median(tps):,.0f}" if tps else "—"))

    mfu = _finite(v for _, v in _series(train, "mfu"))
    mfu = mfu[WARMUP_RECORDS:] if len(mfu) > WARMUP_RECORDS else mfu
    out.append(("mfu", "median MFU", f"{100 * statistics.median(mfu):.1f}%" if mfu else "unknown"))

    out.append(("peak_memory", "peak memory", _peak_memory(train)))

    elapsed = _finite(_num(r.get("elapsed_s")) for r in [*train, *val])
    out.append(("wall_time", "wall time", _fmt_duration(max(elapsed)) if elapsed else "—"))

    kinds = [str(e.get("kind")) for e in run.events]
    for kind, label in (("alert", "alerts"), ("rollback", "rollbacks"), ("restart", "restarts")):
        out.append((f"{kind}s", label, str(kinds.count(kind))))
    return out


def _peak_memory(train: Sequence[dict[str, Any]]) -> str:
    for keys, label in _PEAK_MEMORY:
        values = _finite(_num(r.get(k)) for r in train for k in keys)
        if values:
            return f"{max(values):.2f} GiB ({label})"
    return "no data"


# ---- plots -----------------------------------------------------------------------------------


@dataclass
class Line:
    key: str
    label: str
    points: list[tuple[int, float]]  # (step, value); nan/inf values are drawn as gaps
    dots: bool = False  # sparse series (validation) also get a dot per point

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


def build_plots(run: Run) -> list[Plot]:
    train, val = run.train, run.val

    def line(key: str, label: str, records: Sequence[dict[str, Any]] = train, scale: float = 1.0,
             dots: bool = False) -> Line:
        return Line(key, label, [(s, v * scale) for s, v in _series(records, key) if v is not None],
                    dots)

    device = (run.run_info or {}).get("device_name") or (run.run_info or {}).get("device")
    mfu_known = any(_num(r.get("mfu")) is not None for r in train)
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

    markers = [Marker(e["step"], str(e.get("kind")), _message(e))
               for e in run.events if e.get("kind") in _MARKERS
               and isinstance(e.get("step"), int) and not isinstance(e.get("step"), bool)]
    return [
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
    ]


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


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


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
    head = " ".join(f'{k}="{_e(v)}"' for k, v in attrs.items())
    return (f'<figure {head}><figcaption>{_e(plot.title)}</figcaption>'
            f'<svg viewBox="0 0 {_W} {_H}" role="img" aria-label="{_e(plot.title)}">'
            f"{body}</svg></figure>")


def _placeholder(reason: str) -> str:
    return (f'<rect class="frame" x="{_X0}" y="{_Y0}" width="{_X1 - _X0}" height="{_Y1 - _Y0}" '
            f'fill="#f8fafc" stroke="#cbd5e1" stroke-dasharray="4 3"/>'
            f'<text class="nodata" x="{(_X0 + _X1) / 2}" y="{(_Y0 + _Y1) / 2}" text-anchor="middle" '
            f'dominant-baseline="middle">no data: {_e(reason)}</text>')


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
    out += [f'<text x="{_X0 - 6}" y="{scale.y(t) + 4:.1f}">{_e(label)}</text>'
            for t, label in zip(y_ticks, _tick_labels(y_ticks))]
    out.append('</g><g class="xticks" font-size="11" fill="#334155" text-anchor="middle">')
    for t, label in zip(x_ticks, _tick_labels(x_ticks)):
        x = scale.x(t)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{_Y1}" y2="{_Y1 + 4}" stroke="#475569"/>'
                   f'<text x="{x:.1f}" y="{_Y1 + 16}">{_e(label)}</text>')
    out.append(f'</g><text class="xlabel" x="{(_X0 + _X1) / 2}" y="{_H - 6}" font-size="12" '
               f'fill="#334155" text-anchor="middle">step</text>'
               f'<text class="ylabel" transform="translate(14 {(_Y0 + _Y1) / 2}) rotate(-90)" '
               f'font-size="12" fill="#334155" text-anchor="middle">{_e(ylabel)}</text>')
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
        out.append(f'<line class="marker" data-kind="{_e(m.kind)}" data-step="{m.step}" '
                   f'x1="{x:.1f}" x2="{x:.1f}" y1="{_Y0}" y2="{_Y1}" stroke="{_MARKERS[m.kind]}" '
                   f'stroke-width="1.5" stroke-dasharray="5 3"><title>{_e(m.kind)} at step '
                   f"{m.step}: {_e(redact.text(m.message))}</title></line>")
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
    out = [f'<polyline class="series" data-series="{_e(ln.key)}" fill="none" stroke="{color}" '
           f'stroke-width="1.6" stroke-linejoin="round" '
           f'points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in seg)}"/>'
           for seg in segments if len(seg) > 1]
    dots = [seg[0] for seg in segments if len(seg) == 1]
    if ln.dots:
        dots = [(scale.x(x), scale.y(y)) for x, y in ln.finite]
    if dots:
        out.append(f'<g class="dots" data-series="{_e(ln.key)}" fill="{color}">')
        out += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.8"/>' for x, y in dots]
        out.append("</g>")
    for x, y in ln.nonfinite:
        out.append(f'<path class="nonfinite" data-series="{_e(ln.key)}" data-step="{x}" '
                   f'd="M{scale.x(x) - 4:.1f},{_Y0 + 2} l8,8 m0,-8 l-8,8" stroke="{_NONFINITE}" '
                   f'stroke-width="2"><title>{_e(ln.label)} at step {x}: {y}</title></path>')
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
        out.append(f'<text x="{x + 23:.1f}" y="{y + 4}">{_e(label)}</text>')
        x += width
    out.append("</g>")
    return "".join(out)


# ---- the page -------------------------------------------------------------------------------

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
pre { background: #fff; border: 1px solid #e2e8f0; border-radius: 8px; padding: 12px;
  overflow-x: auto; font: 12px/1.4 ui-monospace, Menlo, Consolas, monospace; margin: 0; }
.nan { color: #b91c1c; font-weight: 600; }
footer { color: #64748b; margin-top: 28px; font-size: 12px; }
"""


def _cell(value: float | None) -> str:
    text = _fmt(value)
    cls = "num nan" if value is not None and not math.isfinite(value) else "num"
    return f'<td class="{cls}">{_e(text)}</td>'


def _message(event: dict[str, Any]) -> str:
    message = event.get("message")
    return "" if message is None else str(message)


def _events_table(run: Run, redact: Redactor) -> str:
    if not run.events:
        note = "no events.jsonl" if not (run.path / "events.jsonl").is_file() else "no events"
        return f'<p id="events-none">{_e(note)}</p>'
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
            f'<tr data-kind="{_e(kind)}"><td class="time">{_e(_utc(ev.get("time")))}</td>'
            f'<td class="num">{_e(ev.get("step", ""))}</td>'
            f'<td><span class="kind kind-{css}">{_e(kind)}</span></td>'
            f'<td class="msg">{_e(redact.text(_message(ev)))}</td>'
            f'<td class="extra">{_e(redact.text(extra_text))}</td></tr>')
    return (f'{note}<table id="events"><thead><tr><th>time (UTC)</th><th>step</th><th>kind</th>'
            f'<th>message</th><th>details</th></tr></thead><tbody>{"".join(body)}</tbody></table>')


def _val_table(run: Run) -> str:
    if not run.val:
        return '<p id="validation-none">no validation records</p>'
    rows = "".join(f'<tr><td class="num">{r["step"]:,}</td>{_cell(_num(r.get("val_loss")))}'
                   f'{_cell(_num(r.get("val_ppl")))}</tr>' for r in run.val)
    return (f'<table class="narrow" id="validation"><thead><tr><th>step</th><th>val loss</th><th>val ppl</th>'
            f"</tr></thead><tbody>{rows}</tbody></table>")


def _nonfinite_table(run: Run) -> str:
    found = [(r["step"], k, v) for r in [*run.train, *run.val] for k, raw in r.items()
             if k != "step" and (v := _num(raw)) is not None and not math.isfinite(v)]
    if not found:
        return '<p id="nonfinite-none">none: every logged value is finite</p>'
    found.sort(key=lambda t: (t[0], t[1]))
    rows = "".join(f'<tr><td class="num">{s:,}</td><td>{_e(k)}</td>{_cell(v)}</tr>'
                   for s, k, v in found[:MAX_EVENT_ROWS])
    more = f"<p>... and {len(found) - MAX_EVENT_ROWS:,} more</p>" if len(found) > MAX_EVENT_ROWS else ""
    return (f'<table class="narrow" id="nonfinite"><thead><tr><th>step</th><th>metric</th><th>value</th></tr>'
            f"</thead><tbody>{rows}</tbody></table>{more}")


def _pre(id_: str, text: str | None, missing: str) -> str:
    if text is None:
        return f'<p id="{id_}-none">{_e(missing)}</p>'
    return f'<pre id="{id_}">{_e(text)}</pre>'


def render(run: Run) -> str:
    """The report page for `run` as one HTML document."""
    redact = Redactor(run.config, run.config_text)
    name = run.path.resolve().name or str(run.path)
    info = run.run_info or {}
    where = ", ".join(f"{k} {info[k]}" for k in ("device_name", "world_size", "layout", "torch")
                      if info.get(k) not in (None, ""))
    generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")

    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        # Nothing on this page is fetched: inline styles and inline SVG only.
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
        "style-src 'unsafe-inline'; img-src data:\">",
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>tessel report: {_e(name)}</title>",
        f"<style>{_CSS}</style></head><body><main>",
        f'<h1 id="title">tessel report: {_e(name)}</h1>',
        f'<p class="sub">{_e(redact.text(str(run.path)))}'
        f'{" · " + _e(redact.text(where)) if where else ""} · generated {generated}</p>',
    ]
    if run.warnings:
        items = "".join(f"<li>{_e(redact.text(w))}</li>" for w in run.warnings)
        parts.append(f'<div class="warn" id="warnings"><ul>{items}</ul></div>')

    parts.append('<h2>Summary</h2><div class="cards" id="summary">')
    for key, label, value in summary(run):
        parts.append(f'<div class="card" data-key="{_e(key)}"><div class="label">{_e(label)}</div>'
                     f'<div class="value">{_e(value)}</div></div>')
    parts.append("</div>")

    parts.append('<h2>Plots</h2><div class="plots" id="plots">')
    parts.extend(render_plot(p, redact) for p in build_plots(run))
    parts.append("</div>")

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
    parts.append(f"<footer>written by <code>tessel report</code> from {_e(name)}; "
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
