"""The `tessel` command.

    tessel train [CONFIG.toml] [--section.key=value ...]   train (no arguments: the demo)
    tessel train --resume RUN_DIR [--section.key=value ...]
    tessel train ... --nproc N                              N processes on this machine (torchrun)
    tessel launch slurm CONFIG.toml --nodes N [--gpus-per-node G] [...]   print an sbatch script
    tessel launch k8s CONFIG.toml --nodes N --image IMAGE [...]           print a Kubeflow PyTorchJob
    tessel checkpoint consolidate RUN_DIR|CHECKPOINT [--output FILE]   one-file model
    tessel plan [CONFIG.toml] --gpus N [--gpu NAME] [--json]   predict memory/speed, pick a layout
    tessel convert hf-to-tessel HF_DIR OUT_DIR              import Hugging Face weights
    tessel convert tessel-to-hf RUN_DIR|CHECKPOINT HF_DIR   export for transformers/vLLM
    tessel generate RUN_DIR --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K]
    tessel bench [CONFIG.toml] [--precision P] [--compile] [--json OUT]   time the trainer step, MFU
    tessel report RUN_DIR [--out PATH]                      one self-contained HTML page of a run
    tessel presets                                          model shapes and parameter counts
    tessel config [CONFIG.toml] [--section.key=value ...]   print the resolved config
    tessel config --reference                               every config key, as Markdown
    tessel tokenizer train --input PATH [PATH ...] --vocab-size N --output TOKENIZER.json
    tessel preprocess --input PATH [PATH ...] [--tokenizer SPEC] --output PREFIX [--workers N]
    tessel data inspect PREFIX [--verify]                   sizes, tokenizer, a decoded sample

Bad input prints one line to stderr and exits with code 2.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import NoReturn

from tessel.errors import TesselError

TRAIN_HELP = """\
usage: tessel train [CONFIG.toml] [--section.key=value ...]
       tessel train --resume RUN_DIR [--section.key=value ...]

Train a model. With no arguments, trains the embedded demo (a small GPT on this Python's
standard-library sources) into runs/demo.

options:
  CONFIG.toml          a TOML recipe (see configs/); dotted overrides win over it
  --resume RUN_DIR     continue RUN_DIR from its latest checkpoint, with its config.toml;
                       overrides may change e.g. train.steps but not the model or data
  --quiet              no console output (metrics still go to RUN_DIR/metrics.jsonl)
  --auto-resume        continue run.dir from its latest checkpoint if it holds a run, else
                       start it (what job scripts and torchrun restarts use)
  --force              train even if the planner predicts the layout does not fit in GPU memory
  --nproc N            train as N processes on this machine, started through torchrun
                       (on several machines use torchrun yourself, or `tessel launch`)
  --section.key=value  set any config field, e.g. --train.steps=2000 --optim.lr=6e-4
                       (values are TOML: 6e-4, true, "text", [1, 2])

exit codes: 0 done (or stopped by SIGTERM/SIGUSR1 with a checkpoint), 2 bad input,
            3 a collective failed or timed out, or the watchdog saw no progress,
            4 paused by an alert (checkpoint written; --resume continues),
            5 stopped by an alert (checkpoint written), 6 spike recovery gave up
            (recovery.max_rollbacks), 130 interrupted by Ctrl-C (a checkpoint was saved)

config keys (`tessel config --reference` prints them with descriptions):
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, exit 2, like every other input error of tessel.
        raise TesselError(f"{self.prog}: {message} (see --help)")


def _config_keys() -> str:
    from tessel.config import Config

    lines = []
    from tessel.config import _table_model

    for section, info in Config.model_fields.items():
        model = _table_model(info.annotation)
        names = ", ".join(model.model_fields)
        head = f"[[{section}]]" if model is not info.annotation else f"[{section}]"
        lines.append(f"  {head} {names}")
    return "\n".join(lines) + "\n"


