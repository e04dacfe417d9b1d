"""`tessel bench`: the real trainer step, timed on one device.

It builds the `Trainer` of the given config (synthetic tokens, so the figure is the model's and
not the disk's; the real loader still runs inside each step), runs `warmup` untimed steps
(compilation, allocator warm-up), then times `steps` steps one by one: CUDA events around
each step on a GPU, read once at the end (no synchronisation inside the timed steps), a
host clock on a CPU.

FLOPs per token are the model's own formula (`tessel.models.flops_per_token`: 6 x matmul
parameters + 12 x layers x n_heads x head_dim x seq_len, the PaLM appendix-B count used by
nanoGPT and Megatron; attention counted at full, not causal, size; in MoE layers only the
parameters a token uses: router, top_k routed experts, shared experts). MFU is TFLOP/s over the device's
dense BF16 peak from the planner's GPU profiles (`tessel.planner.prelaunch.device_peak_flops`;
unknown devices, CPUs included, get none) and over the peak of a large matrix multiply measured
on the same device in the same run (bf16 on a GPU, fp32 on a CPU). The planner's memory
prediction for the layout is printed beside the measured peak.
"""

from __future__ import annotations

import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tessel.config import Config
from tessel.config.monitoring import COMM_CONDITIONS
from tessel.errors import TesselError
from tessel.models import flops_per_token, param_count

GIB = 2**30


def bench_config(cfg: Config, run_dir: str) -> Config:
    """The benchmark's run: synthetic tokens, no checkpoints, evaluations, samples or
    profiled steps (metrics.comm_sample_interval: a profiled step is not a plain one), so no
    communication alert rules (they would never fire: refused by the config)."""
    data = cfg.to_dict()
    data["alerts"] = [a for a in data.get("alerts", []) if a["when"] not in COMM_CONDITIONS]
    return Config.from_dict(data, {
        "data.source": "synthetic", "checkpoint.interval": 0, "train.eval_interval": 0,
        "metrics.comm_sample_interval": 0,
        "metrics.tensorboard": False, "run.dir": run_dir, "run.sample_tokens": 0,
        "train.steps": 10**6,  # a long nominal schedule: the lr stays normal; the work is the same
        "watchdog.timeout_s": 0,
    })


def measure_matmul_peak(device: torch.device, seconds: float = 1.0) -> dict[str, Any]:
    """FLOP/s of a large square matrix multiply: bf16 8192^3 on a GPU, fp32 on a CPU."""
    if device.type == "cuda":
        n, dtype = 8192, torch.bfloat16
    else:
        n, dtype = 1024, torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    synchronize(device)
    reps, t0 = 0, time.perf_counter()
    while True:
        for _ in range(10):
            a @ b
        reps += 10
        synchronize(device)
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            break
    return {"flops": 2 * n**3 * reps / elapsed, "n": n, "dtype": str(dtype).removeprefix("torch.")}


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on a CPU): timing needs it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_bench(cfg: Config, warmup: int = 5, steps: int = 20, matmul: bool = True) -> dict[str, Any]:
    from tessel.observe.memory import memory_stats
    from tessel.parallel.dist import process_info
    from tessel.train.trainer import Trainer

    if process_info().distributed:
        raise TesselError("tessel bench measures one device; run it without torchrun/--nproc")
    if warmup < 1 or steps < 2:
        raise TesselError("tessel bench needs --warmup >= 1 and --steps >= 2")
    run_dir = tempfile.mkdtemp(prefix="tessel-bench-")
    try:
        cfg = bench_config(cfg, run_dir)
        trainer = Trainer(cfg, console=False)
        device = trainer.device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(warmup):
            trainer.run_step()
            trainer.step += 1
        times = _timed_steps(trainer, steps)
        memory = memory_stats(device)
        result = _figures(cfg, trainer, times, memory)
        result["warmup_steps"], result["timed_steps"] = warmup, steps
        result["planner"] = _planner_memory(cfg, device)
        if matmul:
            peak = measure_matmul_peak(device)
            result["matmul_peak_tflops"] = peak["flops"] / 1e12
            result["matmul"] = {"n": peak["n"], "dtype": peak["dtype"]}
            result["mfu_vs_matmul"] = result["tflops"] * 1e12 / peak["flops"]
        return result
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _timed_steps(trainer: Any, steps: int) -> list[float]:
    device = trainer.device
    if device.type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        events[0].record()
        for i in range(steps):
            trainer.run_step()
            trainer.step += 1
            events[i + 1].record()
        events[-1].synchronize()
        return [a.elapsed_time(b) / 1000 for a, b in zip(events, events[1:])]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.run_step()
        trainer.step += 1
        times.append(time.perf_counter() - t0)
    return times


