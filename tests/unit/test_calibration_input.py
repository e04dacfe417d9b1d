"""What `tessel plan --calibrate PATH` takes: a measured run's or sweep's numbers within what
a run can measure (one line naming the file and the field or point otherwise), a file that is
text and JSON, and a fit that says when it stopped at a limit of its range."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tessel.cli import main
from tessel.config import Config
from tessel.planner import search, sweep_fit
from tessel.planner.hardware import get_profile
from tessel.planner.layout import Layout

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/tiny.toml")


def tiny(world: int = 1, **parallel) -> Config:
    return Config.load(TINY, [f"--parallel.{k}={v}" for k, v in
                              {"dp_shard": world, **parallel}.items()])


def calibrate(tmp_path: Path, capsys, record: dict | bytes, *extra: str) -> tuple[int, str]:
    """`tessel plan configs/tiny.toml --gpus 1 --calibrate FILE`: (exit code, stderr)."""
    path = tmp_path / "run.json"
    if isinstance(record, bytes):
        path.write_bytes(record)
    else:
        path.write_text(json.dumps(record))
    code = main(["plan", TINY, "--gpus", "1", "--calibrate", str(path), *extra])
    return code, capsys.readouterr().err.strip()


def one_line(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("tessel: error: "), err
    for needle in needles:
        assert needle in err


def run_record(tokens_per_s: object = 1000.0, world_size: object = 1, cfg: Config | None = None
               ) -> dict:
    return {"tokens_per_s": tokens_per_s, "world_size": world_size,
            "config": (cfg or tiny()).to_dict()}


@pytest.mark.parametrize("field, value, shown", [
    ("tokens_per_s", float("nan"), "not nan"),
    ("tokens_per_s", float("inf"), "not inf"),
    ("tokens_per_s", True, "not true"),
    ("tokens_per_s", 0, "not 0"),
    ("tokens_per_s", -5, "not -5"),
    ("tokens_per_s", 1e300, "not 1e+300"),
    ("tokens_per_s", "fast", "not 'fast'"),
    ("world_size", True, "not true"),
    ("world_size", 10**12, "not 1e+12"),
    ("world_size", 0, "not 0"),
    ("world_size", 2.0, "not 2"),
])
def test_an_impossible_measurement_is_one_line_naming_file_and_field(tmp_path: Path, capsys,
                                                                     field, value, shown):
    code, err = calibrate(tmp_path, capsys, {**run_record(), field: value})
    one_line(code, err, f"--calibrate {str(tmp_path / 'run.json')!r}: '{field}' must be", shown)


def test_a_run_whose_layout_does_not_fit_its_world_names_the_file(tmp_path: Path, capsys):
    code, err = calibrate(tmp_path, capsys, run_record(world_size=3, cfg=tiny(1, tp=2)))
    one_line(code, err, f"--calibrate {str(tmp_path / 'run.json')!r}: the run's config on its "
                        "world_size 3:")


@pytest.mark.parametrize("content, needle", [
    (b"\xff\xfe{}", "is not UTF-8 text (byte 0: invalid start byte)"),
    (b"[" * 100_000, "nests its arrays or tables too deep to read"),
    (b"{", "is not valid JSON"),
])
def test_a_damaged_calibration_file_is_one_line(tmp_path: Path, capsys, content, needle):
    code, err = calibrate(tmp_path, capsys, content)
    one_line(code, err, f"--calibrate file {str(tmp_path / 'run.json')!r} ", needle)


def test_a_fit_says_when_it_stopped_at_a_limit(tmp_path: Path, capsys):
    code, err = calibrate(tmp_path, capsys, run_record(tokens_per_s=1.0))
    assert code == 0 and ("matmul efficiency 0.625 -> 0.050 (at the limit 0.05: the "
                          "measurement is slower than the model can explain)") in err
    code, err = calibrate(tmp_path, capsys, run_record(tokens_per_s=1e11))
    assert code == 0 and ("-> 1.000 (at the limit 1: the measurement is faster than the model "
                          "can explain)") in err
    h100 = get_profile("h100-sxm")
    middle = search.evaluate(tiny(), Layout.from_config(tiny(), 1), h100).tokens_per_s * 0.5
    code, err = calibrate(tmp_path, capsys, run_record(tokens_per_s=middle))
    assert code == 0 and "matmul efficiency 0.625 -> 0." in err and "limit" not in err


def sweep_record(points: list[tuple[int, Config, float]]) -> dict:
    return {"schema": 1, "measurement": {"device_type": "cuda"},
            "points": [{"gpus": world, "config": cfg.to_dict(),
                        "measured": {"tokens_per_s": tps}} for world, cfg, tps in points]}


@pytest.mark.parametrize("damage, needle", [
    (lambda r: r["points"][1].update(gpus=10**12),
     "points[1].gpus must be a whole number of processes from 1 to 1,048,576, not 1e+12"),
    (lambda r: r["points"][1]["measured"].update(tokens_per_s=1e300),
     "points[1].measured.tokens_per_s must be a positive number"),
    (lambda r: r["points"][1].update(gpus=3),
     "points[1]: the run's config on its 3 processes: "),
])
def test_a_sweep_point_out_of_range_names_the_file_and_point(tmp_path: Path, capsys, damage,
                                                             needle):
    record = sweep_record([(1, tiny(1), 1000.0), (2, tiny(2), 1500.0)])
    damage(record)
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(record))
    assert main(["plan", TINY, "--gpus", "1", "--calibrate", str(path)]) == 2
    one_line(2, capsys.readouterr().err.strip(), f"{str(path)!r}: {needle}")


def test_a_sweep_fit_says_when_the_communication_is_at_a_limit():
    h100 = get_profile("h100-sxm")

    def plan(cfg, layout, hw, device_type):  # noqa: ANN001, ANN202
        return search.evaluate(cfg, layout, hw, device_type)

    one = search.evaluate(tiny(1), Layout.from_config(tiny(1), 1), h100).tokens_per_s / 2
    for two, end in [(1.0, "x20 (at the limit x20: the measurement is slower"),
                     (1e9, "x0.75 (at the limit x0.75: the measurement is faster")]:
        record = sweep_record([(1, tiny(1), one), (2, tiny(2), two)])
        tuned, said = sweep_fit.fit(h100, sweep_fit.read_sweep(record, "s"), plan)
        assert f"communication {end} than the model can explain)" in said
        assert tuned.comm_efficiency <= 1  # a GPU's: at most the links' full bandwidth
    assert "limit" not in said.split(";")[0]  # the matmul efficiency was fitted inside
    assert tuned.comm_efficiency == 1.0


def test_a_run_directory_with_an_impossible_throughput_names_its_record(tmp_path: Path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(Path(TINY).read_text())
    (run / "run.json").write_text(json.dumps({"world_size": 1}))
    rates = [float("nan"), 100.0, 100.0, float("nan"), 100.0]  # the first 2: warm-up, left out
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "tokens_per_s": r}) + "\n"
                                               for i, r in enumerate(rates)))
    assert main(["plan", TINY, "--gpus", "1", "--calibrate", str(run)]) == 2
    one_line(2, capsys.readouterr().err.strip(),
             f"--calibrate {str(run / 'metrics.jsonl')!r}: record 3's 'tokens_per_s' must be a "
             "positive number of tokens/s at most 1e+12, not nan")


def test_the_measured_tables_title_says_when_the_fit_is_at_a_limit():
    from tessel.scaling.compare import fitted_text

    assert fitted_text(None) == ""
    assert fitted_text(0.9123) == ": matmul efficiency 0.9123"
    assert fitted_text(1e-4) == (": matmul efficiency 0.0001 (at the limit 0.0001: the "
                                 "measurement is slower than the model can explain)")
    assert fitted_text(100.0).endswith("(at the limit 100: the measurement is faster than the "
                                       "model can explain)")