def _split_train_args(argv: list[str]) -> tuple[str | None, str | None, set[str], list[str]]:
    """(config path, resume dir, flags, overrides) from `tessel train` arguments; flags are
    the set of --quiet / --auto-resume / --force given."""
    config = resume = None
    flags: set[str] = set()
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--resume", "--quiet", "--auto-resume", "--force") or arg.startswith("--resume="):
            if arg in ("--quiet", "--auto-resume", "--force"):
                flags.add(arg)
            elif "=" in arg:
                resume = arg.split("=", 1)[1]
            elif i + 1 < len(argv):
                i += 1
                resume = argv[i]
            else:
                raise TesselError("--resume needs a run directory, e.g. --resume runs/demo")
        elif arg.startswith("--") and "." in arg.split("=", 1)[0]:
            if "=" in arg:
                overrides.append(arg)
            elif i + 1 < len(argv):
                i += 1
                overrides.append(f"{arg}={argv[i]}")
            else:
                raise TesselError(f"{arg} needs a value, e.g. {arg}=VALUE")
        elif arg.startswith("-"):
            raise TesselError(
                f"unknown option {arg!r}; config fields are set as --section.key=value "
                "(see --help)"
            )
        elif config is None:
            config = arg
        else:
            raise TesselError(f"more than one config file given ({config!r}, {arg!r}); pass one")
        i += 1
    if config is not None and resume is not None:
        raise TesselError(
            "--resume reads the config saved in the run directory; drop the config file "
            "and pass overrides instead"
        )
    if resume is not None and "--auto-resume" in flags:
        raise TesselError("--auto-resume and --resume exclude each other; pass one")
    return config, resume, flags, overrides


def cmd_train(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(TRAIN_HELP + _config_keys(), end="")
        return 0
    from tessel.parallel.launch import split_nproc

    nproc, argv = split_nproc(argv)
    config_path, resume, flags, overrides = _split_train_args(argv)

    from pathlib import Path

    from tessel.config import Config

    if "--auto-resume" in flags:
        # Continue the run if its directory already holds one (a restarted job), else start
        # it. Safe with many ranks: rank 0 writes config.toml only after every rank has
        # passed the trainer's start-up barrier, i.e. after all of them decided here.
        start = Config.load(config_path, overrides)
        if (Path(start.run.dir) / "config.toml").is_file():
            resume = start.run.dir
            overrides = [o for o in overrides if not o.removeprefix("--").startswith("run.dir=")]

    if resume is not None:
        if any(o.removeprefix("--").startswith("run.dir=") for o in overrides):
            raise TesselError("--resume RUN_DIR names the run directory; drop --run.dir")
        run_config = Path(resume) / "config.toml"
        if not run_config.is_file():
            raise TesselError(
                f"cannot resume {resume!r}: it is not a tessel run directory (no config.toml)"
            )
        # The run directory is where the run is now (it may have been moved).
        cfg = Config.load(run_config, [*overrides, f"--run.dir={_toml_str(resume)}"])
    else:
        cfg = Config.load(config_path, overrides)
    if nproc is not None and nproc > 1:
        # The config and layout are checked here, so bad input fails once rather than in N
        # workers.
        from tessel.parallel.dims import ParallelDims
        from tessel.parallel.launch import run_local

        ParallelDims.from_config(cfg.parallel, nproc).validate(cfg)
        return run_local(nproc, argv)

    from tessel.train import Trainer

    trainer = None
    try:
        trainer = Trainer(cfg, resume=resume is not None, console="--quiet" not in flags,
                          force="--force" in flags, auto_resume="--auto-resume" in flags)
        return trainer.train().exit_code
    finally:
        if trainer is not None:
            trainer.close()


def _toml_str(text: str) -> str:
    import json

    return json.dumps(text)  # a JSON string is a valid TOML basic string


def cmd_generate(argv: list[str]) -> int:
    p = _Parser(prog="tessel generate", description="Sample text from a trained run.")
    p.add_argument("run_dir", help="run directory (its latest checkpoint) or a checkpoint dir")
    p.add_argument("--prompt", default="", help="text to continue (default: empty)")
    p.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy decoding")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k most likely (0: all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto (CUDA when present), cpu or cuda")
    args = p.parse_args(argv)
    if args.max_new_tokens <= 0:
        raise TesselError("--max-new-tokens must be positive")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise TesselError("--temperature must be >= 0 (0 is greedy decoding)")
    if args.top_k < 0:
        raise TesselError("--top-k must be >= 0 (0 disables top-k)")

    from tessel.generate import load_run_for_inference, sample
    from tessel.train.trainer import pick_device

    model, tok = load_run_for_inference(args.run_dir, pick_device(args.device))
    ids = sample(model, tok.encode(args.prompt), args.max_new_tokens, args.temperature,
                 args.top_k or None, args.seed, stop_id=tok.eod_id)
    print(args.prompt + tok.decode(ids))
    return 0


