"""GPU profiles the planner predicts for: peak rates, memory and links, plus two efficiency
factors that calibration fits.

Built-in figures are the vendors' dense (no 2:4 sparsity) tensor-core peaks, HBM capacity
and link bandwidths (sources in SOURCES). Users add or override profiles in a TOML file
(`tessel plan --hardware FILE`, or $TESSEL_HARDWARE):

    [gpu.my-h100]
    bf16_tflops = 989
    fp8_tflops = 1979
    memory_gib = 80
    intra_node_gbps = 450      # GB/s per GPU, one direction (NVLink)
    inter_node_gbps = 50       # GB/s per GPU, one direction (400 Gb/s NIC)
    gpus_per_node = 8
    hbm_gbps = 3350            # optional: device memory bandwidth, GB/s
    host_memory_gib = 2048     # optional: host memory per node (offload), GiB
    matmul_efficiency = 0.625  # optional: fraction of peak that large matmuls reach
    comm_efficiency = 0.75     # optional: fraction of link bandwidth collectives reach
    collective_latency_us = 20 # optional: fixed cost of one collective call, microseconds
    tp_block_overhead_us = 0   # optional: host time a tensor-parallel block adds, microseconds
    tp_block_optimizer_us = 0  # optional: the same per optimizer step, microseconds
    sync_drift = 0             # optional: ranks' drift, seconds per sqrt(compute seconds)
    sync_skew = 0              # optional: ranks' speed difference, wait per compute second
    collective_curve_us = []   # optional: [[ring bytes per rank, microseconds], ...] measured

A profile can be calibrated from a measured run (`calibrate`): the matmul efficiency is
set to the value at which the planner's prediction for that run equals what it measured.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tessel.errors import TesselError
from tessel.fileio import read_toml

# Matmul efficiency: fitted to published runs (tessel/planner/validation.py; docs/planning.md's
# table). Communication efficiency: an assumption (bus bandwidth ~75% of the link's).
MATMUL_EFFICIENCY = 0.625
COMM_EFFICIENCY = 0.75
# Fixed cost of one collective call (launch, synchronisation, the first bytes' trip): an
# assumption for NCCL within a node (small-message all-reduce runs in tens of microseconds);
# measured for gloo by `tessel scale --measure` (about 0.5 ms between CPU processes).
COLLECTIVE_LATENCY_S = 20e-6


@dataclass(frozen=True)
class GpuProfile:
    name: str
    bf16_flops: float
    """Dense BF16 tensor-core peak, FLOP/s."""
    fp8_flops: float | None
    """Dense FP8 peak, FLOP/s (None: no FP8 tensor cores)."""
    memory_gib: float
    """Device memory, GiB."""
    intra_node_gbps: float
    """Per-GPU bandwidth to GPUs of the same node, GB/s in one direction (NVLink, xGMI)."""
    inter_node_gbps: float
    """Per-GPU bandwidth to other nodes, GB/s in one direction (its NIC)."""
    gpus_per_node: int
    hbm_gbps: float = 2000.0
    """Device memory bandwidth, GB/s (the optimizer step is bound by it)."""
    host_memory_gib: float = 1024.0
    """Host memory of one node, GiB (what offloading may fill, shared by its GPUs)."""
    matmul_efficiency: float = MATMUL_EFFICIENCY
    """Fraction of the dense peak that the step's large matmuls reach."""
    comm_efficiency: float = COMM_EFFICIENCY
    """Fraction of the link bandwidth that collectives reach (bus bandwidth / link)."""
    collective_latency_s: float = COLLECTIVE_LATENCY_S
    """Seconds every collective call costs beyond its bytes' time (TOML: collective_latency_us)."""
    tp_block_overhead_s: float = 0.0
    """Host seconds one tensor-parallel block adds to a micro-batch's forward + backward
    beyond a tp-th of its compute (TOML: tp_block_overhead_us). This and the four fields
    after it are measured on CPU processes by `tessel scale --measure` and 0 (empty) in the
    built-in GPU profiles; `tessel.planner.cpu` says what each means and adds them to a
    step."""
    tp_block_optimizer_s: float = 0.0
    """The same per block and optimizer step (TOML: tp_block_optimizer_us)."""
    sync_drift: float = 0.0
    """The ranks' drift: a synchronising collective waits sync_drift x sqrt(L) for the
    slowest rank, L the compute seconds since the previous one."""
    sync_skew: float = 0.0
    """The ranks' steady difference in speed: the wait is sync_skew x L where that is
    larger."""
    collective_curve: tuple[tuple[float, float], ...] = ()
    """A collective call's seconds against the bytes each rank sends in its ring, ascending
    (TOML: collective_curve_us, [[bytes, microseconds], ...]); where given, tensor-parallel
    calls and DDP's buckets are priced on it."""
    device_names: tuple[str, ...] = ()
    """Substrings of torch.cuda.get_device_name() that identify this GPU (case aside; where
    several profiles' names match, the longest name wins: "H100 NVL" over "H100")."""
    rated_bf16_flops: float | None = None
    """The dense BF16 rating MFU is reported against (docs/monitoring.md) where bf16_flops
    models the device below it (a power limit); None: bf16_flops. Built-in profiles only
    (no TOML key): MFU reads the built-in profiles."""
    device_type: str = "cuda"
    """What runs the model: "cuda" (GPUs: bf16 by default, FlexAttention), or "cpu" for a
    profile measured on CPU processes (`tessel scale --measure`: fp32, dense masks)."""

    def with_memory(self, memory_gib: float) -> GpuProfile:
        return dataclasses.replace(self, memory_gib=memory_gib)

    @property
    def mfu_peak_flops(self) -> float:
        """The dense BF16 peak MFU divides by, FLOP/s."""
        return self.rated_bf16_flops or self.bf16_flops


