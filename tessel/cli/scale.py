"""`tessel scale`: predicted strong and weak scaling over a list of GPU counts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tessel.cli.args import Parser, add_config_arguments, parse_config_args, toml_str
from tessel.cli.plan import add_hardware_arguments, calibrated, hardware_profile
from tessel.errors import TesselError

_NOT_TRAIN = ("tessel scale takes a config and overrides, not train's flags; to predict a "
              "run's scaling, pass RUN_DIR/config.toml")


def build_parser() -> Parser:
    p = Parser(
        prog="tessel scale",
        description="""\
Predict how the config scales over a list of GPU counts: at each count the fastest layout
the planner finds (the search of `tessel plan`), tokens/s per GPU, MFU, scaling efficiency
against the first point, the step time split into compute and exposed data-parallel,
tensor-parallel, pipeline (bubble and sends), context-parallel and expert all-to-all time,
and memory per GPU. A count where nothing fits says why, and the sweep goes on.

  --strong (default)  the config's global batch at every count: the same work on more GPUs
  --weak              the config's batch per GPU (train.global_batch_size over the first
                      count) at every count: the global batch grows with the GPUs; with
                      --models, a bigger model at each count too

Efficiency is model FLOP/s per GPU over the first point's (for one model: tokens/s per
GPU over the first point's; 1 is perfect scaling). The config's own layout (parallel.*) is
not used: each count is searched.""")
    add_config_arguments(p)
    p.add_argument("--gpus", metavar="N,N,...",
                   help="GPU counts, comma-separated, e.g. 8,64,512,4096 (required)")
    add_hardware_arguments(p)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--strong", action="store_true",
                      help="hold the global batch fixed (the default)")
    mode.add_argument("--weak", action="store_true", help="hold the batch per GPU fixed")
    p.add_argument("--models", metavar="PRESET,...",
                   help="with --weak: a model preset per GPU count (`tessel presets` lists "
                        "them), e.g. gpt3-1.3b,gpt3-6.7b,gpt3-13b,gpt3-175b")
    p.add_argument("--json", action="store_true",
                   help="machine-readable output (docs/scaling.md describes the schema)")
    p.add_argument("--html", metavar="FILE",
                   help="also write a self-contained HTML page with the curves to FILE")
    return p


def parse_counts(text: str) -> list[int]:
    """`8,64,512` -> [8, 64, 512]: positive, distinct, in increasing order."""
    counts = []
    for word in text.split(","):
        word = word.strip().replace("_", "")
        if not word.isdigit() or int(word) < 1:
            raise TesselError(f"--gpus {text!r}: {word!r} is not a GPU count; give positive "
                              "whole numbers separated by commas, e.g. --gpus 8,64,512")
        counts.append(int(word))
    if counts != sorted(set(counts)):
        raise TesselError(f"--gpus {text!r}: give each GPU count once, in increasing order "
                          "(the first is the baseline of the efficiency)")
    return counts


def cmd_scale(argv: list[str]) -> int:
    args, overrides = parse_config_args(build_parser(), argv, refused=dict.fromkeys(
        ("--resume", "--quiet", "--auto-resume", "--force", "--top", "--nproc"), _NOT_TRAIN))
    from tessel.checkpoint.init_from import load_config
    from tessel.planner import scaling

    hw = hardware_profile(args)
    if hw is None:  # --gpu list
        return 0
    if args.gpus is None:
        raise TesselError("tessel scale needs --gpus N,N,..., the GPU counts to predict, "
                          "e.g. --gpus 8,64,512")
    gpus = parse_counts(args.gpus)
    mode = scaling.WEAK if args.weak else scaling.STRONG
    models: list[str | None] = [None] * len(gpus)
    if args.models is not None:
        if mode != scaling.WEAK:
            raise TesselError("--models gives a model per GPU count for weak scaling; add "
                              "--weak, or leave --models out to scale one model")
        models = [m.strip() for m in args.models.split(",")]
        if len(models) != len(gpus):
            raise TesselError(f"--models names {len(models)} models for {len(gpus)} GPU counts; "
                              "give one preset per count")
    html = Path(args.html) if args.html else None
    if html is not None and html.is_dir():
        raise TesselError(f"--html {args.html!r} is a directory; pass a file name, e.g. "
                          f"{html / 'scale.html'}")
    if html is not None and not html.parent.is_dir():
        raise TesselError(f"--html {args.html!r}: no directory {str(html.parent)!r} to write "
                          "it in; create it or pass another path")

    base = load_config(args.config, overrides)
    batches = scaling.global_batches(base.train.global_batch_size, gpus, mode)
    loaded = {(base.train.global_batch_size, None): base}
    for batch, model in dict.fromkeys(zip(batches, models)):
        if (batch, model) in loaded:
            continue
        extra = [f"--train.global_batch_size={batch}"]
        if model is not None:
            extra.append(f"--model.preset={toml_str(model)}")
        loaded[batch, model] = load_config(args.config, [*overrides, *extra])
    points = [(n, loaded[batch, model]) for n, batch, model in zip(gpus, batches, models)]
    scaling.check_splits(points, hw)  # bad counts refused before calibrate says anything
    if args.calibrate:
        hw = calibrated(hw, Path(args.calibrate))

    def progress(n: int) -> None:
        if sys.stderr.isatty():  # a long sweep says where it is; logs and pipes stay clean
            print(f"tessel scale: searching {n:,} GPUs ...", file=sys.stderr, flush=True)

    sweep = scaling.run_sweep(points, hw, mode, args.config, progress)
    if html is not None:
        from tessel.fileio import write_text_atomic
        from tessel.planner.scaling_page import render

        write_text_atomic(html, render(sweep))
    print(json.dumps(scaling.as_json(sweep), indent=1) if args.json else scaling.text(sweep),
          end="\n" if args.json else "")
    if html is not None:
        print(f"wrote {html}", file=sys.stderr)
    return 0
