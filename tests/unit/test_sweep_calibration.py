"""The planner against measurement, without running anything: each collective call's latency
in the step time, calibrating a profile on a measured sweep (`tessel plan --calibrate
SWEEP.json`), and the layouts a measured sweep spreads its processes over. The real sweep:
tests/distributed/test_scale_measure.py."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from tessel.cli import main
from tessel.config import Config, ModelConfig
from tessel.errors import TesselError
from tessel.parallel.fsdp import DDP_BUCKET_MB as TRAINER_BUCKET_MB
from tessel.planner import search, sweep_fit
from tessel.planner.calls import tp_calls
from tessel.planner.hardware import get_profile, profile_from_table, profile_table
from tessel.planner.layout import Layout
from tessel.planner.speed import (
    DDP_BUCKET_MB,
    DDP_OVERLAP,
    FSDP_OVERLAP,
    estimate_step,
    rank_parameters,
)
from tessel.scaling.measure import default_layout, layout_over

ROOT = Path(__file__).resolve().parents[2]
H100 = get_profile("h100-sxm")


def lay(world: int, **kw) -> Layout:
    base = {"dp_replicate": 1, "dp_shard": world, "tp": 1, "pp": 1, "cp": 1, "zero": 0,
            "micro_batch": 1}
    base.update(kw)
    return Layout(**base)


def latency_only(step_a, step_b) -> dict[str, float]:
    """What each communication part gained between two predictions."""
    return {f: getattr(step_b, f) - getattr(step_a, f)
            for f in ("tp_comm_s", "pp_comm_s", "raw_comm_s")}


# ---- latency in the step time -----------------------------------------------------------


def test_every_collective_call_costs_the_profiles_latency():
    m = ModelConfig(preset="gpt2-124m")
    none = dataclasses.replace(H100, collective_latency_s=0.0)
    slow = dataclasses.replace(H100, collective_latency_s=1e-3)
    # tensor parallel: per micro-batch, the calls tessel's plan makes (12 layers, SP)
    tp = lay(2, dp_shard=1, tp=2)
    gained = latency_only(estimate_step(m, tp, none, 1024, 8, "bf16"),
                          estimate_step(m, tp, slow, 1024, 8, "bf16"))
    assert tp_calls(tp, 12, 0, True, True) == 12 * 10 + 2 + 6
    assert gained["tp_comm_s"] == pytest.approx(8 * 128 * 1e-3)
    # without sequence parallelism: two all-reduces each way per block
    assert tp_calls(dataclasses.replace(tp, sequence_parallel=False), 12, 0, True, True) == \
        12 * 4 + 2 + 5
    # pipeline: a send each way per micro-batch and stage boundary crossing
    pp = lay(2, dp_shard=1, pp=2, pp_schedule="1f1b")
    gained = latency_only(estimate_step(m, pp, none, 1024, 8, "bf16"),
                          estimate_step(m, pp, slow, 1024, 8, "bf16"))
    assert gained["pp_comm_s"] == pytest.approx(2 * 8 * 1e-3)
    # DDP: one all-reduce per gradient bucket (124M fp32 gradients: 19 buckets of 25 MiB)
    dp = lay(2)
    gained = latency_only(estimate_step(m, dp, none, 1024, 8, "bf16"),
                          estimate_step(m, dp, slow, 1024, 8, "bf16"))
    from tessel.models import param_count

    buckets = math.ceil(4 * param_count(m) / (25 * 2**20))
    assert gained["raw_comm_s"] == pytest.approx(buckets * 1e-3)
    # one process: no call, no latency
    one = lay(1)
    assert estimate_step(m, one, slow, 1024, 8, "bf16") == estimate_step(m, one, none, 1024, 8,
                                                                         "bf16")


def test_cpu_processes_hide_no_data_parallel_communication():
    """On a CPU profile gloo's threads share the computing thread's core: DDP's all-reduce
    and FSDP's collectives are all exposed; a GPU's hide behind the backward / compute."""
    m = ModelConfig(preset="gpt2-124m")
    slow_link = dataclasses.replace(H100, intra_node_gbps=5.0)
    cpu = dataclasses.replace(slow_link, device_type="cpu")
    for layout, overlap in ((lay(2), DDP_OVERLAP), (lay(2, zero=3), FSDP_OVERLAP)):
        gpu_step = estimate_step(m, layout, slow_link, 1024, 8, "bf16")
        cpu_step = estimate_step(m, layout, cpu, 1024, 8, "bf16")
        assert cpu_step.dp_comm_s == pytest.approx(cpu_step.raw_comm_s)
        assert 0 <= gpu_step.dp_comm_s < gpu_step.raw_comm_s <= cpu_step.raw_comm_s
        # an explicit overlap (replaying a published run) still wins
        replay = estimate_step(m, layout, cpu, 1024, 8, "bf16", dp_overlap=overlap).dp_comm_s
        assert replay == pytest.approx(gpu_step.dp_comm_s + cpu_step.raw_comm_s
                                       - gpu_step.raw_comm_s)


def test_gloo_runs_a_reduce_scatter_as_a_whole_all_reduce():
    """torch's gloo backend has no reduce-scatter: it all-reduces the whole tensor and keeps
    the rank's slice, so on a CPU profile a reduce-scatter costs twice its bytes: sequence
    parallelism's all-gather + reduce-scatter pairs 1.5 all-reduces' bytes, FSDP's gradient
    reduce-scatters twice theirs; all-reduces and all-gathers as on a GPU."""
    m = ModelConfig(preset="gpt2-124m")
    bytes_only = dataclasses.replace(H100, intra_node_gbps=5.0, collective_latency_s=0.0)
    cpu = dataclasses.replace(bytes_only, device_type="cpu")
    sp, no_sp = (lay(2, dp_shard=1, tp=2, sequence_parallel=s) for s in (True, False))
    assert estimate_step(m, sp, cpu, 1024, 8, "bf16").tp_comm_s == pytest.approx(
        1.5 * estimate_step(m, sp, bytes_only, 1024, 8, "bf16").tp_comm_s)
    assert estimate_step(m, no_sp, cpu, 1024, 8, "bf16").tp_comm_s == pytest.approx(
        estimate_step(m, no_sp, bytes_only, 1024, 8, "bf16").tp_comm_s)
    # ZeRO-3 on 2 ranks, 4 micro-batches each: 8 gathers of the bf16 parameters and 4
    # reduce-scatters of the fp32 gradients (half of each crosses the link), the latter
    # twice on gloo
    fsdp = lay(2, zero=3)
    scatters = 4 * 0.5 * 4 * rank_parameters(m, fsdp, 0).total / (5e9 * H100.comm_efficiency)
    assert (estimate_step(m, fsdp, cpu, 1024, 8, "bf16").raw_comm_s
            - estimate_step(m, fsdp, bytes_only, 1024, 8, "bf16").raw_comm_s
            == pytest.approx(scatters))


def test_a_measured_curve_prices_each_call_at_its_size():
    """A CPU profile's measured curve of a call's time against the bytes each rank sends
    (collective_curve) replaces latency + bytes / bandwidth for the tensor-parallel calls and
    DDP's buckets: piecewise linear, the last slope beyond it, the first point below it; an
    all-gather costs half an all-reduce of twice its ring bytes (its second half)."""
    from tessel.planner.calls import ring_bytes
    from tessel.planner.cpu import on_curve

    curve = ((1000.0, 1e-3), (2000.0, 2e-3), (4000.0, 3e-3))
    assert on_curve(curve, 10.0) == 1e-3  # a call costs at least the smallest one's time
    assert on_curve(curve, 1500.0) == pytest.approx(1.5e-3)
    assert on_curve(curve, 3000.0) == pytest.approx(2.5e-3)
    assert on_curve(curve, 8000.0) == pytest.approx(5e-3)  # the last slope onwards

    m = ModelConfig(preset="gpt2-124m")  # 12 blocks
    cpu = dataclasses.replace(H100, device_type="cpu", collective_latency_s=0.0)
    flat = dataclasses.replace(cpu, collective_curve=((1.0, 1e-3), (1e12, 1e-3)))
    micro_batches = 8
    for sp in (False, True):
        layout = lay(2, dp_shard=1, tp=2, sequence_parallel=sp)
        calls = tp_calls(layout, 12, 0, first=True, last=True)
        got = estimate_step(m, layout, flat, 1024, 8, "bf16").tp_comm_s
        # every call 1 ms, but with sequence parallelism the all-gathers (one per block's
        # activation collective, and the embedding's and output's one) half of it
        gathers = 4 * 12 + 2 if sp else 0
        assert got == pytest.approx(micro_batches * (calls - gathers / 2) * 1e-3)
        doubled = dataclasses.replace(flat, collective_curve=((1.0, 2e-3), (1e12, 2e-3)))
        assert estimate_step(m, layout, doubled, 1024, 8, "bf16").tp_comm_s == pytest.approx(
            2 * got)
    # DDP: each 25-MiB bucket at its size on the curve (dp_overlap 0: nothing hidden)
    sloped = dataclasses.replace(cpu, collective_curve=((1.0, 1e-3), (1e9, 1.001)))
    ddp = lay(2)
    grads = 4.0 * rank_parameters(m, ddp, 0).total
    buckets = math.ceil(grads / (DDP_BUCKET_MB * 2**20))
    assert estimate_step(m, ddp, sloped, 1024, 8, "bf16", dp_overlap=0.0).dp_comm_s == (
        pytest.approx(buckets * on_curve(sloped.collective_curve,
                                         ring_bytes(grads / buckets, 2, True))))
    # a GPU profile has no curve: its prediction is the line's, as before
    assert H100.collective_curve == ()


def test_the_probes_curve_never_falls_and_counts_ring_bytes():
    from tessel.scaling.gloo import curve

    got = curve([(16384, 5e-4), (1024, 1.37e-3), (1 << 20, 1.8e-3), (262144, 1.0e-3)], 2)
    # ascending bytes; the 1-KB call that read slower than the 16-KB one is pooled with it
    assert [b for b, _ in got] == [1024, 16384, 262144, 1 << 20]
    assert [t for _, t in got] == pytest.approx([9.35e-4, 9.35e-4, 1.0e-3, 1.8e-3])
    assert [b for b, _ in curve([(1024, 1e-3), (4096, 2e-3)], 4)] == [1536, 6144]


def test_a_tensor_parallel_block_adds_the_profiles_host_time():
    m = ModelConfig(preset="gpt2-124m")  # 12 blocks
    host = dataclasses.replace(H100, tp_block_overhead_s=1e-3, tp_block_optimizer_s=2e-4)
    for layout, blocks in ((lay(2, dp_shard=1, tp=2), 12),
                           (lay(4, dp_shard=1, tp=2, pp=2, pp_schedule="1f1b"), 6)):
        micro_batches = 8
        with_host = estimate_step(m, layout, host, 1024, 8, "bf16")
        without = estimate_step(m, layout, H100, 1024, 8, "bf16")
        # the busiest stage's blocks, per micro-batch and per optimizer step
        assert with_host.compute_s - without.compute_s == pytest.approx(
            micro_batches * blocks * 1e-3)
        assert with_host.optimizer_s - without.optimizer_s == pytest.approx(blocks * 2e-4)
    one = lay(2)  # no tensor parallelism: no DTensor block
    assert estimate_step(m, one, host, 1024, 8, "bf16") == estimate_step(m, one, H100, 1024, 8,
                                                                         "bf16")


def test_the_ranks_drift_makes_each_synchronising_collective_wait():
    """sync_drift x sqrt(the compute since the previous collective), per collective: a
    tensor-parallel micro-batch's compute spread over its calls; DDP's one wait after the
    step's whole compute; nothing without collectives; nothing for the built-in GPUs (0)."""
    from tessel.planner.calls import tp_calls

    m = ModelConfig(preset="gpt2-124m")
    drifting = dataclasses.replace(H100, sync_drift=0.02)
    micro_batches = 8
    tp = lay(2, dp_shard=1, tp=2)
    base, slow = (estimate_step(m, tp, h, 1024, 8, "bf16") for h in (H100, drifting))
    calls = tp_calls(tp, 12, 0, first=True, last=True)
    t_mb = base.compute_s / micro_batches
    assert slow.tp_comm_s - base.tp_comm_s == pytest.approx(
        micro_batches * calls * 0.02 * math.sqrt(t_mb / calls))
    assert slow.compute_s == base.compute_s and slow.dp_comm_s == base.dp_comm_s == 0
    ddp = lay(2)  # dp=2, DDP: accumulation without synchronising, one wait per step
    base, slow = (estimate_step(m, ddp, h, 1024, 8, "bf16", dp_overlap=0.0)
                  for h in (H100, drifting))
    assert slow.dp_comm_s - base.dp_comm_s == pytest.approx(0.02 * math.sqrt(base.compute_s))
    one = lay(1)
    assert estimate_step(m, one, drifting, 1024, 8, "bf16") == estimate_step(
        m, one, H100, 1024, 8, "bf16")