BUILTIN: dict[str, GpuProfile] = {
    p.name: p for p in (
        GpuProfile("a100-40gb", 312e12, None, 40.0, 300.0, 25.0, 8, hbm_gbps=1555, host_memory_gib=1024,
                   device_names=("A100-SXM4-40GB", "A100-PCIE-40GB", "A100 40GB")),
        GpuProfile("a100-80gb", 312e12, None, 80.0, 300.0, 25.0, 8, hbm_gbps=2039, host_memory_gib=1024,
                   device_names=("A100-SXM4-80GB", "A100 80GB", "A100-PCIE-80GB", "A100")),
        GpuProfile("h100-sxm", 989e12, 1979e12, 80.0, 450.0, 50.0, 8, hbm_gbps=3350, host_memory_gib=2048,
                   device_names=("H100 80GB HBM3", "H100 SXM", "H100")),
        GpuProfile("h100-96gb-500w", 887e12, 1773e12, 95.0, 450.0, 50.0, 8, hbm_gbps=2400,
                   host_memory_gib=2048, device_names=("H100 96GB HBM2e",), rated_bf16_flops=989e12),
        GpuProfile("h100-pcie", 756e12, 1513e12, 80.0, 64.0, 25.0, 8, hbm_gbps=2000,
                   device_names=("H100 PCIe",)),
        GpuProfile("h100-nvl-94gb", 835e12, 1670e12, 93.5, 64.0, 50.0, 8, hbm_gbps=3900, host_memory_gib=2048,
                   device_names=("H100 NVL",)),
        GpuProfile("h800", 989e12, 1979e12, 80.0, 200.0, 50.0, 8, hbm_gbps=3350, host_memory_gib=2048,
                   device_names=("H800",)),
        GpuProfile("h200", 989e12, 1979e12, 141.0, 450.0, 50.0, 8, hbm_gbps=4800,
                   host_memory_gib=2048, device_names=("H200",)),
        GpuProfile("b200", 2250e12, 4500e12, 180.0, 900.0, 50.0, 8, hbm_gbps=7700,
                   host_memory_gib=4096, device_names=("B200",)),
        GpuProfile("mi300x", 1307e12, 2615e12, 192.0, 448.0, 50.0, 8, hbm_gbps=5300, host_memory_gib=2048,
                   device_names=("MI300X", "AMD Instinct MI300X")),
        GpuProfile("l40s-48gb", 362e12, 733e12, 48.0, 32.0, 25.0, 8, hbm_gbps=864, device_names=("L40S",)),
        GpuProfile("l4-24gb", 121e12, 242e12, 24.0, 32.0, 12.5, 8, hbm_gbps=300, device_names=("L4",)),
        GpuProfile("a10g-24gb", 70e12, None, 24.0, 32.0, 12.5, 8, hbm_gbps=600, device_names=("A10G",)),
    )
}