def cmd_presets(argv: list[str]) -> int:
    p = _Parser(prog="tessel presets", description="List the named model shapes.")
    p.parse_args(argv)
    from tessel.config import ModelConfig
    from tessel.models import PRESETS, flops_per_token, param_count

    head = f"{'preset':<12} {'params':>17} {'layers':>6} {'d_model':>7} {'heads':>5} " \
           f"{'kv':>3} {'ffn':>6} {'vocab':>6} {'ctx':>5}  {'style':<26} {'GFLOP/token':>11}"
    print(head)
    for name in PRESETS:
        m = ModelConfig(preset=name)
        style = "/".join([m.position, m.norm, m.mlp, "tied" if m.tie_embeddings else "untied"])
        gflop = flops_per_token(m, m.max_seq_len) / 1e9
        print(f"{name:<12} {param_count(m):>17,} {m.n_layers:>6} {m.d_model:>7} {m.n_heads:>5} "
              f"{m.n_kv_heads:>3} {m.ffn_hidden:>6} {m.vocab_size:>6} {m.max_seq_len:>5}  "
              f"{style:<26} {gflop:>11.3g}")
    print("GFLOP/token: training FLOPs per token at the preset's full context "
          "(6 x matmul params + 12 x layers x d_model x seq_len)")
    return 0


def cmd_config(argv: list[str]) -> int:
    from tessel.config import Config, reference_markdown

    if "-h" in argv or "--help" in argv:
        print("usage: tessel config [CONFIG.toml] [--section.key=value ...] | --reference\n\n"
              "Print the resolved config as TOML, or with --reference every key as Markdown.")
        return 0
    if argv == ["--reference"]:
        print(reference_markdown(), end="")
        return 0
    config_path, resume, _, overrides = _split_train_args(argv)
    if resume is not None:
        raise TesselError("tessel config takes no --resume; pass RUN_DIR/config.toml instead")
    print(Config.load(config_path, overrides).to_toml(), end="")
    return 0


