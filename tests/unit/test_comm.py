"""Exposed communication (tessel/observe/comm.py): the overlap analysis on hand-made profiler
events, then on real profiled steps of a one-process gloo group, with and without the
netdelay fault (tessel/train/faults.py) that puts a known wait inside every collective."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from tessel import Trainer
from tessel.observe.comm import (
    MARKER,
    CommMeter,
    Event,
    count_collectives,
    merge,
    split_cpu_step,
    split_gpu_step,
    subtract,
)
from tessel.observe.metrics import read_metrics
from tessel.train.faults import Faults

MS = 1_000_000  # ns


def ev(name: str, start_ms: float, end_ms: float, thread: int = 1, kernel: bool = False) -> Event:
    return Event(name, int(start_ms * MS), int(end_ms * MS), thread, kernel)


def test_interval_union_and_difference():
    assert merge([(5, 9), (0, 2), (1, 3), (9, 10), (4, 4)]) == [(0, 3), (5, 10)]
    assert subtract([(0, 10), (20, 30)], [(2, 3), (5, 22), (29, 40)]) == [(0, 2), (3, 5), (22, 29)]
    assert subtract([(0, 10)], []) == [(0, 10)]


def test_cpu_step_exposed_is_communication_while_the_training_thread_computes_nothing():
    events = [
        ev(MARKER, 0, 100),
        ev("aten::mm", 0, 20),
        ev("c10d::allreduce_", 20, 22),  # issues the collective: not computation
        ev("gloo:all_reduce", 22, 40, thread=2),  # runs on gloo's thread ...
        ev("aten::mm", 30, 50),  # ... hidden from 30 on by this matmul
        ev("aten::add", 55, 70),  # a functional collective's wait inside an operator
        ev("_c10d_functional::wait_tensor", 56, 66),
        ev("_c10d_functional::all_reduce", 80, 84),  # issued: one collective, whose
        ev("c10d::allreduce_", 81, 83),  # c10d call is not another
        ev("gloo:all_reduce", 84, 95, thread=3),
        ev("gloo:all_reduce", 95, 130, thread=3),  # outside the step: clipped at 100
        ev("aten::mm", 0, 90, thread=7),  # another thread's operators are not this rank's compute
    ]
    split = split_cpu_step(events)
    # exposed: 20-30 (issue + unhidden run), 56-66 (the wait), 80-100 (issue, run, clipped)
    assert split.exposed_s == pytest.approx((10 + 10 + 20) / 1000)
    assert split.total_s == pytest.approx((20 + 10 + 20) / 1000)
    assert split.collectives == 2  # the all-reduce and the functional one; waits are none


def test_gpu_step_exposed_is_nccl_kernel_time_no_other_kernel_overlaps():
    kernels = [
        ev("sm90_gemm_kernel", 0, 15, thread=7, kernel=True),
        ev("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 10, 30,
           thread=13, kernel=True),
        ev("vectorized_elementwise_kernel", 25, 40, thread=7, kernel=True),
        ev("ncclDevKernel_SendRecv", 50, 55, thread=14, kernel=True),  # nothing hides it
    ]
    split = split_gpu_step(kernels)
    assert split.exposed_s == pytest.approx((10 + 5) / 1000)  # 15-25 and 50-55
    assert split.total_s == pytest.approx((20 + 5) / 1000)
    assert split.collectives == 2


def test_nested_and_overlapping_calls_count_once_per_thread():
    events = [ev("c10d::broadcast_", 0, 10), ev("c10d::broadcast_", 2, 4),
              ev("c10d::allreduce_", 0, 5, thread=2), ev("c10d::check_for_nan", 6, 7, thread=2),
              ev("c10d::send", 6, 8, thread=2)]
    assert count_collectives(events) == 3


@pytest.fixture
def gloo_group():
    """A one-process gloo group: its collectives run for real on gloo's threads."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _step(group: dist.ProcessGroup) -> None:
    """Computation and four collectives: three c10d ones and a functional one (DTensor's
    kind, whose c10d call inside is not a collective of its own), waited for."""
    x = torch.randn(128, 128)
    for _ in range(3):
        x = x @ x / 128
        dist.all_reduce(x, group=group)
    y = funcol.all_reduce(x, "sum", group)
    (y * 2).sum()


