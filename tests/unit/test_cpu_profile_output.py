"""`tessel plan` and `tessel scale` on a profile of CPU processes (`device_type = "cpu"`, as
`tessel scale --measure` makes one): the output speaks of processes and of the profile's peak,
not of GPUs, MFU (a GPU's dense BF16 peak) or bf16, which CPU processes do not run."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from tessel.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/tiny.toml")
CPU = ('[gpu.cpu-x]\nbf16_tflops = 0.2\nmemory_gib = 16\nintra_node_gbps = 5\n'
       'inter_node_gbps = 5\ngpus_per_node = 2\ndevice_type = "cpu"\n')


@pytest.fixture(scope="module")
def cpu_profile(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("hw") / "hw.toml"
    path.write_text(CPU)
    return str(path)


def stdout(*argv: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(list(argv)) == 0, err.getvalue()
    return out.getvalue()


def test_a_sweep_on_cpu_processes_counts_processes(cpu_profile: str):
    out = stdout("scale", TINY, "--gpus", "1,2", "--gpu", "cpu-x", "--hardware", cpu_profile)
    assert "(0.2 TFLOP/s peak, 16.0 GiB, 2 per node)" in out.splitlines()[0]
    assert "procs  model" in out and "tokens/s/proc" in out and "of peak" in out
    assert "GiB/proc" in out and "baseline: the 1-process point" in out
    assert "GPU" not in out and "MFU" not in out and "bf16" not in out


def test_a_plan_on_cpu_processes_counts_processes(cpu_profile: str):
    out = stdout("plan", TINY, "--gpus", "2", "--gpu", "cpu-x", "--hardware", cpu_profile)
    lines = out.splitlines()
    assert "2 x cpu-x (0.2 TFLOP/s peak, 16.0 GiB, 2 per node)" in lines[0]
    assert "bf16" not in lines[0]
    head = next(line for line in lines if line.startswith("rank  layout"))
    assert "GiB/proc" in head and "of peak" in head and "GPU" not in head and "MFU" not in head
    assert "      memory GiB/proc (pipeline rank" in out
    row = lines[lines.index(head) + 1].split()
    assert row[0] == "1" and row[-3].endswith("%")  # the columns still line up under it


def test_the_profile_list_shows_a_cpu_profiles_peak_not_bf16(cpu_profile: str):
    rows = {line.split()[0]: line for line in
            stdout("plan", "--gpu", "list", "--hardware", cpu_profile).splitlines()}
    assert rows["cpu-x"].startswith("cpu-x        peak   0.2  fp8     - TFLOP/s    16.0 GiB")
    assert rows["h100-sxm"].startswith("h100-sxm     bf16   989  fp8  1979 TFLOP/s    80.0 GiB")


def test_the_page_of_a_cpu_sweep_counts_processes(cpu_profile: str, tmp_path: Path):
    page = tmp_path / "page.html"
    stdout("scale", TINY, "--gpus", "1,2", "--gpu", "cpu-x", "--hardware", cpu_profile,
           "--html", str(page))
    html = page.read_text().split("<details>")[0]  # (the planner's assumptions follow)
    for shown in ("<th>processes</th>", "<th>GiB/proc</th>", "<th>tokens/s/proc</th>",
                  "<th>of peak</th>", "Tokens/s per process", "of peak (%)",
                  ">processes</text>", "1 processes: ", "the same global batch on more processes",
                  "predicted peak per process", "0.2 TFLOP/s peak"):
        assert shown in html, shown
    assert "GPU" not in html and "MFU" not in html and "bf16" not in html