def cmd_launch(argv: list[str]) -> int:
    """`tessel launch slurm|k8s CONFIG.toml ...`: print a job file that trains CONFIG."""
    about = ("Print a job file that trains CONFIG.toml (with any --section.key=value overrides, "
             "checked now) with torchrun on every node; it resumes the run when its run "
             "directory already holds one.")
    p = _Parser(prog="tessel launch",
                description="Print a job file that trains CONFIG.toml on a cluster; submit it yourself.")
    targets = p.add_subparsers(dest="target", required=True, metavar="{slurm,k8s}")
    slurm = targets.add_parser(
        "slurm", help="an sbatch script (one torchrun per node)", description=about,
        usage="tessel launch slurm CONFIG.toml --nodes N [--gpus-per-node G] [--partition P] "
              "[--time HH:MM:SS] [--job-name NAME] [--account A] [--port PORT] "
              "[--section.key=value ...]")
    k8s = targets.add_parser(
        "k8s", help="a Kubeflow PyTorchJob manifest (kubeflow.org/v1)", description=about,
        usage="tessel launch k8s CONFIG.toml --nodes N --image IMAGE [--gpus-per-node G] "
              "[--name NAME] [--namespace NS] [--section.key=value ...]")
    for target in (slurm, k8s):
        target.add_argument("--nodes", type=int, required=True, metavar="N",
                            help="machines (pods) to train on")
        target.add_argument("--gpus-per-node", type=int, default=8, metavar="G",
                            help="processes (GPUs) per machine (default: 8)")
    slurm.add_argument("--partition", metavar="P", help="SLURM partition")
    slurm.add_argument("--time", metavar="HH:MM:SS", help="time limit (or D-HH:MM:SS)")
    slurm.add_argument("--job-name", metavar="NAME", help="default: tessel-<config file name>")
    slurm.add_argument("--account", metavar="A", help="account to charge")
    slurm.add_argument("--port", type=int, default=29500,
                       help="rendezvous port on the first node (default: 29500)")
    k8s.add_argument("--image", required=True, help="container image with tessel installed")
    k8s.add_argument("--name", help="job name, a DNS-1123 label (default: tessel-<config file name>)")
    k8s.add_argument("--namespace", metavar="NS", help="default: kubectl's current namespace")
    args, rest = p.parse_known_args(argv)

    # Whatever argparse did not know must be the config path or --section.key overrides.
    prog = f"tessel launch {args.target}"
    i = 0
    while i < len(rest):
        arg = rest[i]
        if arg.startswith("--") and "." in arg.split("=", 1)[0]:
            i += 1 if "=" in arg else 2  # `--a.b=v`, or `--a.b v`
            continue
        if arg.startswith("-"):
            raise TesselError(f"{prog}: unknown option {arg!r}; config fields are set as "
                              "--section.key=value (see --help)")
        i += 1
    config_path, _, _, overrides = _split_train_args(rest)
    if config_path is None:
        raise TesselError(f"{prog} needs a config file, e.g. {prog} configs/gpt2-124m.toml --nodes 2")

    from tessel.config import Config
    from tessel.parallel import launch

    cfg = Config.load(config_path, overrides)  # what `tessel train` would load: fail now
    if args.target == "slurm":
        text = launch.slurm_script(
            config_path, overrides, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
            partition=args.partition, time=args.time, job_name=args.job_name,
            account=args.account, port=args.port)
    else:
        text = launch.k8s_manifest(
            config_path, overrides, nodes=args.nodes, image=args.image,
            gpus_per_node=args.gpus_per_node, name=args.name, namespace=args.namespace)
    from tessel.parallel.dims import ParallelDims

    # ... and the layout against the job's world size (after the builders checked the counts).
    ParallelDims.from_config(cfg.parallel, args.nodes * args.gpus_per_node).validate(cfg)
    print(text, end="")
    return 0


def cmd_checkpoint(argv: list[str]) -> int:
    p = _Parser(prog="tessel checkpoint", description="Work with checkpoints.")
    sub = p.add_subparsers(dest="action", required=True, metavar="{consolidate}")
    c = sub.add_parser(
        "consolidate", help="write the full model of a (sharded) checkpoint as one safetensors file",
        description="Gather the model tensors of a checkpoint saved under any parallel layout "
                    "into one safetensors file.")
    c.add_argument("path", help="a checkpoint directory, or a run directory (its latest checkpoint)")
    c.add_argument("--output", help="file to write (default: RUN_DIR/model.safetensors)")
    args = p.parse_args(argv)

    from pathlib import Path

    from tessel.checkpoint.consolidate import consolidate, resolve_checkpoint

    ckpt = resolve_checkpoint(Path(args.path))
    output = Path(args.output) if args.output else ckpt.parent.parent / "model.safetensors"
    n, size = consolidate(ckpt, output)
    print(f"wrote {output}: {n} tensors, {size / 2**20:.1f} MiB, from {ckpt}")
    return 0


