"""The all-reduce cost of gloo between local processes, measured once: a latency and a bus
bandwidth, for calibrating the planner's communication model on a CPU machine.

`measure_gloo(nproc, sizes)` starts `nproc` Python processes (rendezvous through a file in a
private temporary directory: no port to race for), which all-reduce float32 tensors of each
size in runs of calls one after another, as training issues them; the time per call (each
run's total over its calls: a run holds what one call leaves to the next, such as the ranks
leaving it at different moments), the median over the rounds, averaged over the ranks, is
one sample per size. The samples are the planner's curve of a call's time against its
bytes (`GpuProfile.collective_curve`), and they are fitted as

    t(size) = latency + 2 (n - 1) / n * bytes / bandwidth

(the ring all-reduce's bytes per rank, the convention of the planner's `_ring` and of
nccl-tests' "bus bandwidth"), by least squares over the sizes, for what prices collectives
off the curve. The curve is not a line on a CPU machine: on the project's 2-core virtual
machine a call of 1-4 KB took 0.6-1.5 ms, one of 64 KB-2 MB 1.6-2.5 ms and one of 16 MB
11.7-12.1 ms, where the line's latency said 0.4-0.5 ms (an earlier probe timed one call
after a barrier: 0.4 ms at 4 KB).

The same processes then measure how far they drift apart in training-like use (the
profile's `sync_drift` and `sync_skew`): every rank runs the same work for a segment of L
seconds (the config's model, one block deep at its own width, forward and backward on a
sequence of 128 tokens, when the sweep gives one; matmuls otherwise), then a one-number
all-reduce, then a second one at once. The first waits for the slowest rank; the second, which starts
with the ranks together, is the call alone: their difference, each rank's median over its
segments averaged over the ranks, is what a collective waits for after L seconds of
compute. A model's operators drift apart more than matmuls do: after ~130 ms of the demo
model's (on 128 tokens), 1.1-6.2 ms against 0-0.9 ms.
It is measured within each segment, so that a change of the machine's speed between two
timed loops does not enter it (the method before subtracted the times of the same segments
timed alone and then synchronised; on the project's noisy machine neither is steady between
sweeps: 0.004-0.052 for this one in 27 sweeps of an hour). It is fitted as
sync_drift x sqrt(L) (independent noise in each rank's operators adds up like a random walk)
over segments of 8 and 32 ms, the pieces of a tensor-parallel block, and measured after
128 ms too, a small model's step. On the project's 2-core machine the wait was 1.1-1.7
ms after 9-12 ms of compute, 1.3-3.6 after 27-51, 4.7-12.5 after 136-147 and 13-30 after
313-357 (matmuls): faster than sqrt(L) beyond ~50 ms, in proportion to L (as if one
rank's core ran steadily slower). The longest segment's wait over its length is therefore
kept too (sync_skew), and the planner charges the larger of the two laws.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from tessel.errors import TesselError
from tessel.planner.calls import ring_bytes

DEFAULT_SIZES = (1024, 16384, 262144, 1 << 20, 4 << 20, 16 << 20)
"""Message sizes in bytes: from latency-bound to bandwidth-bound on loopback (a norm's
weight gradient, a loss statistic, a tensor-parallel activation, up to a small model's one
DDP bucket of gradients)."""
WARMUP = 2
"""Untimed rounds over the sizes (connection set-up, allocator)."""
REPEATS = 9
"""Timed rounds; the median time per call of each size is kept."""
RUN_SECONDS = 0.02
"""Seconds of calls one after another in each round's run of a size (2 to 20 calls)."""
WORKER = "from tessel.scaling.gloo import worker_main; worker_main()"
DRIFT_SEGMENTS_S = (0.008, 0.032, 0.128)
"""Compute between the all-reduces of the drift measurement, seconds: the pieces of a
tensor-parallel block to a small model's step."""
DRIFT_SECONDS = 0.4
"""Seconds of segments per length (at least 6 segments)."""
DRIFT_TOKENS = 128
"""Tokens of one piece of a model's segments (`_model_piece`): one sequence of a short
context. With 16 the operators were so small that their host work set the pace, and the
waits after 128 ms (3-64 ms, one rank ~30% slower for a second at a time) were 1-10x those
of the model's own step (~3.5 ms after a demo model's micro-batch of 170 ms)."""


