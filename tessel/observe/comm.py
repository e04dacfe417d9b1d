"""Exposed communication: how long each rank was held up by collectives during a step.

A collective that runs while the rank computes costs nothing; one that the rank waits for
costs its whole length. The figure measured here is the *exposed* part: the time a collective
was in flight and the rank computed nothing. It is measured on real training steps with
PyTorch's own profiler (`torch.profiler`), so it sees every collective whoever issues it:
DDP's reducer (C++), FSDP2's all-gathers and reduce-scatters, DTensor's functional
collectives (tensor and context parallelism), the pipeline's send/recv and the experts'
all-to-all all reach the backend through the `c10d::` dispatcher operators, and the backend
records each collective's run (`gloo:*` events on the CPU, NCCL kernels on a GPU). Nothing
is patched and nothing tessel calls itself is special.

How a sampled step is read (what Holistic Trace Analysis calls comm/compute overlap, done
in-process on the profiler's own events, no trace file written):

- CUDA/NCCL (the profile records the GPU alone: no host operator is slowed): communication =
  the NCCL kernels' time, computation = every other kernel's, on any stream; copies and
  memsets are neither. Exposed = time inside an NCCL kernel during which no computing kernel
  ran (the union of the one minus the union of the other). Each NCCL kernel counts as one
  collective (a batch of send/recv is one).
- CPU/gloo: gloo runs a collective on its own threads while the training thread goes on, and
  the training thread blocks when it needs the result. Communication = the collectives' runs
  (`gloo:*` events, any thread) and the training thread's time inside `c10d::` and
  functional-collective operators (issuing; `wait_tensor`: blocking); computation = the
  training thread's `aten::` operators outside those. Exposed = communication time during
  which the training thread ran no computing operator. A wait PyTorch does not record as an
  operator (DDP's reducer, `Work.wait()` from Python) counts while the collective runs; the
  thread's wake-up after it does not. A collective another thread runs during the step (an
  asynchronous checkpoint's) counts as communication in flight too. The collectives are the
  outermost `c10d::` and functional-collective calls (waits left out).

Time that is neither (Python, the autograd engine between nodes, an idle GPU) is not
computation: while a collective is in flight it counts as exposed, as it does in HTA. The
ranks of a collective wait inside it for the slowest one; that wait is communication too
(it is where a slow link or a straggler shows).

Profiling costs time, so one step in `metrics.comm_sample_interval` is profiled (the last of
each such run of steps, counted from `metrics.comm_sample_after`) and the others run
untouched: a step that is not sampled costs a few integer comparisons (~2 us). What a
sampled step costs is measured by benchmarks/comm_sampling.py (docs/performance.md).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

MARKER = "tessel::sampled_step"
"""The record_function around a sampled step: its thread is the training thread."""
_COMM_OPS = ("c10d::", "_c10d_functional::", "c10d_functional::", "_c10d_functional_autograd::")
_NOT_COMM = ("c10d::check_for_nan", "_c10d_functional::_wrap_tensor_autograd")
_WAITS = ("_c10d_functional::wait_tensor", "c10d_functional::wait_tensor")
_BACKEND_RUNS = ("gloo:",)
"""Host events of a collective's run from start to completion, on any thread."""

Interval = tuple[int, int]  # (start, end) in ns


class Event(NamedTuple):
    """One profiler event, as the analysis needs it (a tuple: a step has thousands)."""

    name: str
    start: int  # ns
    end: int  # ns
    thread: int  # the profiler's thread id (host events)
    kernel: bool = False  # a GPU kernel (`thread` is then its stream)


@dataclass(frozen=True)
class CommSplit:
    """What one sampled step spent on communication."""

    exposed_s: float
    """Communication time not hidden behind computation."""
    total_s: float
    """All communication time, hidden or not."""
    collectives: int
    """Collectives issued (outermost `c10d::`/functional-collective calls, waits left out)."""