def cmd_convert(argv: list[str]) -> int:
    p = _Parser(prog="tessel convert", description="Convert models between tessel and the "
                "Hugging Face format (GPT2LMHeadModel, LlamaForCausalLM).")
    sub = p.add_subparsers(dest="direction", required=True, metavar="{hf-to-tessel,tessel-to-hf}")
    a = sub.add_parser(
        "hf-to-tessel", help="an HF model directory -> tessel weights, config and tokenizer",
        description="Convert a Hugging Face model directory (config.json, safetensors, "
                    "tokenizer.json) into OUT_DIR: model.safetensors in tessel's names, a "
                    "config.toml that fine-tunes from it (model.init_from), tokenizer.json.")
    a.add_argument("source", metavar="HF_DIR")
    a.add_argument("output", metavar="OUT_DIR")
    b = sub.add_parser(
        "tessel-to-hf", help="a run, checkpoint (any layout) or safetensors file -> HF directory",
        description="Write a Hugging Face model directory that transformers loads "
                    "(AutoModelForCausalLM, AutoTokenizer), reading the checkpoint tensor by "
                    "tensor whatever parallel layout saved it.")
    b.add_argument("source", metavar="RUN_DIR|CHECKPOINT|FILE")
    b.add_argument("output", metavar="HF_DIR")
    b.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="weights' dtype in the export (default float32, as trained)")
    b.add_argument("--max-shard-size", default="5GB",
                   help="split the weights into files of at most this size (default 5GB)")
    args = p.parse_args(argv)

    from pathlib import Path

    import torch

    from tessel.checkpoint.hf_convert import hf_to_tessel, parse_size, tessel_to_hf

    if args.direction == "hf-to-tessel":
        print(hf_to_tessel(Path(args.source), Path(args.output)))
    else:
        dtype = torch.bfloat16 if args.dtype == "bfloat16" else None
        print(tessel_to_hf(Path(args.source), Path(args.output), dtype,
                           parse_size(args.max_shard_size)))
    return 0


BENCH_HELP = """\
usage: tessel bench [CONFIG.toml] [--precision P] [--compile] [--fp8] [--warmup N] [--steps N]
                    [--json OUT.json] [--no-matmul] [--section.key=value ...]

Time the real trainer step on one device (synthetic tokens; warm-up excluded) and print
tokens/s, step time (median and spread), TFLOP/s, MFU against the device's dense BF16 peak
and against a large matrix multiply measured on the same device, peak memory, and the
planner's memory prediction. Writes the figures as JSON (--json, default bench.json); that
file also calibrates the planner: `tessel plan --calibrate bench.json`.

options:
  --precision P     fp32 | bf16 | fp16 | auto (train.precision)
  --compile         compile each block (train.compile = true)
  --fp8             float8 linears through torchao (train.fp8 = true; FP8 GPUs only)
  --warmup N        untimed steps first (default 5)
  --steps N         timed steps (default 20)
  --json OUT.json   where to write the figures (default bench.json)
  --no-matmul       skip the matrix-multiply peak measurement
"""


