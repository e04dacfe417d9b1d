"""The all-reduce cost of gloo between local processes, measured once: a latency and a bus
bandwidth, for calibrating the planner's communication model on a CPU machine.

`measure_gloo(nproc, sizes)` starts `nproc` Python processes (rendezvous through a file in a
private temporary directory: no port to race for), which all-reduce float32 tensors of each
size a few times; rank 0's median time per size is fitted as

    t(size) = latency + 2 (n - 1) / n * bytes / bandwidth

(the ring all-reduce's bytes per rank, the convention of the planner's `_ring` and of
nccl-tests' "bus bandwidth"), by least squares over the sizes.

The same processes then measure how far they drift apart in training-like use (the
profile's `sync_drift`): every rank runs the same matmuls for a segment of L seconds, alone
and then followed by a one-number all-reduce, and the difference per segment, beyond the
latency, is what a collective waits for the slowest rank after L seconds of compute. It is
fitted as sync_drift x sqrt(L) over two segment lengths (independent noise in each rank's
operators adds up like a random walk: on the project's 2-core machine the wait grew from
3-5 ms after 8 ms of compute to 6-15 ms after 35-75 ms, against 0.7 ms for the all-reduce
alone).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from tessel.errors import TesselError

DEFAULT_SIZES = (4096, 65536, 1 << 20, 4 << 20)
"""Message sizes in bytes: from latency-bound to bandwidth-bound on loopback."""
WARMUP = 2
"""Untimed rounds over the sizes (connection set-up, allocator)."""
REPEATS = 15
"""Timed all-reduces per size; the median is kept."""
WORKER = "from tessel.scaling.gloo import worker_main; worker_main()"
DRIFT_SEGMENTS_S = (0.008, 0.032)
"""Compute between the all-reduces of the drift measurement, seconds: the pieces of a
tensor-parallel block to a small model's micro-batch."""
DRIFT_SECONDS = 0.25
"""Seconds of segments per timed loop (each length is timed alone and synchronised, 3 times)."""


def ring_bytes(nbytes: float, nproc: int) -> float:
    """Bytes each rank sends in a ring all-reduce of `nbytes`."""
    return 2 * (nproc - 1) / nproc * nbytes


def fit(samples: Sequence[tuple[float, float]], nproc: int) -> dict[str, float]:
    """{"latency_s", "bandwidth_Bps"} from (bytes, seconds) samples: the line through (ring
    bytes, seconds) with the least squared *relative* error (weights 1/t^2), so that the
    small messages, whose times are the latency, count as much as the large ones. Where a
    noisy machine bends the line below zero the figures are what the samples show directly:
    a negative latency becomes the smallest message's time; when larger messages were not
    slower, the bandwidth is the largest one's ring bytes over its time."""
    xs = [ring_bytes(b, nproc) for b, _ in samples]
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


