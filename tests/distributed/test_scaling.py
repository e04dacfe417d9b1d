"""Measured scaling for real: `measure_sweep` runs `tessel train --nproc N` on configs/tiny.toml
at 1, 2 and 3 processes (3 cannot split the global batch of 16 sequences into micro-batches of
8: that point must fail with tessel's one line while the others are measured), and gloo's
all-reduce between two processes. The arithmetic and the failure modes without training:
tests/unit/test_scaling.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessel.config import read_saved
from tessel.scaling import measure_sweep
from tessel.scaling.gloo import measure_gloo

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"

pytestmark = pytest.mark.slow


@pytest.mark.budget(72)  # seconds on the reference machine: measured (51 s), +~40%
def test_a_strong_sweep_measures_each_point_and_reports_the_one_that_fails(tmp_path: Path):
    # synthetic tokens: the config's stdlib corpus would train a tokenizer first (minutes)
    points = measure_sweep(TINY, ["--data.source=synthetic"], [1, 2, 3], tmp_path, warmup=2,
                           steps=3, strong=True)
    assert [p.nproc for p in points] == [1, 2, 3]
    measured, failed = points[:2], points[2]
    for p in measured:
        assert p.ok and not p.short and p.timed_steps == 3, p.error
        assert p.tokens_per_s > 0
        assert p.tokens_per_s_per_process == pytest.approx(p.tokens_per_s / p.nproc)
        assert set(p.split) == {"data", "compute", "optimizer"}
        assert all(v >= 0 for v in p.split.values())
        assert sum(p.split.values()) <= p.step_time_s * (1 + 1e-9)
        saved = read_saved(Path(p.run_dir) / "config.toml")
        assert saved["train"]["global_batch_size"] == 16  # strong scaling: the config's batch
        assert saved["train"]["steps"] == 5 and saved["parallel"]["tp"] == 1
    assert measured[0].efficiency == 1.0
    assert measured[1].efficiency == pytest.approx(
        measured[1].tokens_per_s / measured[0].tokens_per_s / 2)
    assert not failed.ok and failed.exit_code == 2 and failed.tokens_per_s is None
    assert failed.error == ("train.global_batch_size=16 is not divisible by "
                            "micro_batch_size*dp = 8*3; use a multiple of 24 (exit code 2)")


def test_gloo_all_reduce_latency_and_bandwidth_are_measured():
    got = measure_gloo(2, sizes=[4096, 262144, 1 << 20])
    assert got["nproc"] == 2 and len(got["samples"]) == 3
    assert got["latency_s"] > 0 and got["bandwidth_Bps"] > 0
    assert all(s["seconds"] > 0 for s in got["samples"])