def cmd_bench(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(BENCH_HELP, end="")
        return 0
    from pathlib import Path

    from tessel.bench import report, run_bench, write_json
    from tessel.config import Config

    opts: dict[str, object] = {"warmup": 5, "steps": 20, "json": "bench.json", "matmul": True}
    bench_overrides = {"--compile": "--train.compile=true", "--fp8": "--train.fp8=true"}
    rest: list[str] = []
    it = iter(argv)
    for arg in it:  # bench's own options; the config and overrides are parsed as for train
        key, eq, value = arg.partition("=")
        if key in ("--precision", "--warmup", "--steps", "--json"):
            value = value if eq else next(it, "")
            if not value:
                raise TesselError(f"{key} needs a value (see tessel bench --help)")
            if key == "--precision":
                rest.append(f"--train.precision={_toml_str(value)}")
            elif key == "--json":
                opts["json"] = value
            elif not value.isdigit():
                raise TesselError(f"{key} takes a whole number, not {value!r}")
            else:
                opts[key[2:]] = int(value)
        elif arg in bench_overrides:
            rest.append(bench_overrides[arg])
        elif arg == "--no-matmul":
            opts["matmul"] = False
        else:
            rest.append(arg)
    config, resume, flags, overrides = _split_train_args(rest)
    if resume is not None or flags:
        raise TesselError("tessel bench takes no --resume, --quiet, --auto-resume or --force "
                          "(see tessel bench --help)")
    cfg = Config.load(config, overrides)
    result = run_bench(cfg, warmup=int(opts["warmup"]), steps=int(opts["steps"]),
                       matmul=bool(opts["matmul"]))
    print(report(result))
    write_json(result, Path(str(opts["json"])))
    print(f"wrote {opts['json']}")
    return 0


def cmd_report(argv: list[str]) -> int:
    p = _Parser(prog="tessel report", description=(
        "Write RUN_DIR/report.html: one self-contained HTML page (inline SVG, no network "
        "needed) with the run's summary figures; plots of loss, learning rate, grad norm, "
        "throughput, MFU, memory and step time; its events; its config (secrets redacted) "
        "and run.json."))
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory of `tessel train`")
    p.add_argument("--out", metavar="PATH", help="file to write (default: RUN_DIR/report.html)")
    args = p.parse_args(argv)

    from pathlib import Path

    from tessel.observe.report import write_report

    out = write_report(Path(args.run_dir), Path(args.out) if args.out else None)
    print(f"wrote {out} (open it in a browser; it needs no network)")
    return 0


COMMANDS = {
    "train": cmd_train,
    "launch": cmd_launch,
    "checkpoint": cmd_checkpoint,
    "convert": cmd_convert,
    "plan": lambda argv: __import__("tessel.planner.command").planner.command.cmd_plan(argv),
    "generate": cmd_generate,
    "report": cmd_report,
    "bench": cmd_bench,
    "presets": cmd_presets,
    "config": cmd_config,
    # tessel.data.commands imports this module (for _Parser), so it is imported on use.
    "tokenizer": lambda argv: __import__("tessel.data.commands").data.commands.cmd_tokenizer(argv),
    "preprocess": lambda argv: __import__("tessel.data.commands").data.commands.cmd_preprocess(argv),
    "data": lambda argv: __import__("tessel.data.commands").data.commands.cmd_data(argv),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv[0] in ("-V", "--version"):
        from tessel import __version__

        print(f"tessel {__version__}")
        return 0
    command = COMMANDS.get(argv[0])
    try:
        if command is None:
            raise TesselError(
                f"unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)} (see tessel --help)"
            )
        return command(argv[1:])
    except TesselError as exc:
        # Under torchrun every rank hits the same error: one of them says it; a collective
        # failure (exit 3) is each rank's own.
        if os.environ.get("RANK", "0") == "0" or exc.exit_code == 3:
            print(f"tessel: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # unwritable run dir, disk full: say which file, no traceback
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"tessel: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tessel: interrupted", file=sys.stderr)
        return 130


def run() -> NoReturn:
    """The `tessel` command and `python -m tessel` (what torchrun starts): main(), then an
    exit that is safe for a process holding a process group (see `exit_process`)."""
    import faulthandler

    from tessel.parallel.dist import exit_process

    # A native crash (a collective library aborting) still shows each thread's Python stack.
    faulthandler.enable(all_threads=True)
    try:
        code = main()
    except SystemExit as exc:  # argparse's --help and usage errors
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    except BaseException:
        import traceback

        traceback.print_exc()  # a bug: keep the traceback, then leave as cleanly as any run
        code = 1
    exit_process(code)


if __name__ == "__main__":
    run()
