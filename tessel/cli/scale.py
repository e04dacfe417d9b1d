"""`tessel scale`: predicted strong and weak scaling over a list of GPU counts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tessel.cli.args import (
    Parser,
    add_config_arguments,
    output_file,
    parse_config_args,
    toml_str,
)
from tessel.cli.plan import add_hardware_arguments, calibrated, hardware_profile
from tessel.errors import TesselError
from tessel.numbers import whole_number

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
not used: each count is searched.

  --measure --nproc 1,2,4   instead of predicting GPU counts, run the config for real at
                      each process count of this machine (`tessel train --nproc N`, all
                      processes in one parallel dimension: --over dp (default), tp, pp,
                      cp or ep; --warmup steps, then --steps timed
                      ones, then as many again with every other one
                      profiled for its communication) and print what
                      each run measured (tokens/s, efficiency, step
                      split, exposed communication) beside the planner's
                      prediction of that run. On CPU the planner's device is this machine,
                      measured first (matmul and memory rate of one process, gloo's
                      calls at six sizes, the ranks' drift on the config's model; with
                      --over tp what a tensor-parallel block adds beyond its share of
                      the compute); its matmul efficiency and its optimizer's memory rate are
                      calibrated on the first point, so the others' errors are the
                      planner's errors in scaling. Inside a SLURM allocation of several
                      nodes (sbatch, salloc) each count's processes are spread over its
                      nodes through srun (N processes on the most nodes, at most the
                      allocation's, that share them equally).""")
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
    p.add_argument("--measure", action="store_true",
                   help="run the config at each --nproc process count and put the "
                        "measurements beside the predictions")
    p.add_argument("--nproc", metavar="N,N,...",
                   help="with --measure: process counts on this machine (inside a SLURM "
                        "allocation of several nodes: over its nodes), e.g. 1,2")
    p.add_argument("--warmup", default="3", metavar="N",
                   help="with --measure: untimed steps of each run first (default 3)")
    p.add_argument("--steps", default="10", metavar="N",
                   help="with --measure: timed steps of each run (default 10)")
    p.add_argument("--over", default="dp", choices=("dp", "tp", "pp", "cp", "ep"),
                   help="with --measure: the parallel dimension the processes go to: data "
                        "(default), tensor, pipeline, context or expert parallel of degree N")
    p.add_argument("--out", metavar="DIR",
                   help="with --measure: a new directory for the runs (default "
                        "runs/scale-<config>-<time>)")
    return p


def parse_counts(text: str, flag: str = "--gpus", what: str = "GPU") -> list[int]:
    """`8,64,512` -> [8, 64, 512]: positive, distinct, in increasing order."""
    counts = []
    example = "8,64,512" if flag == "--gpus" else "1,2,4"
    for word in text.split(","):
        word = word.strip().replace("_", "")
        count = whole_number(word)
        if count is None or count < 1:
            raise TesselError(f"{flag} {text!r}: {word!r} is not a {what} count; give positive "
                              f"whole numbers separated by commas, e.g. {flag} {example}")
        counts.append(count)
    if counts != sorted(set(counts)):
        raise TesselError(f"{flag} {text!r}: give each {what} count once, in increasing order "
                          "(the first is the baseline of the efficiency)")
    return counts


def _html_path(text: str | None) -> Path | None:
    """--html FILE, checked before any work: a file we can write, in an existing directory."""
    return None if not text else output_file("--html", text)


def _write_page(html: Path | None, sweep) -> None:  # noqa: ANN001
    """The --html page, after the results were printed: a page that cannot be written then
    (the disk filled up) loses nothing printed, and its error names FILE, not the temporary
    file beside it."""
    if html is None:
        return
    from tessel.fileio import write_text_atomic
    from tessel.planner.scaling_page import render

    try:
        write_text_atomic(html, render(sweep))
    except OSError as exc:
        raise TesselError(f"--html {str(html)!r}: cannot write it ({exc.strerror or exc}); the "
                          "results are printed above") from None
    print(f"wrote {html}", file=sys.stderr)


def cmd_scale(argv: list[str]) -> int:
    args, overrides = parse_config_args(build_parser(), argv, refused=dict.fromkeys(
        ("--resume", "--quiet", "--auto-resume", "--force", "--top"), _NOT_TRAIN))
    if args.measure or args.nproc is not None:
        return _measure(args, overrides)
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
    html = _html_path(args.html)

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
    print(json.dumps(scaling.as_json(sweep), indent=1) if args.json else scaling.text(sweep),
          end="\n" if args.json else "", flush=True)
    _write_page(html, sweep)
    return 0


def _whole(flag: str, value: str, least: int) -> int:
    count = whole_number(value)
    if count is None or count < least:
        raise TesselError(f"--{flag} takes a whole number >= {least}, not {value!r}")
    return count


