"""`tessel scale --html` as a real browser draws it: one headless-Chromium screenshot of the
page (the browser helpers of the report's tests), in which the curves and the step-split bars
were painted."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
from PIL import Image
from test_cli import ROOT, tessel_here
from test_report import _browser, _chromium

from tessel.planner.scaling_page import BLUE, PART_COLOURS

# A GPU too small for GPT-2 124M on one device (nothing fits at 1), not on 4 or 8, where the
# search takes tensor parallelism (the page must show its part of the step).
SMALL_GPU = ("[gpu.small]\nbf16_tflops = 100\nmemory_gib = 2.2\nintra_node_gbps = 100\n"
             "inter_node_gbps = 25\ngpus_per_node = 4\n")


def _pixels_near(px: np.ndarray, colour: str) -> int:
    rgb = np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)], np.int16)
    return int((np.abs(px - rgb).sum(axis=2) < 40).sum())


def test_scale_page_renders_its_curves_in_headless_chromium(tmp_path: Path):
    exe = _chromium()
    hw = tmp_path / "hw.toml"
    hw.write_text(SMALL_GPU)
    page = tmp_path / "scale.html"
    out = tessel_here("scale", str(ROOT / "configs/gpt2-124m.toml"), "--gpus", "1,4,8", "--gpu",
                      "small", "--hardware", str(hw), "--html", str(page))
    assert out.returncode == 0, out.stderr

    shot = tmp_path / "scale.png"
    proc = _browser(exe, tmp_path, f"--screenshot={shot}", "--window-size=1280,1400",
                    "--hide-scrollbars", page.resolve().as_uri())
    assert proc.returncode == 0 and shot.is_file(), proc.stderr[-2000:]
    if os.environ.get("TESSEL_REPORT_SCREENSHOT"):  # keep it to look at
        shutil.copy(shot, os.environ["TESSEL_REPORT_SCREENSHOT"])
    with Image.open(shot) as img:
        px = np.asarray(img.convert("RGB"), dtype=np.int16)
    assert px.shape[:2] == (1400, 1280)
    packed = (px[..., 0].astype(np.int32) << 16) | (px[..., 1].astype(np.int32) << 8) | px[..., 2]
    for band in range(0, 1000, 250):  # title, the two rows of plots: no band is one colour
        assert len(np.unique(packed[band:band + 250])) > 20, f"rows {band}-{band + 250} are blank"
    # The three curves (and the compute part of the bars) in blue, the tensor-parallel part
    # of the bars in its own colour: the page itself is greys and white.
    plots = px[:1000]
    assert _pixels_near(plots, BLUE) > 3000
    assert _pixels_near(plots, PART_COLOURS["tp_s"]) > 100


def test_measured_curves_are_painted_beside_the_predicted_ones(tmp_path: Path):
    """`tessel scale --measure`'s page: each run's tokens/s per process and efficiency as a
    second curve (orange) in the first two plots; the same sweep without measurements has
    no such pixels there."""
    import dataclasses

    from tessel.checkpoint.init_from import load_config
    from tessel.planner import scaling
    from tessel.planner.hardware import load_profiles
    from tessel.planner.scaling_page import ORANGE, render

    exe = _chromium()
    hw_file = tmp_path / "hw.toml"
    hw_file.write_text(SMALL_GPU)
    cfg = load_config(str(ROOT / "configs/gpt2-124m.toml"), [])
    sweep = scaling.run_sweep([(4, cfg), (8, cfg)], load_profiles(hw_file)["small"],
                              scaling.STRONG)
    measured = {p.gpus: {"tokens_per_s_per_process": 0.7 * p.plan.tokens_per_s / p.gpus,
                         "efficiency": e} for p, e in zip(sweep.points, (1.0, 0.8))}
    counts = []
    for name, s in (("predicted", sweep), ("measured", dataclasses.replace(sweep, measured=measured))):
        page, shot = tmp_path / f"{name}.html", tmp_path / f"{name}.png"
        page.write_text(render(s))
        proc = _browser(exe, tmp_path, f"--screenshot={shot}", "--window-size=1280,1400",
                        "--hide-scrollbars", page.resolve().as_uri())
        assert proc.returncode == 0 and shot.is_file(), proc.stderr[-2000:]
        with Image.open(shot) as img:
            counts.append(_pixels_near(np.asarray(img.convert("RGB"), dtype=np.int16)[:1000],
                                       ORANGE))
    assert counts[1] > counts[0] + 300, counts