def test_a_steady_difference_in_speed_counts_where_it_exceeds_the_drift():
    """sync_skew x L, where larger than sync_drift x sqrt(L): DDP's one wait after a step's
    whole compute takes it; a tensor-parallel block's short pieces keep the drift."""
    from tessel.planner.calls import tp_calls
    from tessel.planner.cpu import sync_wait

    m = ModelConfig(preset="gpt2-124m")
    drifting = dataclasses.replace(H100, sync_drift=0.002)
    skewed = dataclasses.replace(drifting, sync_skew=0.05)
    assert sync_wait(skewed, 1.0) == pytest.approx(0.05)  # 0.05 x 1 > 0.002 x 1
    assert sync_wait(skewed, 1e-4) == pytest.approx(2e-5)  # 0.002 x 0.01 > 0.05 x 1e-4
    ddp = lay(2)
    base, drift, skew = (estimate_step(m, ddp, h, 1024, 8, "bf16", dp_overlap=0.0)
                         for h in (H100, drifting, skewed))
    assert 0.05 * base.compute_s > 0.002 * math.sqrt(base.compute_s)  # a step is long enough
    assert skew.dp_comm_s - base.dp_comm_s == pytest.approx(0.05 * base.compute_s)
    assert drift.dp_comm_s < skew.dp_comm_s
    tp = lay(2, dp_shard=1, tp=2)
    calls = tp_calls(tp, 12, 0, first=True, last=True)
    piece = estimate_step(m, tp, H100, 1024, 8, "bf16").compute_s / 8 / calls
    assert 0.05 * piece < 0.002 * math.sqrt(piece)  # a piece is short: the drift's law
    assert estimate_step(m, tp, skewed, 1024, 8, "bf16") == estimate_step(m, tp, drifting,
                                                                          1024, 8, "bf16")