def fit(samples: Sequence[tuple[float, float]], nproc: int) -> dict[str, float]:
    """{"latency_s", "bandwidth_Bps"} from (bytes, seconds) samples: the line through (ring
    bytes, seconds) with the least squared *relative* error (weights 1/t^2), so that the
    small messages, whose times are the latency, count as much as the large ones. Where a
    noisy machine bends the line below zero the figures are what the samples show directly:
    a negative latency becomes the smallest message's time; when larger messages were not
    slower, the bandwidth is the largest one's ring bytes over its time."""
    xs = [ring_bytes(b, nproc, all_reduce=True) for b, _ in samples]
    ts = [t for _, t in samples]
    ws = [1 / t**2 if t > 0 else 0.0 for t in ts]
    total = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / total if total else 0.0
    mt = sum(w * t for w, t in zip(ws, ts)) / total if total else 0.0
    var = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    slope = sum(w * (x - mx) * (t - mt) for w, x, t in zip(ws, xs, ts)) / var if var else 0.0
    latency = mt - slope * mx
    big = max(range(len(xs)), key=xs.__getitem__)
    small = min(range(len(xs)), key=xs.__getitem__)
    if slope <= 0:  # larger messages were not slower: the line means nothing
        return {"latency_s": ts[small], "bandwidth_Bps": xs[big] / max(ts[big], 1e-12)}
    return {"latency_s": latency if latency > 0 else ts[small], "bandwidth_Bps": 1 / slope}


def curve(samples: Sequence[tuple[float, float]], nproc: int) -> tuple[tuple[float, float], ...]:
    """The planner's curve (GpuProfile.collective_curve) from (bytes, seconds) samples of
    all-reduces between `nproc` processes: (ring bytes per rank, seconds), ascending, made
    non-decreasing by pooling neighbours that fall (a larger message is not faster; a
    smaller one that read slower was noise, shared out over both)."""
    points = sorted((ring_bytes(b, nproc, all_reduce=True), t) for b, t in samples)
    pools: list[list[float]] = []  # [sum of times, count] per run of pooled points
    for _, t in points:
        pools.append([t, 1.0])
        while len(pools) > 1 and pools[-2][0] / pools[-2][1] > pools[-1][0] / pools[-1][1]:
            total, count = pools.pop()
            pools[-1][0] += total
            pools[-1][1] += count
    times = [total / count for total, count in pools for _ in range(int(count))]
    return tuple((b, t) for (b, _), t in zip(points, times))