def is_comm_op(name: str) -> bool:
    return name.startswith(_COMM_OPS) and not name.startswith(_NOT_COMM)


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of `intervals` as sorted, disjoint intervals."""
    out: list[Interval] = []
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def subtract(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """Merged intervals `a` minus merged intervals `b`."""
    out: list[Interval] = []
    j = 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k, cur = j, s
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def length(intervals: Sequence[Interval]) -> int:
    return sum(e - s for s, e in intervals)


def clip(intervals: Iterable[Interval], lo: int, hi: int) -> list[Interval]:
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def count_collectives(events: Sequence[Event]) -> int:
    """Outermost collective calls per thread (a functional collective's inner `c10d::` call
    and the waits are not collectives of their own)."""
    n = 0
    ends: dict[int, int] = {}  # thread -> end of its open outermost collective
    for e in sorted((e for e in events if not e.kernel and is_comm_op(e.name)
                     and not e.name.startswith(_WAITS)), key=lambda e: (e.start, -e.end)):
        if e.start >= ends.get(e.thread, -1):
            n += 1
            ends[e.thread] = e.end
    return n


def split_cpu_step(events: Sequence[Event]) -> CommSplit:
    """Exposed and total communication of one profiled CPU step (the module docstring)."""
    marker = next((e for e in events if e.name == MARKER), None)
    if marker is None:
        raise ValueError(f"no {MARKER} event among the profiled step's events")
    ops = [e for e in events if e.thread == marker.thread]
    calls = merge((e.start, e.end) for e in ops if is_comm_op(e.name))
    runs = [(e.start, e.end) for e in events if e.name.startswith(_BACKEND_RUNS)]
    comm = merge(clip([*calls, *runs], marker.start, marker.end))
    compute = subtract(merge((e.start, e.end) for e in ops if e.name.startswith("aten::")), calls)
    return CommSplit(length(subtract(comm, compute)) / 1e9, length(comm) / 1e9,
                     count_collectives(events))


def split_gpu_step(kernels: Sequence[Event]) -> CommSplit:
    """Exposed and total communication of one profiled GPU step from its kernels (the module
    docstring); each NCCL kernel is one collective (or one batch of send/recv)."""
    comm = [(e.start, e.end) for e in kernels if "nccl" in e.name.lower()]
    compute = merge((e.start, e.end) for e in kernels if "nccl" not in e.name.lower())
    merged = merge(comm)
    return CommSplit(length(subtract(merged, compute)) / 1e9, length(merged) / 1e9, len(comm))


def host_events(prof: Any) -> list[Event]:
    """The events of a finished CPU-only `torch.profiler.profile`, read from the profiler's
    own result (no FunctionEvent tree is built: reading costs more than profiling)."""
    return [Event(e.name(), e.start_ns(), e.end_ns(), e.start_thread_id())
            for e in prof.profiler.kineto_results.events()]


def gpu_kernels(prof: Any) -> list[Event]:
    """The GPU kernels of a finished CUDA-only `torch.profiler.profile` (copies and memsets
    are neither computation nor communication)."""
    cuda = torch.autograd.DeviceType.CUDA
    return [Event(e.name(), e.start_ns(), e.end_ns(), e.device_resource_id(), True)
            for e in prof.profiler.kineto_results.events()
            if e.device_type() == cuda and not e.name().startswith(("Memcpy", "Memset"))]


class CommMeter:
    """Profiles one training step in `every` (0: none) and reports, at log steps, the
    exposed and total communication of the sampled steps, averaged over them and over the
    ranks (`window`). A profile that fails (a profiler of someone else's running, a
    profiler that cannot start) costs the figure, never the run: the rank says so once and
    leaves its samples out."""

    def __init__(self, device: torch.device, every: int, distributed: bool,
                 group: Callable[[], dist.ProcessGroup | None] = lambda: None,
                 say: Callable[[str], None] = lambda _msg: None, after: int = 0):
        """`group()`: a group over every rank that takes CPU tensors, for the gather at log
        steps (None: the default group), asked for only then; `say`: where the one line about
        a failed profile goes; `after`: steps up to this one are never profiled."""
        self.gpu = device.type == "cuda"
        self.every = every
        self.after = after
        if every:
            # Kineto prints lines of its own at every profile's start and stop (torch 2.13:
            # "USDT: ... profiler_start"); 6 silences them. Read at its first profile; a value
            # the user set wins.
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        self.distributed = distributed
        self.group = group
        self.say = say
        self._due = 0  # sampled steps since the last window, profiled or not: the same on every rank
        self._samples: list[CommSplit] = []
        self._failed = False

    @contextlib.contextmanager
    def sampled(self, step: int) -> Iterator[None]:
        """Around training step `step` (1 for the first; the same on every rank): profiles it
        when it is the one in `every` to sample, counted from `after`."""
        if not self.every or step <= self.after or (step - self.after) % self.every:
            yield
            return
        self._due += 1
        prof = self._start()
        if prof is None:
            yield
            return
        try:
            if self.gpu:
                yield  # the GPU's kernels alone: the host's operators are not recorded
            else:
                from torch.profiler import record_function

                with record_function(MARKER):
                    yield
        except BaseException:
            prof.stop()
            raise
        self._finish(prof)

    def _start(self) -> Any:
        """A started profile, or None where none can be."""
        if self._failed or torch.autograd._profiler_enabled():
            return None  # one profiler at a time: someone else's is running
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CUDA if self.gpu else ProfilerActivity.CPU])
        try:
            prof.start()
        except Exception as exc:  # noqa: BLE001 (whatever the profiler's backend raises)
            self._fail(exc)
            return None
        return prof

    def _finish(self, prof: Any) -> None:
        try:
            prof.stop()  # on a GPU: waits for the step's kernels
            self._samples.append(split_gpu_step(gpu_kernels(prof)) if self.gpu
                                 else split_cpu_step(host_events(prof)))
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        self._failed = True
        self.say(f"tessel: exposed communication is not measured on this rank from now on: "
                 f"profiling a step failed ({type(exc).__name__}: {exc})")

    def window(self, step_time_s: float) -> dict[str, float]:
        """The figures of the steps sampled since the last call, for the metrics record
        ({} when there are none): means over the sampled steps and the ranks that measured
        them, and the slowest rank's exposed time. Every rank calls it at every log step; it
        gathers over the ranks when a step was due to be sampled (the same on all of them)."""
        samples, due, self._samples, self._due = self._samples, self._due, [], 0
        if not due:
            return {}
        n = max(len(samples), 1)
        mine = torch.tensor([sum(s.exposed_s for s in samples) / n,
                             sum(s.total_s for s in samples) / n,
                             sum(s.collectives for s in samples) / n,
                             1.0 if samples else 0.0], dtype=torch.float64)
        ranks = [mine]
        if self.distributed:
            ranks = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(ranks, mine, group=self.group())
        if not (kept := [r for r in ranks if r[3] > 0]):
            return {}
        measured = torch.stack(kept)
        exposed, total, collectives, _ = measured.mean(0).tolist()
        return {
            "time_comm_exposed_s": exposed,
            "time_comm_exposed_max_s": float(measured[:, 0].max()),
            "time_comm_s": total,
            "comm_exposed_share": exposed / step_time_s if step_time_s > 0 else 0.0,
            "comm_collectives": collectives,
        }