def test_the_optimizers_rate_is_fitted_on_its_measured_phase():
    from tessel.planner.hardware import calibrate_optimizer

    cfg = tiny(1)
    layout = Layout.from_config(cfg, 1)
    cpu = dataclasses.replace(H100, device_type="cpu", hbm_gbps=15.0)
    predicted = plan(cfg, layout, cpu, "cpu").step.optimizer_s
    tuned = calibrate_optimizer(cpu, lambda h: plan(cfg, layout, h, "cpu").step.optimizer_s,
                                3 * predicted)
    assert tuned.hbm_gbps == pytest.approx(5.0, rel=1e-3)
    assert plan(cfg, layout, tuned, "cpu").step.optimizer_s == pytest.approx(3 * predicted,
                                                                             rel=1e-3)
    with pytest.raises(TesselError, match="positive measured optimizer time"):
        calibrate_optimizer(cpu, lambda h: 1.0, 0.0)


def test_the_planners_ddp_buckets_are_the_trainers():
    assert DDP_BUCKET_MB == TRAINER_BUCKET_MB


def test_a_profile_round_trips_through_its_table_and_bad_values_are_one_line():
    cpu = dataclasses.replace(H100, name="cpu-x", collective_latency_s=5.5e-4, device_type="cpu",
                              matmul_efficiency=0.001234567, tp_block_overhead_s=0.0123,
                              tp_block_optimizer_s=0.0045, sync_drift=0.0151, sync_skew=0.047,
                              collective_curve=((1024.0, 9e-4), (1.5e6, 2e-3), (2.4e7, 0.011)))
    table = json.loads(json.dumps(profile_table(cpu)))  # as a sweep's JSON carries it
    assert table["collective_curve_us"] == [[1024.0, pytest.approx(900.0)],
                                            [1.5e6, pytest.approx(2000.0)],
                                            [2.4e7, pytest.approx(11000.0)]]
    assert "collective_curve_us" not in profile_table(H100)  # none for a GPU
    assert table["sync_drift"] == pytest.approx(0.0151)
    assert table["sync_skew"] == pytest.approx(0.047)
    assert table["collective_latency_us"] == pytest.approx(550.0)
    assert table["tp_block_overhead_us"] == pytest.approx(12300.0)
    assert table["tp_block_optimizer_us"] == pytest.approx(4500.0)
    assert profile_from_table("cpu-x", table) == cpu  # full precision, device type kept
    assert profile_from_table("cpu-x", {**table, "collective_curve_us": []}).collective_curve == ()
    for key, value, needle in [("collective_latency_us", -1, "collective_latency_us must be"),
                               ("collective_latency_us", float("nan"), "collective_latency_us"),
                               ("tp_block_overhead_us", -3, "tp_block_overhead_us must be"),
                               ("tp_block_overhead_us", "1 ms", "tp_block_overhead_us must be"),
                               ("sync_drift", -0.1, "sync_drift must be a number >= 0"),
                               ("sync_drift", True, "sync_drift must be a number >= 0"),
                               ("sync_skew", -0.01, "sync_skew must be a number >= 0"),
                               ("sync_skew", "5%", "sync_skew must be a number >= 0"),
                               ("device_type", "tpu", "device_type must be"),
                               ("bf16_tflops", "fast", "bf16_tflops must be a positive number"),
                               ("hbm_gbps", float("inf"), "hbm_gbps must be a positive"),
                               ("device_names", "H100", "device_names must be a list"),
                               ("collective_curve_us", [[1024, 900]], "at least 2 \\[bytes"),
                               ("collective_curve_us", [[2048, 900], [1024, 950]],
                                "in ascending bytes"),
                               ("collective_curve_us", [[1024, -1], [2048, 950]], "microseconds"),
                               ("collective_curve_us", [[0, 1], [2048, 950]], "bytes > 0"),
                               ("collective_curve_us", [[1024, "1 ms"], [2048, 9]], "pairs"),
                               ("collective_curve_us", [[1024, True], [2048, 9]], "pairs"),
                               ("collective_curve_us", [[1024, 9, 1], [2048, 9]], "pairs"),
                               ("collective_curve_us", "fast", "must be a list")]:
        with pytest.raises(TesselError, match=needle):
            profile_from_table("cpu-x", {**table, key: value})
    with pytest.raises(TesselError, match="not a table"):
        profile_from_table("cpu-x", [1, 2])


