"""`tessel report RUN_DIR`: the HTML page, its safety, its errors, and how a real browser
renders it (headless Chromium: the DOM it builds and a screenshot that is not blank)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import system_packages
from PIL import Image

from tessel import Trainer
from tessel.cli import main
from tessel.observe.report import write_report
from tessel.observe.report.plots import share_colour
from tessel.observe.secrets import Redactor

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PLOT_IDS = ("plot-loss", "plot-lr", "plot-grad_norm", "plot-tokens_per_s", "plot-mfu",
            "plot-memory", "plot-step_time", "plot-comm")
MOE_PLOT_IDS = ("plot-moe_load_imbalance", "plot-moe_aux_loss", "plot-moe_z_loss",
                "plot-moe_dropped_frac")
SECRET = "https://hooks.example.com/services/T000/B000/SECRETxyz123"
T0 = 1_750_000_000.0  # 2025-06-15 15:06:40 UTC


def tessel(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tessel", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "CI": "true"})


def make_run(root: Path, n: int = 50, mfu: bool = False) -> Path:
    """A run directory as the trainer leaves it: 50 logged steps with a resume that re-logged
    steps 29-30, a NaN loss at step 33, validation every 10 steps (one of them NaN), an
    alert, a rollback, a restart and an event kind the report does not know."""
    run = root / "run-7"
    run.mkdir(parents=True)
    lines: list[str] = []
    recs: dict[int, dict] = {}
    for step in range(1, n + 1):
        loss = 10.0 * math.exp(-step / 15) + 2.0
        rec = {"step": step, "loss": "nan" if step == 33 else loss, "lr": 1e-3 * min(1, step / 10),
               "grad_norm": 1.0 + 0.5 * math.sin(step), "tokens_per_s": 1000.0 + 10 * step,
               "tokens_per_s_per_device": 500.0 + 5 * step, "mfu": 0.4 if mfu else None,
               "mem_rss_gib": 1.5 + step / 100, "step_time_s": 0.25, "time_data_s": 0.01,
               "time_compute_s": 0.2, "time_optimizer_s": 0.04, "tokens_seen": 256 * step,
               "elapsed_s": 0.25 * step, "eta_s": 0.25 * (n - step), "token_budget_pct": 2 * step}
        if step % 5 == 0:  # a sampled step (metrics.comm_sample_interval = 5)
            rec.update({"time_comm_exposed_s": 0.05 + step / 1000, "time_comm_s": 0.12,
                        "time_comm_exposed_max_s": 0.07, "comm_exposed_share": 0.2,
                        "comm_collectives": 29.0})
        recs[step] = rec
        if step in (29, 30):  # logged before a crash (loss 99), then again after the resume
            lines.append(json.dumps({**rec, "loss": 99.0}))
            if step == 30:
                lines += [json.dumps(recs[29]), json.dumps(recs[30])]
        else:
            lines.append(json.dumps(rec))
        if step % 10 == 0:
            val = "nan" if step == 20 else loss + 0.1
            lines.append(json.dumps({"step": step, "val_loss": val, "val_ppl": "inf" if step == 20
                                     else math.exp(loss + 0.1), "elapsed_s": 0.25 * step + 0.1}))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    events = [
        {"time": T0, "step": 0, "kind": "start", "message": "training started"},
        {"time": T0 + 5, "step": 20, "kind": "alert", "message": "loss spike <b>x3</b> & more",
         "rule": "loss_spike", "when": "loss > 3 * ema", "action": "rollback", "values": {"loss": 7.1}},
        {"time": T0 + 6, "step": 20, "kind": "rollback", "message": "rolled back to step 10",
         "from_step": 20, "to_step": 10, "skipped_batches": [11, 12]},
        {"time": T0 + 9, "step": 30, "kind": "restart", "message": "resumed after a crash"},
        {"time": T0 + 9, "step": 30, "kind": "world_shrink", "message": "world size 2 -> 1",
         "world_size": 1, "world_size_before": 2},
        {"time": T0 + 10, "step": 31, "kind": "mystery_kind", "message": "<script>alert(1)</script>"},
        {"time": T0 + 20, "step": n, "kind": "finish", "message": f"done; notified {SECRET}"},
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + '{"trunc')
    (run / "config.toml").write_text(
        '[train]\nsteps = 100\nseq_len = 32\n\n'
        '[notify]\nsmtp_password = "hunter2-pass"\nsmtp_host = "mail.example.com"\n'
        'webhook_timeout_s = 10\n\n[model]\npreset = "tiny <i>x</i>"\n\n'
        f'[[alerts]]\nname = "spike"\nwhen = "loss.above"\nwebhook_url = "{SECRET}"\n')
    (run / "run.json").write_text(json.dumps({"world_size": 1, "device": "cpu", "device_name": "cpu",
                                              "layout": "single process", "torch": "2.13.0"}))
    (run / "skipped_batches.json").write_text(json.dumps({"skipped": [[11, 12]]}))
    return run


class _Dom(HTMLParser):
    """Elements with their attributes (the text inside an element is its "_text") and the
    text of the whole page."""

    def __init__(self, text: str):
        super().__init__()
        self.elements: list[tuple[str, dict[str, str], list[str]]] = []  # (tag, attrs, ancestors' ids)
        self._stack: list[tuple[str, str | None, dict[str, str]]] = []
        self.text: list[str] = []
        self.feed(text)

    _VOID = {"meta", "br", "hr", "img", "input", "link"}

    def handle_starttag(self, tag, attrs):
        d = {k: v or "" for k, v in attrs}
        self.elements.append((tag, d, [i for _, i, _ in self._stack if i]))
        if tag not in self._VOID:
            self._stack.append((tag, d.get("id"), d))

    def handle_startendtag(self, tag, attrs):
        d = {k: v or "" for k, v in attrs}
        self.elements.append((tag, d, [i for _, i, _ in self._stack if i]))

    def handle_endtag(self, tag):
        while self._stack:
            if self._stack.pop()[0] == tag:
                break

    def handle_data(self, data):
        self.text.append(data)
        for _, _, attrs in self._stack:
            attrs["_text"] = attrs.get("_text", "") + data

    def by_id(self, id_: str) -> dict[str, str]:
        return next(a for _, a, _ in self.elements if a.get("id") == id_)

    def inside(self, id_: str, tag: str) -> list[dict[str, str]]:
        return [a for t, a, ids in self.elements if t == tag and id_ in ids]


@pytest.fixture
def report(tmp_path: Path) -> tuple[Path, str, _Dom]:
    run = make_run(tmp_path)
    out = write_report(run)
    text = out.read_text()
    return run, text, _Dom(text)


def test_every_plot_is_drawn_with_data_or_a_no_data_placeholder(report):
    _, _, dom = report
    for plot_id in PLOT_IDS:
        fig = dom.by_id(plot_id)
        assert fig["data-empty"] in ("true", "false")
        assert dom.inside(plot_id, "svg"), plot_id
    for plot_id in ("plot-loss", "plot-lr", "plot-grad_norm", "plot-tokens_per_s", "plot-memory",
                    "plot-step_time", "plot-comm"):
        assert dom.by_id(plot_id)["data-empty"] == "false"
        lines = dom.inside(plot_id, "polyline")
        assert lines, plot_id
        assert all(len(pl["points"].split()) >= 2 for pl in lines)
        for pl in lines:
            for pt in pl["points"].split():
                x, y = map(float, pt.split(","))
                assert 0 <= x <= 600 and 0 <= y <= 290
        assert dom.inside(plot_id, "text"), "axis tick labels"
        assert any(g.get("class") == "legend" for g in dom.inside(plot_id, "g"))
    # MFU is null on this CPU run: a placeholder that says why, not a missing section.
    mfu = dom.by_id("plot-mfu")
    assert mfu["data-empty"] == "true" and "MFU unknown" in mfu["data-reason"]
    assert not dom.inside("plot-mfu", "polyline")
    # A dense run has no Mixture-of-Experts section.
    assert not [a for _, a, _ in dom.elements if a.get("id", "").startswith(("expert-load", "heatmap-"))]
    assert "Expert load" not in "".join(dom.text)


def test_loss_plot_has_both_series_gaps_and_event_markers(report):
    _, _, dom = report
    loss = dom.by_id("plot-loss")
    assert loss["data-series"] == "loss val_loss"
    # 50 train losses of which one is NaN, 5 val losses of which one is NaN.
    assert loss["data-points"] == str(49 + 4) and loss["data-nonfinite"] == "2"
    train_lines = [pl for pl in dom.inside("plot-loss", "polyline") if pl["data-series"] == "loss"]
    assert len(train_lines) == 2  # the NaN at step 33 splits the curve
    assert sum(len(pl["points"].split()) for pl in train_lines) == 49
    crosses = [p for p in dom.inside("plot-loss", "path") if p.get("class") == "nonfinite"]
    assert {(p["data-series"], p["data-step"]) for p in crosses} == {("loss", "33"), ("val_loss", "20")}
    markers = {(m["data-kind"], m["data-step"]) for m in dom.inside("plot-loss", "line")
               if m.get("class") == "marker"}
    assert markers == {("alert", "20"), ("rollback", "20"), ("restart", "30"),
                       ("world_shrink", "30")}
    # Only the last record of a re-logged step is drawn: not the stale loss of 99.
    assert float(loss["data-ymax"]) == pytest.approx(10.0 * math.exp(-1 / 15) + 2.0)
    assert (loss["data-xmin"], loss["data-xmax"]) == ("1", "50")


def test_communication_plot_sets_computation_against_exposed_communication(report):
    _, _, dom = report
    comm = dom.by_id("plot-comm")
    assert comm["data-series"] == "computation_s time_comm_exposed_s time_comm_s"
    assert comm["data-points"] == str(3 * 10)  # the 10 sampled steps of 50, three series
    # computation = compute + optimizer phases less the exposed communication inside them
    assert float(comm["data-ymax"]) == pytest.approx(0.2 + 0.04 - (0.05 + 5 / 1000))
    assert float(comm["data-ymin"]) == pytest.approx(0.05 + 5 / 1000)
    assert (comm["data-xmin"], comm["data-xmax"]) == ("5", "50")
    assert {pl["data-series"] for pl in dom.inside("plot-comm", "polyline")} == {
        "computation_s", "time_comm_exposed_s", "time_comm_s"}


def test_summary_events_and_tables(report):
    _, text, dom = report
    cards = {a["data-key"]: a["_text"] for _, a, _ in dom.elements if a.get("class") == "card"}
    assert cards["steps"].endswith("50 / 100 (50%)")
    assert cards["tokens_seen"].endswith("12,800 (12.8k)")
    assert cards["final_loss"].endswith(f"{10.0 * math.exp(-50 / 15) + 2.0:.4g} at step 50")
    assert cards["best_val_loss"].endswith(f"{10.0 * math.exp(-50 / 15) + 2.1:.4g} at step 50")
    assert cards["tokens_per_s"].endswith("1,265")  # median of steps 3..50 (warm-up left out)
    assert cards["mfu"].endswith("unknown")
    assert cards["peak_memory"].endswith("2.00 GiB (host RSS)")
    assert cards["wall_time"].endswith("12.6 s")  # the last elapsed_s
    assert (cards["alerts"], cards["rollbacks"], cards["restarts"]) == ("alerts1", "rollbacks1",
                                                                        "restarts1")
    page = "".join(dom.text)
    rows = [a for a in dom.inside("events", "tr") if "data-kind" in a]
    assert [r["data-kind"] for r in rows] == ["start", "alert", "rollback", "restart",
                                              "world_shrink", "mystery_kind", "finish"]
    assert cards["world_changes"].endswith("1 shrink, 0 grow")
    assert "2025-06-15 15:06:45" in page  # event times in UTC
    assert "1 unreadable line(s) skipped" in page  # the truncated last line of events.jsonl
    # Non-finite values are listed, and validation NaNs shown in its table.
    assert dom.inside("nonfinite", "tr") and dom.inside("validation", "tr")
    assert re.search(r"<td class=\"num nan\">nan</td>", text)
    assert "skipped_batches.json" in page and '"skipped"' in page


def test_text_from_files_is_escaped_and_secrets_are_redacted(report):
    _, text, dom = report
    assert "SECRETxyz123" not in text and "services/T000" not in text and "hunter2" not in text
    assert 'webhook_url = "https://hooks.example.com/***"' in "".join(dom.text)
    assert 'smtp_password = "***"' in "".join(dom.text)
    assert "notified https://hooks.example.com/***" in "".join(dom.text)  # also in event messages
    assert "webhook_timeout_s = 10" in "".join(dom.text)
    assert 'smtp_host = "mail.example.com"' in "".join(dom.text)
    assert "<script>" not in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "<b>x3</b>" not in text and "<i>x</i>" not in text
    # Self-contained: nothing that a browser would fetch.
    assert not re.search(r"""(src|href|action|poster|srcset)\s*=\s*["']?\s*(https?:)?//""", text, re.I)
    assert not re.search(r"<(script|link|iframe|object|embed|img)\b", text, re.I)
    assert not re.search(r"@import|url\(", text, re.I)
    assert "default-src 'none'" in text