SOURCES = {
    "a100-40gb": "NVIDIA A100 whitepaper: 312 dense BF16 TFLOP/s, 40 GB; NVLink3 600 GB/s "
                 "bidirectional (300 per direction); DGX A100 8 x 200 Gb/s HDR IB",
    "a100-80gb": "NVIDIA A100 product page: 312 dense BF16 TFLOP/s, 80 GB HBM2e; NVLink 600 "
                 "GB/s bidirectional; 200 Gb/s HDR IB per GPU",
    "h100-sxm": "NVIDIA H100 whitepaper: 989.4 dense BF16, 1979 dense FP8 TFLOP/s, 80 GB; "
                "NVLink4 900 GB/s bidirectional (450 per direction); 400 Gb/s NDR per GPU",
    "h100-96gb-500w": "H100 SXM5 with 96 GB HBM2e (2.4 TB/s) at the default 500 W power limit, "
                      "as torchtitan's Dec 2024 benchmarks ran (Meta's Grand Teton; their doc: "
                      "the peak lies between SXM's and NVL's). The same 132-SM die is rated "
                      "989.4 dense BF16 TFLOP/s at 700 W (H100 SXM) and 835.5 at 400 W (H100 "
                      "NVL, 1671 with sparsity); linear in the power limit between them, 500 W "
                      "gives 887 (FP8 1773); 96 GB counted as an 80 GB H100's 79.6 GiB is "
                      "counted (95 GiB); NVLink4 450 GB/s per direction; 400 Gb/s RDMA per GPU; "
                      "MFU against the die's 989 rating, as torchtitan reports it",
    "h100-pcie": "NVIDIA H100 whitepaper: 756 dense BF16, 1513 dense FP8 TFLOP/s, 80 GB; "
                 "PCIe Gen5 128 GB/s bidirectional (64 per direction), no NVLink assumed",
    "h100-nvl-94gb": "NVIDIA H100 NVL datasheet: 835 dense BF16, 1670 dense FP8 TFLOP/s, 94 GB HBM3 "
                "(93.5 GiB counted), 3.9 TB/s; NVLink bridges only pairs: PCIe Gen5 64 GB/s per "
                "direction assumed between GPUs; 400 Gb/s per GPU assumed",
    "h800": "H100 SXM's figures (989 dense BF16, 1979 dense FP8 TFLOP/s, 80 GB, 3.35 TB/s) "
            "with NVLink cut to 400 GB/s bidirectional (200 per direction), NVIDIA's export "
            "variant; DeepSeek-V3 technical report (arXiv 2412.19437) section 3.1: 8 GPUs a "
            "node, 400 Gb/s InfiniBand (50 GB/s) per GPU; host memory as H100 assumed",
    "h200": "NVIDIA H200 product page: 989 dense BF16, 1979 dense FP8 TFLOP/s, 141 GB; NVLink4 "
            "900 GB/s bidirectional; 400 Gb/s CX-7 per GPU",
    "b200": "NVIDIA HGX B200: 2250 dense BF16, 4500 dense FP8 TFLOP/s, 180 GB HBM3e; NVLink5 "
            "1.8 TB/s bidirectional; 400 Gb/s per GPU assumed",
    "mi300x": "AMD ROCm MI300X page: 1307.4 BF16, 2614.9 FP8 TFLOP/s (matrix, dense), 192 GB "
              "HBM3; 7 Infinity Fabric links, 896 GB/s aggregate (448 per direction); 400 "
              "Gb/s per GPU assumed",
    "l40s-48gb": "NVIDIA L40S datasheet: 362 dense BF16, 733 dense FP8 TFLOP/s, 48 GB GDDR6, 864 GB/s; "
            "no NVLink: PCIe Gen4 32 GB/s per direction; 200 Gb/s per GPU assumed",
    "l4-24gb": "NVIDIA L4 datasheet: 121 dense BF16, 242 dense FP8 TFLOP/s, 24 GB GDDR6, 300 GB/s; "
          "PCIe Gen4 32 GB/s per direction; 100 Gb/s per GPU assumed",
    "a10g-24gb": "AWS A10G (g5 instances): 70 dense BF16 TFLOP/s (the figure MFU always used), 24 GB "
            "GDDR6, 600 GB/s; PCIe Gen4 32 GB/s per direction; 100 Gb/s per GPU assumed",
}