def measure_gloo(nproc: int = 2, sizes: Sequence[int] = DEFAULT_SIZES,
                 timeout_s: float = 120.0, tp_model: dict[str, Any] | None = None,
                 tp_tokens: tuple[int, int] = (8, 128),
                 sequence_parallel: bool = True, slow_last_rank: float = 0.0,
                 drift_model: dict[str, Any] | None = None) -> dict[str, object]:
    """Latency (s) and bus bandwidth (bytes/s) of a gloo all-reduce between `nproc` local
    processes, with the per-size medians they were fitted to:
    {"nproc", "latency_s", "bandwidth_Bps", "samples": [{"bytes", "seconds"}, ...]}; with
    `tp_model` (a ModelConfig's fields) also "tp_block_overhead_s" and
    "tp_block_optimizer_s", the time a tensor-parallel block of that model adds over the
    `nproc` processes beyond its share of the compute, per micro-batch of `tp_tokens`
    (sequences, positions) and per optimizer phase (`tessel.scaling.tp_cost`).
    `slow_last_rank`: a fire drill for the drift measurement, the last rank sleeps this
    many times its own compute in each segment (a rank that much slower: its peers wait
    for it), so the drill's wait grows with the segment as the noise of a loaded machine
    does. `drift_model` (a ModelConfig's fields): the drift's segments
    run that architecture's operators (`drift`) instead of matmuls."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 2:
        raise TesselError(f"an all-reduce needs at least 2 processes (got {nproc!r})")
    if len(sizes) < 2 or any(isinstance(s, bool) or not isinstance(s, int) or s < 4
                             for s in sizes):
        raise TesselError(f"give at least two message sizes of >= 4 bytes (got {list(sizes)})")
    with tempfile.TemporaryDirectory(prefix="tessel-gloo-") as tmp:
        spec = json.dumps({"world": nproc, "store": str(Path(tmp) / "store"),
                           "sizes": list(sizes), "tp_model": tp_model,
                           "tp_tokens": list(tp_tokens),
                           "sequence_parallel": sequence_parallel,
                           "slow_last_rank": slow_last_rank, "drift_model": drift_model})
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs: list[subprocess.Popen[str]] = []
        outs = []
        try:
            # One process group of their own (the first's): whatever ends this measurement (a
            # failed start, a timeout, our Ctrl-C) kills every one started, none is left over.
            for rank in range(nproc):
                group = {"process_group": 0} if not procs else {"process_group": procs[0].pid}
                procs.append(subprocess.Popen([sys.executable, "-c", WORKER, str(rank), spec],
                                              env=env, stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True, **group))
            for p in procs:
                outs.append(p.communicate(timeout=timeout_s))
        except subprocess.TimeoutExpired:
            raise TesselError(f"the gloo measurement did not finish in {timeout_s:g} s") from None
        finally:
            if procs and any(p.poll() is None for p in procs):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(procs[0].pid, signal.SIGKILL)
            for p in procs:
                p.wait()
    failed = [(p.returncode, err) for p, (_, err) in zip(procs, outs) if p.returncode]
    if failed:
        code, err = failed[0]
        last = (err.strip().splitlines() or ["no output"])[-1]
        raise TesselError(f"the gloo measurement failed (exit code {code}): {last}")
    found = json.loads(outs[0][0])
    samples = list(zip(map(float, sizes), found["seconds"]))
    extra = {} if tp_model is None else {k: found[k] for k in ("tp_block_overhead_s",
                                                                "tp_block_optimizer_s")}
    return {"nproc": nproc, **fit(samples, nproc),
            "samples": [{"bytes": int(b), "seconds": t} for b, t in samples],
            "sync_drift": found["sync_drift"], "sync_skew": found["sync_skew"],
            "drift_samples": found["drift_samples"],
            "drift_piece": "model" if drift_model is not None else "matmul",
            **extra}


def _model_piece(model_fields: dict[str, Any]) -> Callable[[], None]:
    """One forward + backward of `model_fields`' architecture, one block deep at its own
    width, on DRIFT_TOKENS (what a rank of that model runs between two collectives: its
    matmuls, norms, activations, allocations and autograd, whose times vary more than a
    matmul's: after ~130 ms of the demo model's, ranks waited 1.1-6.2 ms, after as long of
    matmuls 0-0.9 ms)."""
    import torch

    from tessel.config import ModelConfig
    from tessel.models.loss import token_loss_sum
    from tessel.models.transformer import build_model
    from tessel.scaling.tp_cost import probe_model

    cfg = probe_model(ModelConfig.model_validate(model_fields), 1, DRIFT_TOKENS, dense=False)
    model = build_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (1, DRIFT_TOKENS + 1),
                           generator=torch.Generator().manual_seed(0))

    def piece() -> None:
        token_loss_sum(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        model.zero_grad(set_to_none=True)

    return piece


def drift(slow_last_rank: float = 0.0, model_fields: dict[str, Any] | None = None
          ) -> tuple[float, float, list[dict[str, float]]]:
    """(sync_drift, sync_skew, the samples they were fitted to: [{"segment_s", "wait_s"}]),
    measured by the ranks of the default process group together (module docstring). The
    segment's length is the mean over the segments and the ranks, the wait each rank's
    median over its segments, averaged over the ranks (the trainer's exposed communication
    is a mean over the ranks too). `slow_last_rank`: measure_gloo's;
    `model_fields`: the segments run that model's operators (`_model_piece`), else matmuls
    of a small model's MLP."""
    import torch
    import torch.distributed as dist

    flag = torch.zeros(1)
    slow = slow_last_rank if dist.get_rank() == dist.get_world_size() - 1 else 0.0
    if model_fields is not None:
        piece = _model_piece(model_fields)
    else:
        # A transformer block's shapes (a small model's MLP on 512 tokens): activations
        # larger than a core's cache, so the segments meet the memory traffic training does.
        torch.manual_seed(0)
        x, up, down = torch.randn(512, 192), torch.randn(192, 768), torch.randn(768, 192)

        def piece() -> None:
            torch.mm(torch.mm(x, up), down)

    def segments(n: int, reps: int, lengths: list[float], waits: list[float]) -> None:
        dist.barrier()
        dist.all_reduce(flag)
        for _ in range(n):
            start = time.perf_counter()
            for _ in range(reps):
                piece()
            if slow:
                time.sleep(slow * (time.perf_counter() - start))
            computed = time.perf_counter()
            dist.all_reduce(flag)  # waits for the slowest rank
            waited = time.perf_counter()
            dist.all_reduce(flag)  # the ranks together: the call alone
            alone = time.perf_counter() - waited
            lengths.append(computed - start)
            # Unclipped; each rank's median of them counts, not the mean: a burst of load
            # from elsewhere holds one rank for tens of ms now and then (a 128-ms length
            # once read 34 ms where the others read 2-4), and with 6 segments one such burst
            # would be the whole figure.
            waits.append(waited - computed - alone)

    # One piece's time, rank 0's for all: every rank runs the same segments. Timed over up
    # to 20 pieces or 0.1 s, whichever comes first (a large model's piece is long).
    for _ in range(2):
        piece()
    start, pieces = time.perf_counter(), 0
    while pieces < 20 and (pieces == 0 or time.perf_counter() - start < 0.1):
        piece()
        pieces += 1
    one = torch.tensor([(time.perf_counter() - start) / pieces], dtype=torch.float64)
    dist.broadcast(one, 0)
    found: list[tuple[list[float], list[float]]] = [([], []) for _ in DRIFT_SEGMENTS_S]
    # Each length's segments in a row. Rounds over the lengths (as the sizes above) were tried
    # with 16-token pieces and read a median 17 ms after 128 ms in 16 runs (one rank ~30%
    # slower than the other for a second at a time; not Python's garbage collector), against
    # 4 in a row before them; but runs in a row just after read 3-64 ms as well, so the small
    # pieces (DRIFT_TOKENS) were the likelier cause, and the order was left as it was.
    for target, (lengths, waits) in zip(DRIFT_SEGMENTS_S, found):
        segments(max(6, round(DRIFT_SECONDS / target)), max(1, round(target / one.item())),
                 lengths, waits)
    samples = []
    for lengths, waits in found:
        pair = torch.tensor([statistics.fmean(lengths), statistics.median(waits)],
                            dtype=torch.float64)
        dist.all_reduce(pair)
        length, wait = (pair / dist.get_world_size()).tolist()
        samples.append({"segment_s": length, "wait_s": max(0.0, wait)})
    # wait = sync_drift x sqrt(L), least squares over the shorter lengths, where that law
    # holds (the longest one's wait grows in proportion to it: fitted into sqrt(L) it made
    # the drift of a tensor-parallel step's ~3-ms pieces 1.3-3x what the shorter ones say)
    short = samples[:-1]
    den = sum(x["segment_s"] for x in short)
    value = sum(x["wait_s"] * x["segment_s"] ** 0.5 for x in short) / den if den else 0.0
    # wait = sync_skew x L, from the longest
    longest = samples[-1]
    skew = longest["wait_s"] / longest["segment_s"] if longest["segment_s"] > 0 else 0.0
    return value, skew, samples


