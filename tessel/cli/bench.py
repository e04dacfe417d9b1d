"""`tessel bench`: time the real trainer step on one device and report tokens/s and MFU."""

from __future__ import annotations

from tessel.cli.args import Parser, add_config_arguments, parse_config_args, toml_str
from tessel.errors import TesselError
from tessel.numbers import whole_number

_NOT_TRAIN = ("tessel bench takes no --resume, --quiet, --auto-resume or --force "
              "(see tessel bench --help)")


def build_parser() -> Parser:
    p = Parser(
        prog="tessel bench", allow_abbrev=False,
        description="Time the real trainer step on one device (synthetic tokens; warm-up excluded) "
                    "and print\ntokens/s, step time (median and spread), TFLOP/s, MFU against the "
                    "device's dense BF16 peak\nand against a large matrix multiply measured on the "
                    "same device, peak memory, and the\nplanner's memory prediction. Writes the "
                    "figures as JSON (--json, default bench.json); that\nfile also calibrates the "
                    "planner: `tessel plan --calibrate bench.json`.")
    add_config_arguments(p)
    p.add_argument("--precision", metavar="P", help="fp32 | bf16 | fp16 | auto (train.precision)")
    p.add_argument("--compile", action="store_true", help="compile each block (train.compile = true)")
    p.add_argument("--fp8", action="store_true",
                   help="float8 linears through torchao (train.fp8 = true: tensorwise scaling)")
    p.add_argument("--fp8-recipe", metavar="RECIPE",
                   choices=("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8"),
                   help="float8 with this scaling recipe (train.fp8 = RECIPE): tensorwise, "
                        "rowwise, rowwise_with_gw_hp or mxfp8")
    p.add_argument("--warmup", default="5", metavar="N", help="untimed steps first (default 5)")
    p.add_argument("--steps", default="20", metavar="N", help="timed steps (default 20)")
    p.add_argument("--json", default="bench.json", metavar="OUT.json",
                   help="where to write the figures (default bench.json)")
    p.add_argument("--no-matmul", dest="matmul", action="store_false",
                   help="skip the matrix-multiply peak measurement")
    return p


def cmd_bench(argv: list[str]) -> int:
    args, overrides = parse_config_args(
        build_parser(), argv, refused=dict.fromkeys(
            ("--resume", "--quiet", "--auto-resume", "--force"), _NOT_TRAIN))
    counts = {flag: whole_number(getattr(args, flag)) for flag in ("warmup", "steps")}
    for flag, count in counts.items():
        if count is None:
            raise TesselError(f"--{flag} takes a whole number, not {getattr(args, flag)!r}")
    # bench's own flags are config fields; explicit --section.key overrides win over them.
    flags = [f"--train.precision={toml_str(args.precision)}"] if args.precision is not None else []
    flags += ["--train.compile=true"] * args.compile + ["--train.fp8=true"] * args.fp8
    if args.fp8_recipe is not None:
        flags.append(f"--train.fp8={toml_str(args.fp8_recipe)}")

    from pathlib import Path

    from tessel.bench import report, run_bench, write_json
    from tessel.checkpoint.init_from import load_config

    cfg = load_config(args.config, [*flags, *overrides])
    result = run_bench(cfg, warmup=counts["warmup"], steps=counts["steps"], matmul=args.matmul)
    print(report(result))
    write_json(result, Path(args.json))
    print(f"wrote {args.json}")
    return 0
