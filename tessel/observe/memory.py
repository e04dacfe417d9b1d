"""Memory figures for the metrics: the device's on a GPU, the process's on a CPU."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def memory_stats(device: torch.device) -> dict[str, float]:
    """Device memory in GiB: allocated now, reserved by the caching allocator, peak
    allocated since the start; on a CPU the process's resident memory and its peak."""
    if device.type == "cuda":
        return {
            "mem_allocated_gib": torch.cuda.memory_allocated(device) / 2**30,
            "mem_reserved_gib": torch.cuda.memory_reserved(device) / 2**30,
            "mem_peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        }
    import resource

    out = {"mem_rss_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30}
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        out["mem_rss_gib"] = pages * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError, IndexError):  # not Linux
        pass
    return out