def worker_main() -> None:
    """One rank (argv: RANK SPEC_JSON): the median seconds per size, printed by rank 0."""
    import torch
    import torch.distributed as dist

    rank, spec = int(sys.argv[1]), json.loads(sys.argv[2])
    torch.set_num_threads(1)
    # A peer that died must not leave this one waiting for gloo's default 30 minutes.
    dist.init_process_group("gloo", init_method=f"file://{spec['store']}", rank=rank,
                            world_size=spec["world"], timeout=timedelta(seconds=60))
    try:
        tensors = [torch.ones(size // 4, dtype=torch.float32) for size in spec["sizes"]]
        times: list[list[float]] = [[] for _ in tensors]
        calls = [2] * len(tensors)  # per run, sized on the warm-up rounds (rank 0's, for all)
        # Rounds over every size, not every round of one size: a burst of load from elsewhere
        # on the machine then spreads over the sizes instead of bending one of them.
        for i in range(WARMUP + REPEATS):
            for j, (x, kept) in enumerate(zip(tensors, times)):
                dist.barrier()  # every rank starts the run together
                start = time.perf_counter()
                for _ in range(calls[j]):
                    dist.all_reduce(x)
                kept.append((time.perf_counter() - start) / calls[j])
            if i == WARMUP - 1:
                one = torch.tensor([t[-1] for t in times], dtype=torch.float64)
                dist.broadcast(one, 0)
                calls = [min(20, max(2, round(RUN_SECONDS / max(t, 1e-6))))
                         for t in one.tolist()]
                times = [[] for _ in tensors]
        per_call = torch.tensor([statistics.median(t) for t in times], dtype=torch.float64)
        dist.all_reduce(per_call)  # the ranks' mean: each leaves a call at its own moment
        found: dict[str, Any] = {"seconds": (per_call / spec["world"]).tolist()}
        found["sync_drift"], found["sync_skew"], found["drift_samples"] = drift(
            float(spec["slow_last_rank"]), spec.get("drift_model"))
        if spec.get("tp_model") is not None:
            from tessel.scaling.tp_cost import block_overhead

            tp = block_overhead(spec["tp_model"], bool(spec["sequence_parallel"]),
                                tuple(spec["tp_tokens"]))
            found["tp_block_overhead_s"] = tp["pass_s"]
            found["tp_block_optimizer_s"] = tp["optimizer_s"]
        if rank == 0:
            print(json.dumps(found))
    finally:
        dist.destroy_process_group()
