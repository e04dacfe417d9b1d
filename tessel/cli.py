"""The `tessel` command.

    tessel train [CONFIG.toml] [--section.key=value ...]   train (no arguments: the demo)
    tessel train --resume RUN_DIR [--section.key=value ...]
    tessel generate RUN_DIR --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K]
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
  --section.key=value  set any config field, e.g. --train.steps=2000 --optim.lr=6e-4
                       (values are TOML: 6e-4, true, "text", [1, 2])

exit codes: 0 done (or stopped by SIGTERM with a checkpoint), 2 bad input,
            130 interrupted by Ctrl-C (a checkpoint was saved)

config keys (`tessel config --reference` prints them with descriptions):
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, exit 2, like every other input error of tessel.
        raise TesselError(f"{self.prog}: {message} (see --help)")


def _config_keys() -> str:
    from tessel.config import Config

    lines = []
    for section, info in Config.model_fields.items():
        names = ", ".join(info.annotation.model_fields)  # type: ignore[union-attr]
        lines.append(f"  [{section}] {names}")
    return "\n".join(lines) + "\n"


def _split_train_args(argv: list[str]) -> tuple[str | None, str | None, bool, list[str]]:
    """(config path, resume dir, quiet, overrides) from `tessel train` arguments."""
    config = resume = None
    quiet = False
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--resume", "--quiet") or arg.startswith("--resume="):
            if arg == "--quiet":
                quiet = True
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
                "(see tessel train --help)"
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
    return config, resume, quiet, overrides


def cmd_train(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(TRAIN_HELP + _config_keys(), end="")
        return 0
    config_path, resume, quiet, overrides = _split_train_args(argv)

    from pathlib import Path

    from tessel.config import Config
    from tessel.train import Trainer

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
    result = Trainer(cfg, resume=resume is not None, console=not quiet).train()
    return result.exit_code


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


COMMANDS = {
    "train": cmd_train,
    "generate": cmd_generate,
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
        print(f"tessel: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # unwritable run dir, disk full: say which file, no traceback
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"tessel: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tessel: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
