"""The `tessel` command: the command table, `main` and the console-script entry point `run`.

Each command group lives in its own module (train, generate, info, launch, checkpoint,
convert, plan, scale, bench, report, data), builds an argparse parser (`tessel.cli.args.Parser`,
whose usage errors are one line) and returns an exit code. Modules outside tessel.cli do not
import it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import NoReturn

from tessel.cli import bench, checkpoint, convert, data, generate, info, launch, plan, report, scale, train
from tessel.errors import Stopped, TesselError

HELP = """\
usage: tessel COMMAND [ARGS ...]       (tessel COMMAND --help for each one's options)

  tessel train [CONFIG.toml] [--section.key=value ...]   train (no arguments: the demo)
  tessel train --resume RUN_DIR [--section.key=value ...]
  tessel train ... --nproc N                              N processes on this machine (torchrun)
  tessel launch slurm CONFIG.toml --nodes N [--gpus-per-node G] [...]   print an sbatch script
  tessel launch k8s CONFIG.toml --nodes N --image IMAGE [...]           print a Kubeflow PyTorchJob
  tessel checkpoint consolidate RUN_DIR|CHECKPOINT [--output FILE]   one-file model
  tessel plan [CONFIG.toml] --gpus N [--gpu NAME] [--json]   predict memory/speed, pick a layout
  tessel scale [CONFIG.toml] --gpus N,N,... [--weak] [--json] [--html FILE]   predicted scaling
  tessel convert hf-to-tessel HF_DIR OUT_DIR              import Hugging Face weights
  tessel convert tessel-to-hf RUN_DIR|CHECKPOINT HF_DIR   export for transformers/vLLM
  tessel generate RUN_DIR --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K]
  tessel bench [CONFIG.toml] [--precision P] [--compile] [--fp8] [--json OUT]   time a step, MFU
  tessel report RUN_DIR [--out PATH]                      one self-contained HTML page of a run
  tessel presets                                          model shapes and parameter counts
  tessel config [CONFIG.toml] [--section.key=value ...]   print the resolved config
  tessel config --reference                               every config key, as Markdown
  tessel tokenizer train --input PATH [PATH ...] --vocab-size N --output TOKENIZER.json
  tessel preprocess --input PATH [PATH ...] [--tokenizer SPEC] --output PREFIX [--workers N]
  tessel data inspect PREFIX [--verify]                   sizes, tokenizer, a decoded sample
  tessel --version

Bad input prints one line to stderr and exits with code 2.
"""

# name -> the function that runs `tessel NAME ARGV` and returns its exit code.
COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "train": train.cmd_train,
    "launch": launch.cmd_launch,
    "checkpoint": checkpoint.cmd_checkpoint,
    "convert": convert.cmd_convert,
    "plan": plan.cmd_plan,
    "scale": scale.cmd_scale,
    "generate": generate.cmd_generate,
    "report": report.cmd_report,
    "bench": bench.cmd_bench,
    "presets": info.cmd_presets,
    "config": info.cmd_config,
    "tokenizer": data.cmd_tokenizer,
    "preprocess": data.cmd_preprocess,
    "data": data.cmd_data,
}


def main(argv: list[str] | None = None) -> int:
    """Run `tessel ARGV` and return the exit code. Bad input is one line on stderr (exit 2);
    `--help` of a command leaves through argparse's SystemExit(0)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(HELP, end="")
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
    except BrokenPipeError:
        # `tessel data inspect ... | head`: the reader has what it wanted; no message, and
        # stdout pointed at /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:  # unwritable run dir, disk full: say which file, no traceback
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"tessel: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tessel: interrupted", file=sys.stderr)
        return 130
    except Stopped as exc:  # SIGTERM while preparing the data: nothing to save yet
        print(f"tessel: {exc}", file=sys.stderr)
        return exc.exit_code


def run() -> NoReturn:
    """The `tessel` command and `python -m tessel` (what torchrun starts): main(), then an
    exit that is safe for a process holding a process group and skips the interpreter's
    teardown of the modules (see `exit_process`)."""
    import faulthandler

    # A native crash (a collective library aborting) still shows each thread's Python stack.
    faulthandler.enable(all_threads=True)
    code = exit_code()
    if "torch.distributed" not in sys.modules:
        # No process group can exist: a plain exit, without importing torch (1.5-2 s of CPU)
        # for the commands that never needed it (plan, launch, data inspect, --help).
        sys.exit(code)
    from tessel.parallel.dist import exit_process

    exit_process(code)


def exit_code(argv: list[str] | None = None) -> int:
    """main(argv) as the `tessel` command runs it, short of leaving the process: argparse's
    SystemExit becomes its exit code, anything unexpected a traceback on stderr and 1."""
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's --help and usage errors
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    except BaseException:
        import traceback

        traceback.print_exc()  # a bug: keep the traceback, then leave as cleanly as any run
        return 1
