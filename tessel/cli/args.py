"""What every `tessel` command parses with: the argparse parser whose errors are one line
(exit 2), and the free `--section.key=value` config overrides that train, bench, plan, config
and launch take next to their own flags.

Overrides cannot be argparse options (any dotted key is allowed), so they are taken out of
the arguments first (`split_overrides`), then argparse parses the rest with the command's
own parser, and whatever it did not know is refused in one line naming it
(`parse_config_args`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from tessel.errors import TesselError

OVERRIDES_METAVAR = "--section.key=value"
OVERRIDES_HELP = ("set any config field, e.g. --train.steps=2000 --optim.lr=6e-4 (values are "
                  'TOML: 6e-4, true, "text", [1, 2]); overrides win over the config file')
CONFIG_HELP = "a TOML recipe (see configs/); the overrides win over it"


class Parser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are a `TesselError`: one line on stderr naming
    the command, exit code 2, like every other input error of tessel. Descriptions and
    epilogs keep their line breaks."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise TesselError(f"{self.prog}: {message} (see --help)")


def add_config_arguments(parser: argparse.ArgumentParser, config_help: str = CONFIG_HELP) -> None:
    """The optional CONFIG.toml positional and, for the help, the overrides. The overrides are
    taken out before argparse parses (see `split_overrides`), so the `overrides` positional
    only ever collects a second config path, which `parse_config_args` refuses."""
    parser.add_argument("config", nargs="?", metavar="CONFIG.toml", help=config_help)
    parser.add_argument("overrides", nargs="*", metavar=OVERRIDES_METAVAR, help=OVERRIDES_HELP)


def is_override(arg: str) -> bool:
    """Whether `arg` is a config override: `--section.key=value` or `--section.key`."""
    return arg.startswith("--") and "." in arg.split("=", 1)[0]


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the other arguments, the config overrides as `--section.key=value`); an override may
    also be given as `--section.key value`."""
    rest: list[str] = []
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not is_override(arg):
            rest.append(arg)
        elif "=" in arg:
            overrides.append(arg)
        elif i + 1 < len(argv):
            i += 1
            overrides.append(f"{arg}={argv[i]}")
        else:
            raise TesselError(f"{arg} needs a value, e.g. {arg}=VALUE")
        i += 1
    return rest, overrides


def parse_config_args(parser: argparse.ArgumentParser, argv: Sequence[str],
                      refused: dict[str, str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """(the parsed arguments, the overrides) of a command that takes a config and overrides:
    everything that is neither the command's own option, the config path nor an override
    is refused in one line naming it. `refused` maps options to a more helpful message
    (e.g. train's --resume given to `tessel plan`)."""
    rest, overrides = split_overrides(argv)
    args, unknown = parser.parse_known_args(rest)
    for arg in unknown:
        name = arg.split("=", 1)[0]
        if refused and name in refused:
            raise TesselError(refused[name])
        if arg.startswith("-"):
            raise TesselError(f"{parser.prog}: unknown option {arg!r}; config fields are set as "
                              f"{OVERRIDES_METAVAR} (see --help)")
    extra = [*getattr(args, "overrides", []), *unknown]
    if extra:
        raise TesselError(f"{parser.prog}: more than one config file given "
                          f"({args.config!r}, {extra[0]!r}); pass one")
    return args, overrides


def toml_str(text: str) -> str:
    """`text` as a TOML basic string, for an override value (a JSON string is one)."""
    return json.dumps(text)



def output_file(flag: str, text: str) -> Path:
    """FLAG's output file, checked before any work (a page or profile written after minutes
    of runs must not fail then): not a directory, and in an existing directory where this
    process can create a file (one is made and removed there)."""
    path = Path(text)
    if path.is_dir():
        raise TesselError(f"{flag} {text!r} is a directory; pass a file name in it, e.g. "
                          f"{path / ('out' + (path.suffix or '.txt'))}")
    if not path.parent.is_dir():
        raise TesselError(f"{flag} {text!r}: no directory {str(path.parent)!r} to write it in; "
                          "create it or pass another path")
    try:
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".check"):
            pass
    except OSError as exc:
        raise TesselError(f"{flag} {text!r}: cannot write in {str(path.parent)!r} "
                          f"({exc.strerror or exc}); pass a path in a directory you can write"
                          ) from None
    return path
