"""Dense BF16 peak FLOP/s of known accelerators, for MFU.

Values are the vendors' dense (no sparsity) BF16 tensor-core figures. An unknown device has
no peak and therefore no MFU: we never guess.
"""

from __future__ import annotations

import torch

# (substring of torch.cuda.get_device_name(), peak FLOP/s); first match wins, so the more
# specific names come first.
_PEAKS: list[tuple[str, float]] = [
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
    ("L4", 121e12),
    ("MI300X", 1307e12),
]


def device_peak_flops(device: torch.device) -> float | None:
    """Dense BF16 peak of `device` in FLOP/s, or None when unknown (CPUs included)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in _PEAKS:
        if key in name:
            return peak
    return None