# ---- the layouts of a measured sweep ----------------------------------------------------


def test_a_sweep_spreads_its_processes_over_one_dimension():
    assert layout_over("dp") is default_layout
    assert layout_over("tp")(2) == {**default_layout(2), "parallel.dp_shard": 1, "parallel.tp": 2}
    assert layout_over("pp")(4)["parallel.pp"] == 4
    ep = layout_over("ep")(2)  # borrows the data-parallel ranks: dp_shard fills the world
    assert ep["parallel.ep"] == 2 and ep["parallel.dp_shard"] == -1
    with pytest.raises(TesselError, match="cannot spread processes over 'zz'; choose one of dp"):
        layout_over("zz")


# ---- calibrating on a measured sweep ----------------------------------------------------


def tiny(world: int, **parallel) -> Config:
    return Config.load(ROOT / "configs/tiny.toml", [f"--parallel.{k}={v}" for k, v in
                                                    {"dp_shard": world, **parallel}.items()])


def plan(cfg: Config, layout: Layout, hw, device_type: str):  # noqa: ANN201
    return search.evaluate(cfg, layout, hw, device_type)


def predict(cfg: Config, layout: Layout, hw, device_type: str) -> float:
    return plan(cfg, layout, hw, device_type).tokens_per_s


def sweep_record(truth, points: list[tuple[int, Config]], profile=None) -> dict:
    """A `tessel scale --measure --json` record whose measurements are what `truth` predicts."""
    out = []
    for world, cfg in points:
        step = plan(cfg, Layout.from_config(cfg, world), truth, "cpu")
        out.append({"gpus": world, "config": cfg.to_dict(), "measured": {
            "tokens_per_s": step.tokens_per_s, "split": {"optimizer": step.step.optimizer_s}}})
    out.append({"gpus": 3, "measured": {"tokens_per_s": None, "error": "refused"}})
    return {"schema": 1, "points": out,
            "measurement": {"device_type": "cpu", "machine": {},
                            "profile": None if profile is None else profile_table(profile)},
            "gpu": {"name": "cpu-measured"}}


