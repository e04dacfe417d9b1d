"""What CPU processes add to the GPU time model sits behind one interface
(`tessel.planner.cpu.CpuTerms`): a GPU profile gets none of it, and the GPU model's modules
read no CPU term themselves. What each term adds to a step: tests/unit/test_sweep_calibration.py."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from tessel.planner import cpu
from tessel.planner.hardware import BUILTIN, get_profile

ROOT = Path(__file__).resolve().parents[2]
H100 = get_profile("h100-sxm")
CPU_FIELDS = {"device_type", "sync_drift", "sync_skew", "collective_curve",
              "tp_block_overhead_s", "tp_block_optimizer_s"}
"""The profile's fields only CPU processes' terms read (device_type: gloo's rules)."""


def test_every_builtin_gpu_profile_gets_no_cpu_terms():
    for profile in BUILTIN.values():
        assert cpu.cpu_terms(profile) is cpu.NO_TERMS, profile.name
    terms = cpu.NO_TERMS
    assert terms.dp_overlap(None) is None and terms.dp_overlap(0.3) == 0.3
    assert terms.scatter == 1.0 and terms.wait(0.5) == 0.0
    assert terms.waits(0.1, 0.8, 12, 4) == cpu.NO_WAITS


def test_a_cpu_profile_gets_gloos_rules_and_its_measured_terms():
    measured = dataclasses.replace(H100, device_type="cpu", sync_drift=0.01, sync_skew=0.04,
                                   collective_curve=((1.0, 1e-3), (2.0, 2e-3)),
                                   tp_block_overhead_s=3e-3, tp_block_optimizer_s=1e-3)
    terms = cpu.cpu_terms(measured)
    assert terms.dp_overlap(None) == cpu.CPU_OVERLAP == 0.0
    assert terms.dp_overlap(0.8) == 0.8  # an explicit overlap (a published run's) wins
    assert terms.scatter == cpu.GLOO_SCATTER
    assert (terms.drift, terms.skew, terms.block_s, terms.block_optimizer_s) == (
        0.01, 0.04, 3e-3, 1e-3)
    assert terms.curve == measured.collective_curve
    # a GPU profile a user gave a measured key gets that term alone, not gloo's rules
    drifting = cpu.cpu_terms(dataclasses.replace(H100, sync_drift=0.02))
    assert drifting.drift == 0.02 and drifting.scatter == 1.0 and drifting.dp_overlap(None) is None


def test_the_waits_spread_a_micro_batch_over_its_collectives():
    terms = cpu.CpuTerms(drift=0.02, skew=0.05)
    assert terms.wait(1e-4) == pytest.approx(0.02 * 1e-2)  # the drift's law on short pieces
    assert terms.wait(1.0) == pytest.approx(0.05)  # the skew's on long ones
    waits = terms.waits(0.4, 3.2, 8, 2)  # 10 synchronising calls in a 0.4-s micro-batch
    assert waits.per_call == pytest.approx(terms.wait(0.04))
    assert waits.first_bucket == waits.per_call  # DDP after the last piece
    alone = terms.waits(0.4, 3.2, 0, 0)  # nothing synchronised before DDP: the whole step
    assert alone.per_call == 0.0 and alone.first_bucket == pytest.approx(0.05 * 3.2)


def test_calibration_stretches_the_cpu_terms_that_are_communication():
    measured = dataclasses.replace(H100, device_type="cpu", sync_drift=0.01, sync_skew=0.04,
                                   collective_curve=((1.0, 1e-3), (2.0, 2e-3)),
                                   tp_block_overhead_s=3e-3)
    slower = cpu.stretched(measured, 3.0)
    assert (slower.sync_drift, slower.sync_skew) == pytest.approx((0.03, 0.12))
    assert [t for _, t in slower.collective_curve] == pytest.approx([3e-3, 6e-3])
    assert slower.tp_block_overhead_s == 3e-3  # host work, not communication
    assert slower.collective_latency_s == measured.collective_latency_s  # the caller's


@pytest.mark.parametrize("module", ["speed", "calls", "compute"])
def test_the_gpu_time_model_reads_no_cpu_term(module: str):
    """speed.py, calls.py and compute.py ask `CpuTerms` (tessel.planner.cpu); none of them
    reads a CPU term of the profile or gloo's rules itself."""
    tree = ast.parse((ROOT / "tessel/planner" / f"{module}.py").read_text())
    read = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    named = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    assert not read & CPU_FIELDS
    assert not named & {"GLOO_SCATTER", "CPU_OVERLAP", "on_curve", "sync_wait"}