_POSITIVE = {"bf16_tflops": (1e6, "TFLOP/s"), "fp8_tflops": (1e6, "TFLOP/s; 0 for none"),
             "memory_gib": (1e6, "GiB"), "host_memory_gib": (1e9, "GiB"),
             "intra_node_gbps": (1e6, "GB/s"), "inter_node_gbps": (1e6, "GB/s"),
             "hbm_gbps": (1e6, "GB/s")}
"""TOML keys that must be > 0 -> (the largest value taken, the unit): beyond it, a typo."""
_NON_NEGATIVE = {"collective_latency_us": (1e9, "microseconds"),
                 "tp_block_overhead_us": (1e9, "microseconds"),
                 "tp_block_optimizer_us": (1e9, "microseconds"),
                 "sync_drift": (1e3, "seconds per square root of a second"),
                 "sync_skew": (1e3, "a fraction of the compute")}
"""TOML keys that may be 0 -> (the largest value taken, the unit)."""
_FIELD_OF = {"bf16_tflops": "bf16_flops", "fp8_tflops": "fp8_flops",
             "collective_latency_us": "collective_latency_s",
             "tp_block_overhead_us": "tp_block_overhead_s",
             "tp_block_optimizer_us": "tp_block_optimizer_s"}
"""TOML keys whose profile field has another name (and unit: FLOP/s, seconds)."""
FITTED_CEILING = 100.0
"""The largest efficiency of a CPU profile, where calibration fits factors, not fractions."""
CALIBRATION_LIMITS = {"cuda": (0.05, 1.0), "cpu": (1e-4, FITTED_CEILING)}
"""The range calibration fits a matmul efficiency in, by device type (see `calibrate`)."""
MAX_GPUS_PER_NODE = 65536
_FIELDS = {*_POSITIVE, *_NON_NEGATIVE, "gpus_per_node", "matmul_efficiency", "comm_efficiency",
           "collective_curve_us", "device_names", "device_type"}