CURVE = ((1024.0, 9e-4), (262144.0, 1.4e-3), (1 << 20, 2e-3), (16 << 20, 1.2e-2))
"""A measured curve of a gloo call's time (shaped like the project's machine's)."""


@pytest.fixture(scope="module")
def cpu_truth():
    """A CPU-like machine: slow matmuls, slow links, gloo's latency."""
    return dataclasses.replace(
        H100, name="cpu-measured", bf16_flops=1.4e11, intra_node_gbps=1.0, inter_node_gbps=1.0,
        gpus_per_node=2, hbm_gbps=8.0, memory_gib=12.0, comm_efficiency=1.0,
        collective_latency_s=5e-4, device_type="cpu", matmul_efficiency=0.9, sync_drift=0.01,
        sync_skew=0.04, collective_curve=CURVE)


def test_a_sweep_fixes_the_matmul_rate_and_the_communication(cpu_truth, tmp_path: Path):
    """Measurements made by a machine whose communication is 3x slower than its profile
    says, and whose optimizer reaches a third of the memory rate: the fit finds both and
    then predicts every measured point."""
    slower = dataclasses.replace(cpu_truth, comm_efficiency=1.0 / 3,
                                 collective_latency_s=3 * 5e-4, matmul_efficiency=0.7,
                                 hbm_gbps=cpu_truth.hbm_gbps / 3, sync_drift=3 * 0.01,
                                 sync_skew=3 * 0.04,
                                 collective_curve=tuple((b, 3 * t) for b, t in CURVE))
    points = [(1, tiny(1)), (2, tiny(2, dp_shard=1, tp=2)), (2, tiny(2, dp_shard=1, pp=2))]
    record = sweep_record(slower, points, profile=cpu_truth)
    sweep = sweep_fit.read_sweep(record, "sweep.json")
    assert [r.world for r in sweep.runs] == [1, 2, 2]  # the failed point is left out
    assert sweep.profile == cpu_truth and sweep.device_type == "cpu"
    tuned, said = sweep_fit.fit(sweep.profile, sweep, plan)
    assert tuned.hbm_gbps == pytest.approx(8.0 / 3, rel=1e-3)
    assert tuned.matmul_efficiency == pytest.approx(0.7, rel=1e-3)
    assert tuned.collective_latency_s == pytest.approx(1.5e-3, rel=1e-3)
    assert tuned.comm_efficiency == pytest.approx(1 / 3, rel=1e-3)
    assert tuned.sync_drift == pytest.approx(0.03, rel=1e-3)
    assert tuned.sync_skew == pytest.approx(0.12, rel=1e-3)
    assert [t for _, t in tuned.collective_curve] == pytest.approx([3 * t for _, t in CURVE],
                                                                   rel=1e-3)
    for world, cfg in points:
        lay_ = Layout.from_config(cfg, world)
        assert predict(cfg, lay_, tuned, "cpu") == pytest.approx(
            predict(cfg, lay_, slower, "cpu"), rel=2e-3)
    assert "communication x3 " in said and "from 2 multi-process point(s)" in said

    # the command: `tessel plan --calibrate SWEEP.json` plans with the sweep's own profile
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(record))
    saved = tmp_path / "hw.toml"
    assert main(["plan", str(ROOT / "configs/tiny.toml"), "--gpus", "2", "--calibrate", str(path),
                 "--save-hardware", str(saved), "--parallel.tp=2", "--parallel.dp_shard=1"]) == 0
    from tessel.planner.hardware import load_profiles

    again = load_profiles(saved)["cpu-measured"]
    assert again.device_type == "cpu"
    assert again.collective_latency_s == pytest.approx(1.5e-3, rel=1e-3)