def _measure_request(args, overrides: list[str]):  # noqa: ANN001, ANN202
    """What `--measure` was asked to run, checked before any run: (process counts, warm-up
    and timed steps, the config, the output directory, the --html page)."""
    import time

    from tessel.checkpoint.init_from import load_config

    if not args.measure or args.nproc is None:
        raise TesselError("--measure runs the config at each process count of --nproc (e.g. "
                          "--measure --nproc 1,2); give both")
    if args.gpus is not None or args.models is not None:
        raise TesselError("--measure measures the process counts of --nproc on this machine; "
                          "leave out --gpus and --models (predict those without --measure)")
    nprocs = parse_counts(args.nproc, "--nproc", "process")
    warmup, steps = _whole("warmup", args.warmup, 0), _whole("steps", args.steps, 1)
    if args.config is None:
        raise TesselError("tessel scale --measure needs a config file to run, e.g. "
                          "tessel scale configs/tiny.toml --measure --nproc 1,2")
    base = load_config(args.config, overrides)  # a bad config fails here, before any run
    out = Path(args.out) if args.out else Path("runs") / (
        f"scale-{Path(args.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    return nprocs, warmup, steps, base, out, _html_path(args.html)


def _measured_machine(args, base, nprocs: list[int], cuda: bool):  # noqa: ANN001, ANN202
    """(the hardware profile the planner predicts with, this machine's probe on CPU, else
    None), or None when a GPU's profile was not given."""
    from tessel.scaling import compare

    if cuda:
        hw = hardware_profile(args)
        return None if hw is None else (hw, None)
    # What a tensor-parallel block adds is measured only for a sweep that has
    # tensor-parallel points (it takes a few seconds).
    tp_model = base.model if args.over == "tp" and max(nprocs) > 1 else None
    return compare.machine_profile(
        max(nprocs), model=tp_model, sequence_parallel=base.parallel.sequence_parallel,
        drift_model=base.model, tokens=(base.train.micro_batch_size, base.train.seq_len))


def _said(point) -> None:  # noqa: ANN001
    """One line on stderr as each count's run ends."""
    what = (f"{point.tokens_per_s:,.0f} tokens/s" if point.ok else point.error)
    print(f"tessel scale: {point.nproc} process(es): {what}", file=sys.stderr, flush=True)


def _measurement(args, out: Path, warmup: int, steps: int, nprocs: list[int], cuda: bool,  # noqa: ANN001
                 machine, hw, fitted, alloc) -> dict:  # noqa: ANN001
    """The `measurement` entry of the --json record: how and where the runs were made."""
    from tessel.planner.hardware import profile_table
    from tessel.scaling import allocation
    from tessel.scaling.points import profiled_steps

    return {"out": str(out), "warmup": warmup, "steps": steps,
            "profiled_steps": profiled_steps(steps), "over": args.over,
            "device_type": "cuda" if cuda else "cpu",
            "machine": None if cuda else machine,
            "profile": None if cuda else profile_table(hw),
            "calibrated_matmul_efficiency": fitted,
            "slurm": None if alloc is None else {
                "job_id": alloc.job_id, "hosts": list(alloc.hosts),
                "nodes": {str(n): allocation.nodes_for(n, len(alloc.hosts))
                          for n in nprocs}}}


def _measure(args, overrides: list[str]) -> int:  # noqa: ANN001
    """`tessel scale --measure --nproc N,N,...`: real runs beside the planner's predictions."""
    import torch

    from tessel.planner import scaling
    from tessel.scaling import allocation, compare, measure_sweep
    from tessel.scaling.measure import check_counts, check_sweep, layout_over
    from tessel.scaling.points import profiled_steps

    nprocs, warmup, steps, base, out, html = _measure_request(args, overrides)
    cuda = torch.cuda.is_available()
    alloc = allocation.current()
    # Before the machine's probe (which starts max(nprocs) processes) and any run: counts
    # that cannot run, an output directory that holds an earlier sweep or cannot be made.
    check_counts(base, nprocs, args.over, strong=not args.weak, local=alloc is None and not cuda)
    check_sweep(nprocs, warmup, steps, out)
    profiled = _measured_machine(args, base, nprocs, cuda)
    if profiled is None:
        return 0
    hw, machine = profiled
    mode = scaling.WEAK if args.weak else scaling.STRONG
    command_for = None
    if alloc is not None:
        command_for = allocation.command_for(alloc, gpus=cuda)
        print(f"tessel scale: inside SLURM job {alloc.job_id}: each count's processes spread "
              f"over up to {len(alloc.hosts)} nodes ({', '.join(alloc.hosts)}) through srun",
              file=sys.stderr, flush=True)
    points = measure_sweep(Path(args.config), overrides, nprocs, out, warmup=warmup,
                           steps=steps, strong=mode == scaling.STRONG, on_point=_said,
                           layout_for=layout_over(args.over), command_for=command_for)
    sweep, fitted = compare.predict(points, hw, "cuda" if cuda else "cpu", mode, args.config,
                                    base)
    record = scaling.as_json(sweep)
    for rec, point in zip(record["points"], sweep.points):
        if rec["measured"] is not None and rec["measured"]["tokens_per_s"] is not None:
            rec["config"] = point.config.to_dict()  # what `--calibrate` predicts the run from
    record["measurement"] = _measurement(args, out, warmup, steps, nprocs, cuda, machine, hw,
                                         fitted, alloc)
    if args.json:
        print(json.dumps(record, indent=1))
    else:
        print(scaling.text(sweep), end="")
        print(f"\nmeasured ({out}; {warmup} warm-up, {steps} timed and "
              f"{profiled_steps(steps)} profiled steps per run; the planner "
              f"calibrated on the first point{compare.fitted_text(fitted)}):")
        print(compare.comparison(sweep), end="")
    sys.stdout.flush()
    _write_page(html, sweep)
    return 0 if all(p.ok for p in points) else 1
