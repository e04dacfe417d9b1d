"""MFU's peak comes from the planner's GPU profiles, the one table of device peaks: every
device the former MFU table (tessel/observe/mfu.py) knew gets the same dense BF16 peak, and
of several matching profiles the most specific device name wins."""

from __future__ import annotations

import pytest
import torch

from tessel.planner.hardware import BUILTIN, profile_for_device
from tessel.planner.prelaunch import device_peak_flops

# The former table, as it stood: (substring of the device name, peak); the first match won.
FORMER_TABLE: list[tuple[str, float]] = [
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


def former_peak(name: str) -> float | None:
    return next((peak for key, peak in FORMER_TABLE if key in name), None)


NAMES = [key for key, _ in FORMER_TABLE] + [f"NVIDIA {key}" for key, _ in FORMER_TABLE] + [
    "NVIDIA H100 80GB HBM3", "NVIDIA H100 96GB HBM2e", "NVIDIA H200 NVL", "NVIDIA GH200 480GB",
    "NVIDIA GB200", "NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB",
    "NVIDIA A100 80GB PCIe", "NVIDIA L40", "AMD Instinct MI300X",
    "NVIDIA GeForce RTX 4090", "NVIDIA A10", "Tesla V100-SXM2-16GB",  # in no table: no MFU
]


def peak_of(monkeypatch: pytest.MonkeyPatch, name: str) -> float | None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    return device_peak_flops(torch.device("cuda", 0))


@pytest.mark.parametrize("name", NAMES)
def test_mfu_peak_is_what_the_former_table_gave(monkeypatch: pytest.MonkeyPatch, name: str):
    assert peak_of(monkeypatch, name) == former_peak(name)


def test_every_former_entry_has_a_builtin_profile():
    for key, peak in FORMER_TABLE:
        profile = profile_for_device(f"NVIDIA {key}")
        assert profile is not None and profile.name in BUILTIN, key
        assert profile.mfu_peak_flops == peak, key


def test_the_most_specific_device_name_wins():
    assert profile_for_device("NVIDIA H100 80GB HBM3").name == "h100-sxm"
    assert profile_for_device("NVIDIA H100 PCIe").name == "h100-pcie"
    assert profile_for_device("NVIDIA H100 NVL").name == "h100-nvl-94gb"
    assert profile_for_device("NVIDIA L40S").name == "l40s-48gb"
    assert profile_for_device("NVIDIA L4").name == "l4-24gb"
    assert profile_for_device("NVIDIA GH200 480GB").name == "h200"
    # The 500 W H100 96GB: the planner predicts with its power-limited 887 TFLOP/s, MFU is
    # reported against the die's 989 rating, as the former table (and torchtitan) did.
    h100_96 = profile_for_device("NVIDIA H100 96GB HBM2e")
    assert h100_96.name == "h100-96gb-500w" and h100_96.bf16_flops == 887e12
    assert h100_96.mfu_peak_flops == 989e12 == BUILTIN["h100-sxm"].bf16_flops


def test_a_device_the_former_table_lacked_gains_its_profiles_peak(monkeypatch):
    """H800 (NVIDIA's export H100) matched no entry of the former table: now the planner's
    h800 profile gives MFU its peak, the H100 SXM's."""
    assert former_peak("NVIDIA H800") is None
    assert peak_of(monkeypatch, "NVIDIA H800") == 989e12


def test_no_mfu_peak_off_a_gpu():
    assert device_peak_flops(torch.device("cpu")) is None
