"""`tessel plan`: memory, speed and the best layouts, before launch."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tessel.cli.args import Parser, add_config_arguments, output_file, parse_config_args
from tessel.errors import TesselError

if TYPE_CHECKING:
    from tessel.planner.hardware import GpuProfile

_DEGREES = {"dp_replicate", "dp_shard", "tp", "pp", "cp", "zero"}
_NOT_TRAIN = ("tessel plan takes a config and overrides, not train's flags; "
              "to plan a run, pass RUN_DIR/config.toml")


def build_parser() -> Parser:
    p = Parser(
        prog="tessel plan",
        description="""\
Predict per-GPU memory, step time, tokens/s, MFU and the time to the configured token budget
(train.steps x global batch) before launch, for the config and overrides `tessel train` would
take. Without a layout in the config (no parallel degree or zero stage set, or
parallel.auto = true) it searches every layout tessel can run on N GPUs and ranks those that
fit by predicted tokens/s; with one (e.g. --parallel.tp=2 --parallel.pp=2) it evaluates that
layout and, if it does not fit, names the nearest that do.""")
    add_config_arguments(p)
    p.add_argument("--gpus", type=int, metavar="N", help="GPUs in the job (required)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--top", type=int, default=10, metavar="K", help="layouts to show (default 10)")
    add_hardware_arguments(p)
    p.add_argument("--save-hardware", metavar="FILE",
                   help="write the (calibrated) profile as a TOML table for --hardware")
    return p


def add_hardware_arguments(p: Parser) -> None:
    """--gpu, --hardware and --calibrate: the GPU profile a prediction uses (`tessel plan`,
    `tessel scale`); `hardware_profile` and `calibrated` read them."""
    p.add_argument("--gpu", default="h100-sxm", metavar="NAME",
                   help="hardware profile (default h100-sxm); --gpu list shows them")
    p.add_argument("--hardware", metavar="FILE",
                   help="extra or overriding profiles ([gpu.NAME] tables; also $TESSEL_HARDWARE)")
    p.add_argument("--calibrate", metavar="PATH",
                   help="fit the profile's matmul efficiency to a measured run: a run directory "
                        "of `tessel train`, a JSON file with tokens_per_s, world_size, config, "
                        "or the JSON of `tessel bench`; or fit it and the communication "
                        "speed to a measured sweep (the JSON of `tessel scale --measure "
                        "--json`)")


def hardware_profile(args: argparse.Namespace) -> GpuProfile | None:
    """The GPU profile --gpu and --hardware name (not yet calibrated), or None after
    printing every profile for `--gpu list`."""
    from tessel.planner import hardware

    profiles = hardware.load_profiles(args.hardware)
    if args.gpu == "list":
        for name, prof in profiles.items():
            fp8 = f"{prof.fp8_flops / 1e12:5.4g}" if prof.fp8_flops else "    -"
            rate = "bf16" if prof.device_type == "cuda" else "peak"  # CPU processes: no bf16
            print(f"{name:12s} {rate} {prof.bf16_flops / 1e12:5.4g}  fp8 {fp8} TFLOP/s  "
                  f"{prof.memory_gib:6.1f} GiB  {prof.gpus_per_node} per node  "
                  f"{prof.intra_node_gbps:g}/{prof.inter_node_gbps:g} GB/s intra/inter")
        return None
    return hardware.get_profile(args.gpu, profiles)


def cmd_plan(argv: list[str]) -> int:
    args, overrides = parse_config_args(build_parser(), argv, refused=dict.fromkeys(
        ("--resume", "--quiet", "--auto-resume", "--force"), _NOT_TRAIN))
    if args.top < 1:
        raise TesselError("--top must be >= 1")

    from tessel.checkpoint.init_from import load_config
    from tessel.planner import hardware, report, search

    hw = hardware_profile(args)
    if hw is None:  # --gpu list
        return 0
    if args.gpus is None or args.gpus < 1:
        raise TesselError("tessel plan needs --gpus N (N >= 1), the number of GPUs of the job")
    if args.save_hardware:  # writable before the calibration's work, not only after it
        output_file("--save-hardware", args.save_hardware)
    cfg = load_config(args.config, overrides)
    if args.calibrate:
        hw = calibrated(hw, Path(args.calibrate))
    if args.save_hardware:
        from tessel.fileio import write_text_atomic

        write_text_atomic(Path(args.save_hardware), hardware.profile_toml(hw))
        print(f"wrote profile {hw.name!r} to {args.save_hardware}", file=sys.stderr)

    searching = cfg.parallel.auto or not (cfg.parallel.model_fields_set & _DEGREES)
    if searching:
        start = time.perf_counter()
        result = search.search(cfg, args.gpus, hw, keep=max(args.top, 10))
        took = time.perf_counter() - start
        if args.json:
            out = report.as_json(cfg, args.gpus, hw, result.plans[: args.top],
                                 result.too_big[: report.TOP_REJECTED], result.invalid)
            print(json.dumps(out, indent=1))
        else:
            print(report.search_text(cfg, args.gpus, hw, result, took, args.config, args.top),
                  end="")
        return 0

    from tessel.planner.layout import Layout

    layout = Layout.from_config(cfg, args.gpus)
    reason = search.trainer_refusal(cfg, layout, hw.device_type, full=True)
    if reason is not None:
        raise TesselError(reason)
    plan = search.evaluate(cfg, layout, hw)
    nearest = [] if plan.fits else search.nearest_fitting(cfg, layout, hw)
    if args.json:
        out = report.as_json(cfg, args.gpus, hw, [plan], [])
        out["nearest_fitting"] = [q.as_dict() for q in nearest]
        print(json.dumps(out, indent=1))
    else:
        print(report.single_text(cfg, args.gpus, hw, plan, nearest), end="")
    return 0


def calibrated(hw: GpuProfile, path: Path) -> GpuProfile:
    """The profile with its matmul efficiency fitted to the measured run at `path`."""
    from tessel.planner import hardware, search, sweep_fit
    from tessel.planner.layout import Layout
    from tessel.planner.measured import read_json_object, read_measured

    data = read_json_object(path) if path.is_file() else None
    if data is not None and sweep_fit.is_sweep(data):
        sweep = sweep_fit.read_sweep(data, repr(str(path)))
        base = sweep.profile or hw
        tuned, said = sweep_fit.fit(
            base, sweep, lambda c, lay, h, d: search.evaluate(c, lay, h, d))
        whose = (" (the profile the sweep measured on CPU processes)"
                 if sweep.profile is not None else "")
        print(f"calibrated {base.name}{whose} on the sweep {path}: {said}", file=sys.stderr)
        return tuned
    run = read_measured(path)
    try:
        layout = Layout.from_config(run.config, run.world_size)
    except TesselError as exc:
        raise TesselError(f"--calibrate {run.source!r}: the run's config on its world_size "
                          f"{run.world_size}: {exc}") from None
    # against tokens/s as the run logged it (train.tokens_per_step: a DPO pair's two rows)
    predict = lambda profile: search.evaluate(run.config, layout, profile).tokens_per_s  # noqa: E731
    predicted = predict(hw)
    floor, ceiling = hardware.CALIBRATION_LIMITS[hw.device_type]
    tuned = hardware.calibrate(hw, predict, run.tokens_per_s, floor, ceiling)
    print(f"calibrated {hw.name}: matmul efficiency {hw.matmul_efficiency:.3f} -> "
          f"{tuned.matmul_efficiency:.3f}"
          f"{hardware.limit_note(tuned.matmul_efficiency, floor, ceiling)} (measured "
          f"{run.tokens_per_s:,.0f} tokens/s, predicted {predicted:,.0f}, from {run.source})",
          file=sys.stderr)
    return tuned