def as_number(value: object) -> float | None:
    """A TOML or JSON number as a float (a huge integer as inf); None for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf


def shown(value: object) -> str:
    """A value read from a file, short, for a one-line error: 1e+300, not 301 digits."""
    if isinstance(value, bool):
        return str(value).lower()
    number = as_number(value)
    if number is not None:
        return f"{number:g}"
    if isinstance(value, str):
        return repr(value) if len(value) <= 40 else "a long text"
    return {list: "an array", dict: "a table"}.get(type(value), type(value).__name__)


def _in_range(name: str, key: str, value: object, rule: str, low: float, high: float,
              open_low: bool = True) -> float:
    """`value` as a float within its range, or one line naming the key and its rule."""
    x = as_number(value)
    if x is None or not (low < x if open_low else low <= x) or not x <= high:  # nan: neither
        raise TesselError(f"hardware profile {name!r}: {key} must be {rule}, not {shown(value)}")
    return x


def _curve(name: str, value: object) -> tuple[tuple[float, float], ...]:
    """collective_curve_us's [[bytes, microseconds], ...] as (bytes, seconds) pairs, or one
    line saying what it must be."""
    def number(x: object) -> bool:
        n = as_number(x)
        return n is not None and math.isfinite(n)

    if (not isinstance(value, (list, tuple)) or len(value) == 1
            or not all(isinstance(p, (list, tuple)) and len(p) == 2 and all(map(number, p))
                       and p[0] > 0 and p[1] >= 0 for p in value)
            or any(b[0] <= a[0] for a, b in zip(value, value[1:]))):
        raise TesselError(f"hardware profile {name!r}: collective_curve_us must be a list of "
                          "at least 2 [bytes > 0, microseconds >= 0] pairs in ascending bytes, "
                          "or []")
    return tuple((float(b), float(us) / 1e6) for b, us in value)


def _field(name: str, key: str, value: object) -> dict[str, object]:
    """The profile field that the TOML key `key` sets, checked: one line naming the key and
    its range otherwise."""
    if key == "fp8_tflops" and as_number(value) == 0:
        return {"fp8_flops": None}  # no FP8 tensor cores
    if key in _POSITIVE or key in _NON_NEGATIVE:
        high, unit = _POSITIVE.get(key) or _NON_NEGATIVE[key]
        rule = (f"a positive number at most {high:g} ({unit})" if key in _POSITIVE
                else f"a number >= 0 and at most {high:g} ({unit})")
        x = _in_range(name, key, value, rule, 0.0, high, open_low=key in _POSITIVE)
        return {_FIELD_OF.get(key, key): x * 1e12 if key.endswith("_tflops")
                else x / 1e6 if key.endswith("_us") else x}
    if key == "gpus_per_node":
        if isinstance(value, bool) or not isinstance(value, int) \
                or not 1 <= value <= MAX_GPUS_PER_NODE:
            raise TesselError(f"hardware profile {name!r}: gpus_per_node must be a whole number "
                              f"from 1 to {MAX_GPUS_PER_NODE}, not {shown(value)}")
    elif key == "device_type" and value not in ("cuda", "cpu"):
        raise TesselError(f"hardware profile {name!r}: device_type must be \"cuda\" or \"cpu\"")
    elif key == "device_names":
        if not isinstance(value, (list, tuple)) or not all(isinstance(n, str) for n in value):
            raise TesselError(f"hardware profile {name!r}: device_names must be a list of text")
        value = tuple(value)
    elif key == "collective_curve_us":
        return {"collective_curve": _curve(name, value)}
    return {key: value}  # the efficiencies: checked on the whole profile (its device type)


def efficiency_ceiling(profile: GpuProfile) -> float:
    """The largest efficiency a profile may have: 1 on a GPU (a fraction of its peak or link),
    FITTED_CEILING on CPU processes, where calibration fits factors (the planner's model of
    a step is a GPU's)."""
    return FITTED_CEILING if profile.device_type == "cpu" else 1.0


def _efficiencies(profile: GpuProfile) -> None:
    """Each efficiency in (0, efficiency_ceiling]; one line naming it otherwise."""
    high = efficiency_ceiling(profile)
    for key, what in (("matmul_efficiency", "a fraction of the peak"),
                      ("comm_efficiency", "a fraction of the link bandwidth")):
        what = "a fitted factor on CPU processes" if high > 1 else what
        _in_range(profile.name, key, getattr(profile, key), f"a number in (0, {high:g}] ({what})",
                  0.0, high)


def _profile_from_table(name: str, table: dict, base: GpuProfile | None) -> GpuProfile:
    unknown = set(table) - _FIELDS
    if unknown:
        raise TesselError(
            f"hardware profile {name!r}: unknown key {sorted(unknown)[0]!r}; keys: "
            + ", ".join(sorted(_FIELDS))
        )
    values = dataclasses.asdict(base) if base is not None else {}
    values["name"] = name
    for key, value in table.items():
        values.update(_field(name, key, value))
    needed = {"bf16_flops", "memory_gib", "intra_node_gbps", "inter_node_gbps", "gpus_per_node"}
    missing = needed - set(values)
    if missing:
        raise TesselError(
            f"hardware profile {name!r} lacks {sorted(missing)[0].replace('_flops', '_tflops')}; "
            "a new profile needs bf16_tflops, memory_gib, intra_node_gbps, inter_node_gbps and "
            "gpus_per_node"
        )
    values.setdefault("fp8_flops", None)
    profile = GpuProfile(**values)
    _efficiencies(profile)
    return profile


def load_profiles(path: str | Path | None = None) -> dict[str, GpuProfile]:
    """The built-in profiles, updated by the `[gpu.NAME]` tables of `path` (or of the file
    $TESSEL_HARDWARE names). A table for a built-in name overrides only the keys it sets."""
    profiles = dict(BUILTIN)
    source = path or os.environ.get("TESSEL_HARDWARE")
    if not source:
        return profiles
    file = Path(source)
    data = read_toml(file, "hardware file")
    tables = data.get("gpu")
    if not isinstance(tables, dict) or not tables:
        raise TesselError(f"hardware file {str(file)!r} has no [gpu.NAME] tables")
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise TesselError(f"hardware file {str(file)!r}: gpu.{name} must be a table")
        profiles[name] = _profile_from_table(name, table, profiles.get(name))
    return profiles


def get_profile(name: str, profiles: dict[str, GpuProfile] | None = None) -> GpuProfile:
    profiles = profiles if profiles is not None else load_profiles()
    if name not in profiles:
        raise TesselError(
            f"unknown GPU {name!r}; known: {', '.join(profiles)} (add one with --hardware FILE)"
        )
    return profiles[name]


def profile_for_device(device_name: str, profiles: dict[str, GpuProfile] | None = None
                       ) -> GpuProfile | None:
    """The profile whose device_names match torch.cuda.get_device_name(), if any: of several,
    the one with the longest matching name (the most specific), the first on a tie."""
    name = device_name.lower()
    best, length = None, -1
    for profile in (profiles or BUILTIN).values():
        matched = max((len(s) for s in profile.device_names if s.lower() in name), default=-1)
        if matched > length:
            best, length = profile, matched
    return best


def calibrate(profile: GpuProfile, predict: Callable[[GpuProfile], float],
              measured_tokens_per_s: float, floor: float = 0.05, ceiling: float = 1.0
              ) -> GpuProfile:
    """The profile with the matmul efficiency at which `predict` (tokens/s of the measured
    run under a profile) equals the measurement; bisection, as the prediction rises with
    the efficiency. Clamped to [floor, ceiling]: on a GPU [0.05, 1] (far below 5% of peak is
    a broken run, not a slow GPU); on CPU processes (`tessel scale --measure`) wider, where
    it is a fitted factor rather than a fraction (the planner's small-matmul penalty is a
    GPU kernel's, and a CPU's small matmuls run nearer its large-matmul rate)."""
    if measured_tokens_per_s <= 0:
        raise TesselError("calibration needs a positive measured tokens/s")
    at = lambda eff: predict(dataclasses.replace(profile, matmul_efficiency=eff))  # noqa: E731
    return dataclasses.replace(
        profile, matmul_efficiency=_solve(at, measured_tokens_per_s, floor, ceiling, rising=True))


def limit_note(value: float, slow_end: float, fast_end: float, label: str = "") -> str:
    """' (at the limit X: ...)' when a fit stopped at an end of its range (`slow_end`: where a
    measurement slower than the model can explain leaves it), else ''."""
    for end, side in ((slow_end, "slower"), (fast_end, "faster")):
        if math.isclose(value, end, rel_tol=1e-3):
            return (f" (at the limit {label}{end:.4g}: the measurement is {side} than the model "
                    "can explain)")
    return ""


def _solve(at: Callable[[float], float], target: float, lo: float, hi: float,
           rising: bool) -> float:
    """The x in [lo, hi] where the monotonic `at(x)` (rising or falling with x) equals
    `target`, clamped to the ends; geometric bisection (the same relative precision at 0.5
    and at 0.001), rounded to 4 significant digits."""
    below = (lambda v: v < target) if rising else (lambda v: v > target)  # noqa: E731
    if below(at(hi)) or at(hi) == target:
        lo = hi
    elif not below(at(lo)):
        hi = lo
    for _ in range(60):
        if hi / lo < 1.0001:
            break
        mid = (lo * hi) ** 0.5
        if below(at(mid)):
            lo = mid
        else:
            hi = mid
    return float(f"{(lo * hi) ** 0.5:.4g}")


def calibrate_optimizer(profile: GpuProfile, predict_s: Callable[[GpuProfile], float],
                        measured_s: float) -> GpuProfile:
    """The profile with the memory bandwidth (`hbm_gbps`, which only the optimizer step's
    time reads) at which `predict_s` (the optimizer step's seconds under a profile) equals
    the measured optimizer phase: bisection over 1/1000 to 1000 times the profile's, as the
    prediction falls as the bandwidth rises. A CPU's optimizer runs its element-wise
    operators one after another on one thread, well below the copy bandwidth measured for
    the profile (about a third of it for AdamW on this project's machine)."""
    if measured_s <= 0:
        raise TesselError("calibration needs a positive measured optimizer time")
    at = lambda gbps: predict_s(dataclasses.replace(profile, hbm_gbps=gbps))  # noqa: E731
    return dataclasses.replace(profile, hbm_gbps=_solve(
        at, measured_s, profile.hbm_gbps / 1000, profile.hbm_gbps * 1000, rising=False))


def profile_table(profile: GpuProfile) -> dict[str, object]:
    """The profile as the keys of a `[gpu.NAME]` table (`profile_from_table` reads it back to
    the same profile): in a hardware file, or in the JSON of `tessel scale --measure`."""
    table: dict[str, object] = {"bf16_tflops": profile.bf16_flops / 1e12}
    if profile.fp8_flops:
        table["fp8_tflops"] = profile.fp8_flops / 1e12
    table.update(
        memory_gib=profile.memory_gib, intra_node_gbps=profile.intra_node_gbps,
        inter_node_gbps=profile.inter_node_gbps, gpus_per_node=profile.gpus_per_node,
        hbm_gbps=profile.hbm_gbps, host_memory_gib=profile.host_memory_gib,
        matmul_efficiency=profile.matmul_efficiency, comm_efficiency=profile.comm_efficiency,
        collective_latency_us=profile.collective_latency_s * 1e6)
    for key in ("tp_block_overhead_us", "tp_block_optimizer_us"):
        if getattr(profile, _FIELD_OF[key]):
            table[key] = getattr(profile, _FIELD_OF[key]) * 1e6
    table.update({key: getattr(profile, key) for key in ("sync_drift", "sync_skew")
                  if getattr(profile, key)})
    if profile.collective_curve:
        table["collective_curve_us"] = [[b, t * 1e6] for b, t in profile.collective_curve]
    if profile.device_names:
        table["device_names"] = list(profile.device_names)
    if profile.device_type != "cuda":
        table["device_type"] = profile.device_type
    return table


def profile_from_table(name: str, table: object) -> GpuProfile:
    """A whole profile from a `[gpu.NAME]` table's keys (all required ones present)."""
    if not isinstance(table, dict):
        raise TesselError(f"hardware profile {name!r} is not a table of keys")
    return _profile_from_table(name, table, None)


def profile_toml(profile: GpuProfile) -> str:
    """A `[gpu.NAME]` table that load_profiles reads back to the same profile (a NAME with
    dots, spaces or quotes quoted: `[gpu."my.gpu"]`)."""
    import tomli_w

    return tomli_w.dumps({"gpu": {profile.name: profile_table(profile)}})  # the name quoted