def test_a_single_point_sweep_fits_the_matmul_rate_only(cpu_truth):
    record = sweep_record(cpu_truth, [(1, tiny(1))], profile=cpu_truth)
    tuned, said = sweep_fit.fit(cpu_truth, sweep_fit.read_sweep(record, "s"), plan)
    assert tuned.comm_efficiency == cpu_truth.comm_efficiency
    assert said.endswith("no multi-process point: communication not fitted")


@pytest.mark.parametrize("damage, needle", [
    (lambda r: r["points"][0].pop("config"), "points\\[0\\] has no 'config'"),
    (lambda r: r["points"][0]["measured"].update(tokens_per_s=-5), "must be a positive number"),
    (lambda r: r["points"][0]["measured"].update(tokens_per_s=True), "must be a positive number"),
    (lambda r: r["points"][0].update(gpus="2"), "gpus must be a whole number"),
    (lambda r: r["measurement"].update(device_type="tpu"), "device_type must be"),
    (lambda r: r["measurement"].update(profile={"bf16_tflops": 1}), "lacks gpus_per_node"),
    (lambda r: r.update(points=[r["points"][-1]]), "no point of the sweep measured"),
])
def test_a_damaged_sweep_is_one_line(cpu_truth, tmp_path: Path, capsys, damage, needle):
    record = sweep_record(cpu_truth, [(1, tiny(1))], profile=cpu_truth)
    damage(record)
    with pytest.raises(TesselError, match=needle):
        sweep_fit.read_sweep(record, "s")
    path = tmp_path / "s.json"
    path.write_text(json.dumps(record))
    assert main(["plan", str(ROOT / "configs/tiny.toml"), "--gpus", "1",
                 "--calibrate", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