def test_a_profiled_step_sees_every_collective_and_a_delay_inside_them(gloo_group, monkeypatch):
    meter = CommMeter(torch.device("cpu"), every=1, distributed=False)
    with meter.sampled(1):
        _step(gloo_group)
    plain = meter.window(step_time_s=1.0)
    assert plain["comm_collectives"] == 4
    assert 0 < plain["time_comm_exposed_s"] <= plain["time_comm_s"]

    sleeps: list[float] = []
    sleep = time.sleep
    monkeypatch.setattr(time, "sleep", lambda s: (sleeps.append(s), sleep(s)))
    faults = Faults(rank=0, spec="netdelay:seconds=0.05")
    faults.at_step(0)  # turns the delay on
    try:
        with meter.sampled(2):
            _step(gloo_group)
        delayed = meter.window(step_time_s=1.0)
    finally:
        faults.close()
    assert delayed["comm_collectives"] == 4
    # every collective waited once (the functional one's inner c10d call did not wait
    # again), inside its operator: all of it is measured as exposed communication
    assert sleeps == [0.05] * 4
    assert delayed["time_comm_exposed_s"] >= 4 * 0.05
    assert "ADInplaceOrView" not in torch._C._dispatch_dump("c10d::allreduce_")  # off again
    with meter.sampled(3):
        pass
    assert meter.window(1.0)["comm_collectives"] == 0


def test_steps_not_sampled_are_not_profiled():
    meter = CommMeter(torch.device("cpu"), every=3, distributed=False)
    seen = []
    for step in range(1, 7):
        with meter.sampled(step):
            seen.append(torch.autograd._profiler_enabled())
    assert seen == [False, False, True, False, False, True]
    # a benchmark's timed steps left alone: sampling counts from step `after`
    after = CommMeter(torch.device("cpu"), every=2, distributed=False, after=3)
    seen = []
    for step in range(1, 9):
        with after.sampled(step):
            seen.append(torch.autograd._profiler_enabled())
    assert seen == [False, False, False, False, True, False, True, False]
    assert CommMeter(torch.device("cpu"), every=0, distributed=False).window(1.0) == {}


def test_one_process_run_measures_no_communication(tiny_config):
    cfg = tiny_config(**{"train.steps": 4, "metrics.comm_sample_interval": 2,
                         "metrics.tensorboard": True})
    Trainer(cfg, console=False).train()
    recs = [r for r in read_metrics(Path(cfg.run.dir) / "metrics.jsonl") if "loss" in r]
    sampled = [r for r in recs if "time_comm_exposed_s" in r]
    assert [r["step"] for r in sampled] == [2, 4]  # the last step of every two
    for r in sampled:
        assert r["time_comm_exposed_s"] == r["time_comm_s"] == r["comm_collectives"] == 0.0
        assert r["comm_exposed_share"] == 0.0 and math.isfinite(r["time_compute_s"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(cfg.run.dir)
    events.Reload()
    assert [e.step for e in events.Scalars("train/comm_exposed_share")] == [2, 4]


def test_a_profile_that_cannot_be_taken_costs_the_figure_not_the_step(monkeypatch):
    said: list[str] = []
    meter = CommMeter(torch.device("cpu"), every=1, distributed=False, say=said.append)
    with torch.profiler.profile():  # someone else's profiler: one at a time
        with meter.sampled(1):
            torch.ones(3).sum()
    assert meter.window(1.0) == {} and not said

    def broken(_prof):
        raise RuntimeError("no events")

    monkeypatch.setattr("tessel.observe.comm.host_events", broken)
    for step in (2, 3):
        with meter.sampled(step):
            torch.ones(3).sum()
    assert meter.window(1.0) == {} and not torch.autograd._profiler_enabled()
    assert said == ["tessel: exposed communication is not measured on this rank from now on: "
                    "profiling a step failed (RuntimeError: no events)"]