def test_secrets_are_redacted_in_any_toml_shape():
    text = ('[notify]\nhook = { webhook_url = "https://h.example.org/inline-secret-1" }\n'
            'api_key = "sk-abcdef"  # a comment\nsmtp_password = """\nmultiline-secret-2\n"""\n'
            'webhook_urls = ["https://a.example.org/list-secret-3"]\ntokenizer = "bytes"\n'
            'url = "https://user:pw-secret-4@example.org/x"\n')
    shown = Redactor.for_config(tomllib.loads(text)).toml(text)
    for secret in ("inline-secret-1", "sk-abcdef", "multiline-secret-2", "list-secret-3", "pw-secret-4"):
        assert secret not in shown, shown
    assert 'tokenizer = "bytes"' in shown and "https://h.example.org/***" in shown
    # A config.toml that does not parse still has its secret lines hidden.
    broken = 'webhook_url = "https://h.example.org/zzz-secret"\n[unclosed\n'
    redactor = Redactor.for_config(None, broken)
    assert "zzz-secret" not in redactor.toml(broken)
    assert redactor.text("posted to https://h.example.org/zzz-secret") == "posted to https://h.example.org/***"


def test_cli_writes_the_report_and_prints_one_line(tmp_path: Path):
    run = make_run(tmp_path)
    proc = tessel("report", str(run))  # the real command, in its own process
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == 1 and str(run / "report.html") in proc.stdout
    assert (run / "report.html").is_file() and proc.stderr == ""
    assert not [p for p in run.iterdir() if p.name.endswith(".tmp")]  # written atomically