def _figures(cfg: Config, trainer: Any, times: list[float], memory: dict[str, float]) -> dict[str, Any]:
    from tessel.planner.prelaunch import device_peak_flops

    t, device = cfg.train, trainer.device
    tokens_per_step = t.global_batch_size * t.seq_len
    median = statistics.median(times)
    fpt = flops_per_token(cfg.model, t.seq_len)
    tps = tokens_per_step / median
    peak = device_peak_flops(device)
    q = statistics.quantiles(times, n=10) if len(times) >= 2 else [median] * 9
    return {
        "preset": cfg.model.preset, "params": param_count(cfg.model),
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else
        f"cpu ({platform.machine()})",
        "precision": trainer.precision.name, "compile": t.compile, "fp8": t.fp8,
        "seq_len": t.seq_len, "micro_batch_size": t.micro_batch_size,
        "global_batch_size": t.global_batch_size, "accumulation": trainer.train_step.accum,
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "world_size": 1,
        "tokens_per_s": tps,
        "step_time_s": {"median": median, "min": min(times), "max": max(times),
                        "p10": q[0], "p90": q[-1],
                        "stdev": statistics.stdev(times) if len(times) > 1 else 0.0},
        "flops_per_token": fpt,
        "flops_formula": ("6 x matmul parameters (MoE: active) + 12 x n_layers x d_model x seq_len "
                          "(PaLM, appendix B)"),
        "tflops": fpt * tps / 1e12,
        "peak_tflops_bf16": peak / 1e12 if peak is not None else None,
        "mfu": fpt * tps / peak if peak is not None else None,
        "memory_gib": memory,
        "config": cfg.to_dict(),  # so `tessel plan --calibrate` can take this file
    }


def _planner_memory(cfg: Config, device: torch.device) -> dict[str, Any]:
    from tessel.planner.prelaunch import check_memory, device_profile

    plan, _ = check_memory(cfg, 1, device_profile(device, 1))
    return {k: round(v, 4) for k, v in plan.memory.gib().items()}


def report(r: dict[str, Any]) -> str:
    st = r["step_time_s"]
    mfu = (f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None
           else f"unknown (no dense BF16 peak for {r['device_name']})")
    lines = [
        f"{r['preset'] or 'custom'} ({r['params']:,} parameters) on {r['device_name']}, {r['precision']}"
        f"{', compiled' if r['compile'] else ''}{', fp8' if r['fp8'] else ''}; seq {r['seq_len']}, "
        f"micro-batch {r['micro_batch_size']} x {r['accumulation']} accumulation = "
        f"{r['global_batch_size']} sequences per step",
        f"tokens/s          {r['tokens_per_s']:,.0f}",
        f"step time         median {st['median'] * 1e3:.1f} ms (p10 {st['p10'] * 1e3:.1f}, p90 "
        f"{st['p90'] * 1e3:.1f}, min {st['min'] * 1e3:.1f}, max {st['max'] * 1e3:.1f}) over "
        f"{r['timed_steps']} steps after {r['warmup_steps']} warm-up",
        f"TFLOP/s           {r['tflops']:.3f}  ({r['flops_per_token']:,} FLOPs/token: {r['flops_formula']})",
        f"MFU               {mfu}",
    ]
    if "mfu_vs_matmul" in r:
        m = r["matmul"]
        lines.append(f"vs measured peak  {100 * r['mfu_vs_matmul']:.1f}% of {r['matmul_peak_tflops']:.3f} "
                     f"TFLOP/s ({m['dtype']} {m['n']}^3 matmul on this device)")
    mem = r["memory_gib"]
    if r["device"] == "cuda":
        lines.append(f"memory            peak allocated {mem['mem_peak_gib']:.2f} GiB, reserved "
                     f"{mem['mem_reserved_gib']:.2f} GiB")
    else:
        lines.append(f"memory            process peak RSS {mem.get('mem_rss_peak_gib', 0):.2f} GiB (host)")
    p = r["planner"]
    if p is None:
        lines.append("planner predicts  nothing: it does not model Mixture-of-Experts layers yet")
        return "\n".join(lines)
    lines.append(f"planner predicts  {p['allocated']:.2f} GiB allocated per device (parameters "
                 f"{p['parameters']:.2f}, gradients {p['gradients']:.2f}, optimizer {p['optimizer']:.2f}, "
                 f"activations {p['activations']:.2f}, communication {p['communication']:.2f}); "
                 f"{p['total']:.2f} GiB with the allocator margin")
    return "\n".join(lines)


def write_json(r: dict[str, Any], path: Path) -> None:
    from tessel.fileio import write_text_atomic

    write_text_atomic(path, json.dumps(r, indent=1))