def measure_gloo(nproc: int = 2, sizes: Sequence[int] = DEFAULT_SIZES,
                 timeout_s: float = 120.0, tp_model: dict[str, Any] | None = None,
                 sequence_parallel: bool = True) -> dict[str, object]:
    """Latency (s) and bus bandwidth (bytes/s) of a gloo all-reduce between `nproc` local
    processes, with the per-size medians they were fitted to:
    {"nproc", "latency_s", "bandwidth_Bps", "samples": [{"bytes", "seconds"}, ...]}; with
    `tp_model` (a ModelConfig's fields) also "tp_block_overhead_s" and
    "tp_block_optimizer_s", the host time a tensor-parallel block of that architecture adds
    over the `nproc` processes per micro-batch and per optimizer phase
    (`tessel.scaling.tp_cost`)."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 2:
        raise TesselError(f"an all-reduce needs at least 2 processes (got {nproc!r})")
    if len(sizes) < 2 or any(isinstance(s, bool) or not isinstance(s, int) or s < 4
                             for s in sizes):
        raise TesselError(f"give at least two message sizes of >= 4 bytes (got {list(sizes)})")
    with tempfile.TemporaryDirectory(prefix="tessel-gloo-") as tmp:
        spec = json.dumps({"world": nproc, "store": str(Path(tmp) / "store"),
                           "sizes": list(sizes), "tp_model": tp_model,
                           "sequence_parallel": sequence_parallel})
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(rank), spec], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for rank in range(nproc)]
        outs = []
        try:
            for p in procs:
                outs.append(p.communicate(timeout=timeout_s))
        except subprocess.TimeoutExpired:
            raise TesselError(f"the gloo measurement did not finish in {timeout_s:g} s") from None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
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
            "sync_drift": found["sync_drift"], "drift_samples": found["drift_samples"],
            **extra}


def drift(latency_s: float) -> tuple[float, list[dict[str, float]]]:
    """(sync_drift, the samples it was fitted to: [{"segment_s", "wait_s"}]), measured by
    the ranks of the default process group together (module docstring). The segment's
    length and the wait are means over the ranks (the trainer's exposed communication is
    too); each the median of 3 timings."""
    import torch
    import torch.distributed as dist

    # A transformer block's shapes (a small model's MLP on 512 tokens): activations larger
    # than a core's cache, so the segments meet the memory traffic training does.
    torch.manual_seed(0)
    x, up, down = torch.randn(512, 192), torch.randn(192, 768), torch.randn(768, 192)
    flag = torch.zeros(1)

    def segments(n: int, reps: int, synchronised: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            for _ in range(reps):
                torch.mm(torch.mm(x, up), down)
            if synchronised:
                dist.all_reduce(flag)
        return (time.perf_counter() - start) / n

    # One piece's time, rank 0's for all: every rank runs the same segments.
    one = torch.tensor([segments(1, 20, False) / 20], dtype=torch.float64)
    dist.broadcast(one, 0)
    samples = []
    for target in DRIFT_SEGMENTS_S:
        reps = max(1, round(target / one.item()))
        n = max(4, round(DRIFT_SECONDS / target))
        lengths, waits = [], []
        for _ in range(3):
            pair = torch.tensor([segments(n, reps, False), segments(n, reps, True)],
                                dtype=torch.float64)
            dist.all_reduce(pair)
            alone, together = (pair / dist.get_world_size()).tolist()
            lengths.append(alone)
            waits.append(max(0.0, together - alone - latency_s))
        samples.append({"segment_s": statistics.median(lengths),
                        "wait_s": statistics.median(waits)})
    # wait = sync_drift x sqrt(L), least squares over the lengths
    den = sum(x["segment_s"] for x in samples)
    value = sum(x["wait_s"] * x["segment_s"] ** 0.5 for x in samples) / den if den else 0.0
    return value, samples


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
        # Rounds over every size, not every round of one size: a burst of load from elsewhere
        # on the machine then spreads over the sizes instead of bending one of them.
        for i in range(WARMUP + REPEATS):
            for x, kept in zip(tensors, times):
                dist.barrier()  # every rank starts together: the time is the collective's
                start = time.perf_counter()
                dist.all_reduce(x)
                if i >= WARMUP:
                    kept.append(time.perf_counter() - start)
        found: dict[str, Any] = {"seconds": [statistics.median(t) for t in times]}
        latency = fit(list(zip(map(float, spec["sizes"]), found["seconds"])),
                      spec["world"])["latency_s"]
        found["sync_drift"], found["drift_samples"] = drift(latency)
        if spec.get("tp_model") is not None:
            from tessel.scaling.tp_cost import block_overhead

            tp = block_overhead(spec["tp_model"], bool(spec["sequence_parallel"]), latency)
            found["tp_block_overhead_s"] = tp["pass_s"]
            found["tp_block_optimizer_s"] = tp["optimizer_s"]
        if rank == 0:
            print(json.dumps(found))
    finally:
        dist.destroy_process_group()