def test_cli_out_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    run = make_run(tmp_path)
    other = tmp_path / "elsewhere" / "r.html"
    assert main(["report", str(run), "--out", str(other)]) == 0
    assert other.is_file() and not (run / "report.html").exists()
    assert capsys.readouterr().out.count("\n") == 1
    assert main(["report", str(run), "--out", str(tmp_path)]) == 2  # a directory
    assert "is a directory" in capsys.readouterr().err


def test_a_run_with_only_a_few_records_still_gets_every_section(tmp_path: Path):
    run = tmp_path / "early"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 11.0, "lr": 0.0}) + "\n"
                                       + '{"step": 2, "loss": 10')  # cut short by a crash
    dom = _Dom(write_report(run).read_text())
    for plot_id in PLOT_IDS:
        assert dom.by_id(plot_id)
    assert dom.by_id("plot-loss")["data-points"] == "1"
    assert dom.by_id("plot-memory")["data-empty"] == "true"
    assert dom.by_id("plot-grad_norm")["data-reason"].startswith("metrics.jsonl has no")
    assert "metrics.comm_sample_interval = 0" in dom.by_id("plot-comm")["data-reason"]
    assert dom.by_id("events-none") and dom.by_id("config-none") and dom.by_id("warnings")


def test_a_missing_run_dir_is_one_line_exit_2_without_traceback(tmp_path: Path):
    proc = tessel("report", str(tmp_path / "missing_dir"))  # the real command
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("setup, args, needle", [
    (lambda d: d.mkdir(), [], "holds no metrics.jsonl; is it a tessel run directory?"),
    (lambda d: d.write_text("x"), [], "is not a directory"),
    (lambda d: None, [], "does not exist"),
    (lambda d: d.mkdir(), ["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_input_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], setup,
                                      args, needle):
    target = tmp_path / "missing_dir"
    setup(target)
    assert main(["report", str(target), *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and needle in err and err.startswith("tessel: error:")
    assert main(["report"]) == 2
    assert "the following arguments are required: RUN_DIR" in capsys.readouterr().err


def test_long_runs_are_thinned_but_keep_their_spikes(tmp_path: Path):
    run = tmp_path / "long"
    run.mkdir()
    recs = [{"step": s, "loss": 10.0 if s == 12_345 else 3.0 + 1 / s, "lr": 1e-4} for s in range(1, 20_001)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    text = write_report(run).read_text()
    dom = _Dom(text)
    loss = dom.by_id("plot-loss")
    assert loss["data-points"] == "20000" and float(loss["data-ymax"]) == 10.0
    points = [pt for pl in dom.inside("plot-loss", "polyline") for pt in pl["points"].split()]
    assert 100 < len(points) <= 2100
    assert min(float(pt.split(",")[1]) for pt in points) < 60  # the spike reaches the top
    assert len(text) < 400_000


def test_many_moe_layers_are_summarised_and_damaged_shares_skipped(tmp_path: Path):
    run = tmp_path / "big-moe"
    run.mkdir()
    layers, experts = range(3, 19), 128  # 16 MoE layers of 128 experts, 100 log records
    recs = []
    for step in range(1, 101):
        rec: dict = {"step": step, "loss": 3.0, "moe_aux_loss": 1.1, "moe_z_loss": 4.0,
                     "moe_load_imbalance": 1.0 + layers[-1] / 10}
        for i in layers:
            rec[f"moe_load_imbalance_l{i}"] = 1.0 + i / 10
            rec[f"moe_aux_loss_l{i}"] = 1.0 + i / 100
            rec[f"moe_expert_share_l{i}"] = [2 / experts] * (experts // 2) + [0.0] * (experts // 2)
        recs.append(rec)
    recs[49]["moe_expert_share_l3"] = [0.5, 0.5]  # damaged: not one value per expert
    recs[50]["moe_expert_share_l3"] = "garbage"
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "config.toml").write_text(f"[model]\nmoe_experts = {experts}\n")
    text = write_report(run).read_text()
    dom = _Dom(text)
    # Beyond six layers: the worst, median and best layer per step instead of one line each.
    imbalance = dom.by_id("plot-moe_load_imbalance")
    assert imbalance["data-series"] == ("moe_load_imbalance_max moe_load_imbalance_median "
                                        "moe_load_imbalance_min")
    assert (float(imbalance["data-ymin"]), float(imbalance["data-ymax"])) == (1.3, 2.8)
    assert dom.by_id("plot-moe_dropped_frac")["data-reason"].startswith("dropless routing")
    heatmaps = [a for _, a, _ in dom.elements if a.get("id", "").startswith("heatmap-moe-l")]
    assert heatmaps and sum(int(h["data-cells"]) for h in heatmaps) <= 12_000
    note = dom.by_id("expert-load-note")["_text"]
    assert len(heatmaps) < 16 and f"{len(heatmaps)} of the 16 MoE layers are shown" in note
    assert heatmaps[0]["id"] == "heatmap-moe-l3" and heatmaps[-1]["id"] == "heatmap-moe-l18"
    first = dom.by_id("heatmap-moe-l3")
    assert first["data-rows"] == "128" and (first["data-xmin"], first["data-xmax"]) == ("1", "100")
    columns = int(first["data-columns"])
    assert first["data-cells"] == str(128 * columns)  # the damaged records left no hole
    # The first half of the experts got twice the even share (red), the rest none (blue).
    fills = [r["fill"] for r in dom.inside("heatmap-moe-l3", "rect") if r.get("fill") != "none"]
    half = experts // 2 * columns
    assert set(fills[:half]) == {share_colour(2 / experts, experts)}
    assert set(fills[half:2 * half]) == {share_colour(0.0, experts)}
    assert len(text) < 2_000_000


# ---- in a real browser ------------------------------------------------------------------------


def _chromium() -> str:
    why = system_packages.ensure("chromium")  # installed in the background from collection on
    exe = next(filter(None, map(shutil.which, system_packages.BROWSERS)), None)
    if exe is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"a browser is needed under CI=true: {why}", pytrace=False)
        pytest.skip(f"no chromium on PATH: {why}")
    return exe


def _browser(exe: str, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    # Its own profile and no network features: nothing is shared with a user's browser.
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", "--disable-extensions", "--disable-background-networking",
           f"--user-data-dir={tmp / 'profile'}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HOME": str(tmp)})


def test_report_renders_in_headless_chromium(tmp_path: Path):
    exe = _chromium()
    run = make_run(tmp_path)
    page = write_report(run)
    url = page.resolve().as_uri()

    dom = _browser(exe, tmp_path, "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    rendered = _Dom(dom.stdout)
    for plot_id in PLOT_IDS:
        assert rendered.by_id(plot_id), plot_id
        assert rendered.inside(plot_id, "svg"), plot_id
    assert rendered.inside("plot-loss", "polyline") and rendered.inside("events", "tr")

    shot = tmp_path / "report.png"
    proc = _browser(exe, tmp_path, f"--screenshot={shot}", "--window-size=1280,4000",
                    "--hide-scrollbars", url)
    assert proc.returncode == 0 and shot.is_file(), proc.stderr[-2000:]
    if os.environ.get("TESSEL_REPORT_SCREENSHOT"):  # keep it to look at
        shutil.copy(shot, os.environ["TESSEL_REPORT_SCREENSHOT"])
    with Image.open(shot) as img:
        px = np.asarray(img.convert("RGB"), dtype=np.int16)
    assert px.shape[:2] == (4000, 1280)
    assert px.std() > 10, "the screenshot is (nearly) one colour"
    packed = (px[..., 0].astype(np.int32) << 16) | (px[..., 1].astype(np.int32) << 8) | px[..., 2]
    for band in range(0, 2400, 400):  # title, summary, plots, events: no band is one colour
        assert len(np.unique(packed[band:band + 400])) > 20, f"rows {band}-{band + 400} are blank"
    # The plots' lines were drawn: many pixels of the series colours (the page itself is
    # greys and white).
    for name, rgb in (("blue series", (0x25, 0x63, 0xEB)), ("orange series", (0xEA, 0x58, 0x0C)),
                      ("rollback marker", (0xDC, 0x26, 0x26))):
        near = (np.abs(px[:2400] - np.array(rgb, np.int16)).sum(axis=2) < 60).sum()
        assert near > {"blue series": 1500, "orange series": 300}.get(name, 150), f"{name}: {near} pixels"


@pytest.fixture
def moe_run(tiny_config) -> Path:
    """A real tiny-moe run: 4 steps of 32 tokens a sequence, each logged, with a capacity
    factor (so some token slots are dropped) and the balancing bias."""
    cfg = tiny_config(**{"model.preset": "tiny-moe", "model.moe_capacity_factor": 1.0,
                         "model.moe_bias_update_rate": 0.01, "train.steps": 4})
    Trainer(cfg, console=False).train()
    return Path(cfg.run.dir)


def test_moe_run_has_an_expert_load_section_in_headless_chromium(moe_run: Path, tmp_path: Path):
    exe = _chromium()
    page = write_report(moe_run)
    records = [json.loads(line) for line in (moe_run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    proc = _browser(exe, tmp_path, "--dump-dom", page.resolve().as_uri())
    assert proc.returncode == 0, proc.stderr[-2000:]
    for dom in (_Dom(page.read_text()), _Dom(proc.stdout)):  # as written, and as Chromium built it
        assert "Expert load" in dom.by_id("expert-load-title")["_text"]
        for plot_id in MOE_PLOT_IDS:
            fig = dom.by_id(plot_id)
            assert fig["data-empty"] == "false", plot_id
            assert dom.inside(plot_id, "polyline"), plot_id
        imbalance = dom.by_id("plot-moe_load_imbalance")  # one line per MoE layer (0 is dense)
        assert imbalance["data-series"] == " ".join(f"moe_load_imbalance_l{i}" for i in (1, 2, 3))
        assert imbalance["data-points"] == "12" and float(imbalance["data-ymin"]) >= 1.0
        for layer in (1, 2, 3):
            heat = dom.by_id(f"heatmap-moe-l{layer}")
            assert (heat["data-rows"], heat["data-columns"], heat["data-cells"]) == ("8", "4", "32")
            fills = [r["fill"] for r in dom.inside(f"heatmap-moe-l{layer}", "rect")
                     if r.get("fill") != "none"]
            # Each cell (expert by expert, step by step) is coloured by its share in
            # metrics.jsonl; the colour key's 12 stops follow.
            logged = [train[c][f"moe_expert_share_l{layer}"][e] for e in range(8) for c in range(4)]
            assert fills[:32] == [share_colour(v, 8) for v in logged]
            assert len(set(fills[:32])) > 4  # the routing was not even: the colours differ
    shot = tmp_path / "moe.png"
    proc = _browser(exe, tmp_path, f"--screenshot={shot}", "--window-size=1280,4000",
                    "--hide-scrollbars", page.resolve().as_uri())
    assert proc.returncode == 0 and shot.is_file(), proc.stderr[-2000:]
    if os.environ.get("TESSEL_REPORT_SCREENSHOT"):
        shutil.copy(shot, os.environ["TESSEL_REPORT_SCREENSHOT"])
    with Image.open(shot) as img:
        px = np.asarray(img.convert("RGB"), dtype=np.int16)
    # The heatmaps were painted: the cells' colours cover many pixels.
    colours = {share_colour(train[-1][f"moe_expert_share_l{layer}"][e], 8)
               for layer in (1, 2, 3) for e in range(8)} - {"#ffffff"}
    painted = [c for c in colours if (np.abs(px - np.array([int(c[i:i + 2], 16) for i in (1, 3, 5)],
                                                            np.int16)).sum(axis=2) < 6).sum() > 200]
    assert len(painted) >= len(colours) // 2, (painted, colours)


def test_a_dpo_run_has_preference_plots_in_headless_chromium(tmp_path: Path):
    """A real DPO run (4 steps of configs/dpo-tiny.toml, evaluated at 2 and 4): rewards,
    accuracy and log-probabilities over steps, the held-out figures beside the training
    ones, each value as metrics.jsonl has it; a pretraining run has no such plots."""
    from tessel.config import Config
    from tessel.observe.report.preference import PLOT_IDS as DPO_PLOT_IDS

    root = Path(__file__).resolve().parents[2]
    cfg = Config.load(root / "configs/dpo-tiny.toml", {
        "dpo.paths": [str(root / "configs/data/dpo-tiny.jsonl")], "train.steps": 4,
        "train.eval_interval": 2, "train.eval_iters": 2, "metrics.log_interval": 1,
        "metrics.tensorboard": False, "checkpoint.interval": 0,
        "run.dir": str(tmp_path / "dpo"), "data.cache_dir": str(tmp_path / "cache")})
    Trainer(cfg, console=False).train()
    page = write_report(tmp_path / "dpo")
    proc = _browser(_chromium(), tmp_path, "--dump-dom", page.resolve().as_uri())
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "dpo/metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_rewards/margins" in r]
    assert [r["step"] for r in evals] == [2, 4]
    for dom in (_Dom(page.read_text()), _Dom(proc.stdout)):  # as written, and as Chromium built it
        for plot_id in DPO_PLOT_IDS:
            assert dom.by_id(plot_id)["data-empty"] == "false", plot_id
            assert dom.inside(plot_id, "polyline"), plot_id
        rewards = dom.by_id("plot-dpo_rewards")["data-series"].split()
        assert rewards == ["rewards/chosen", "eval_rewards/chosen", "rewards/rejected",
                           "eval_rewards/rejected", "rewards/margins", "eval_rewards/margins"]
        accuracy = dom.by_id("plot-dpo_accuracy")
        assert accuracy["data-points"] == "6"  # 4 training steps, 2 evaluations
        want = [100 * r[k] for r in records for k in ("rewards/accuracies", "eval_rewards/accuracies")
                if k in r]
        assert float(accuracy["data-ymax"]) >= max(want) - 1e-9
    plain = _Dom(write_report(make_run(tmp_path / "lm")).read_text())
    assert not {a.get("id") for _, a, _ in plain.elements} & set(DPO_PLOT_IDS)
