"""The `tessel` command line, parsing only: every command's help, one-line usage errors, and
the config overrides that train, bench, plan, config and launch take. Nothing here trains."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tessel.cli import COMMANDS, HELP, main
from tessel.cli.args import split_overrides
from tessel.cli.train import config_keys

# Every command (and sub-command) as its help is asked for.
HELP_ARGV = [
    ["train"], ["launch"], ["launch", "slurm"], ["launch", "k8s"], ["checkpoint"],
    ["checkpoint", "consolidate"], ["convert"], ["convert", "hf-to-tessel"],
    ["convert", "tessel-to-hf"], ["plan"], ["scale"], ["generate"], ["report"], ["bench"], ["presets"],
    ["config"], ["tokenizer"], ["tokenizer", "train"], ["preprocess"], ["data"], ["data", "inspect"],
]

# Arguments each command accepts, so that an unknown flag added to them is the only error.
VALID_ARGV = {
    "train": [],
    "launch": ["slurm", "c.toml", "--nodes", "1"],
    "checkpoint": ["consolidate", "run"],
    "convert": ["hf-to-tessel", "hf", "out"],
    "plan": ["--gpus", "1"],
    "scale": ["--gpus", "1"],
    "generate": ["run"],
    "report": ["run"],
    "bench": [],
    "presets": [],
    "config": [],
    "tokenizer": ["train", "--input", "x", "--vocab-size", "300", "--output", "t.json"],
    "preprocess": ["--input", "x", "--output", "d"],
    "data": ["inspect", "d"],
}


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, err
    assert out == "" and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tessel: error: "), err
    return lines[0]


def test_the_table_and_the_top_level_help_name_the_same_commands(capsys):
    assert set(VALID_ARGV) == set(COMMANDS)
    assert {argv[0] for argv in HELP_ARGV} == set(COMMANDS)
    assert main(["--help"]) == 0 and capsys.readouterr().out == HELP
    for name in COMMANDS:
        assert f"tessel {name}" in HELP


@pytest.mark.parametrize("argv", HELP_ARGV, ids=" ".join)
def test_every_command_help_exits_0_with_its_usage(capsys, argv: list[str]):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"usage: tessel {' '.join(argv)} ") and err == ""


def test_train_help_lists_its_options_and_ends_with_the_config_keys(capsys):
    with pytest.raises(SystemExit):
        main(["train", "-h"])
    out = capsys.readouterr().out
    for text in ("[CONFIG.toml] [--section.key=value ...]", "--resume RUN_DIR", "--auto-resume",
                 "--force", "--quiet", "--nproc N", "exit codes:", "[[alerts]] name"):
        assert text in out
    assert out.endswith(config_keys()) and "[optim] name, state_dtype," in config_keys()
    assert " lr, " in next(line for line in out.splitlines() if "[optim]" in line)


@pytest.mark.parametrize("name", sorted(VALID_ARGV))
def test_an_unknown_flag_to_any_command_is_one_line_naming_it(capsys, name: str):
    line = one_line_error(capsys, [name, *VALID_ARGV[name], "--frobnicate"])
    assert "'--frobnicate'" in line or "unrecognized arguments: --frobnicate" in line


@pytest.mark.parametrize("args, needle", [
    (["cfg.toml", "extra"], "more than one config file given ('cfg.toml', 'extra')"),
    (["cfg.toml", "--train.steps=2", "extra.toml"], "more than one config file given"),
    (["-x"], "unknown option '-x'"),
    (["--bogus=1"], "unknown option '--bogus=1'"),
    (["--res", "runs/x"], "unknown option '--res'"),  # no abbreviations of train's flags
    (["--train.steps"], "--train.steps needs a value"),
    (["cfg.toml", "--resume", "runs/x"], "drop the config file"),
    (["--resume"], "--resume: expected one argument"),
])
def test_train_refuses_what_is_not_its_flag_a_config_or_an_override(capsys, args, needle):
    assert needle in one_line_error(capsys, ["train", *args])


@pytest.mark.parametrize("command, flag, needle", [
    ("bench", "--quiet", "tessel bench takes no --resume"),
    ("plan", "--resume", "not train's flags"),
    ("scale", "--resume", "not train's flags"),
    ("config", "--resume", "tessel config takes no --resume"),
    ("launch", "--force", "unknown option '--force'"),
])
def test_train_flags_given_to_other_config_commands_are_refused(capsys, command, flag, needle):
    argv = [command, *VALID_ARGV[command], flag, "runs/x"]
    assert needle in one_line_error(capsys, argv)


def test_bench_counts_are_whole_numbers(capsys):
    assert "--warmup takes a whole number, not 'x'" in one_line_error(capsys, ["bench", "--warmup=x"])
    assert "--steps takes a whole number" in one_line_error(capsys, ["bench", "--steps", "1.5"])
    # --fp8-recipe takes train.fp8's recipes only (--fp8 alone is tensorwise, as the GPU kit runs)
    assert "argument --fp8-recipe: invalid choice: 'fp4'" in one_line_error(
        capsys, ["bench", "--fp8-recipe", "fp4"])


def test_config_reference_takes_nothing_else(capsys):
    assert "takes no config file" in one_line_error(capsys, ["config", "--reference", "--train.steps=2"])


def test_overrides_are_taken_out_in_order_whatever_their_form():
    argv = ["cfg.toml", "--train.steps", "-1", "--quiet", "--run.dir=runs/a b",
            '--data.paths=["my corpus"]', "--resume", "r"]
    assert split_overrides(argv) == (
        ["cfg.toml", "--quiet", "--resume", "r"],
        ["--train.steps=-1", "--run.dir=runs/a b", '--data.paths=["my corpus"]'],
    )


@pytest.mark.parametrize("argv", HELP_ARGV, ids=" ".join)
def test_help_leaves_the_process_without_importing_torch(argv: list[str]):
    """`tessel run()` (the installed command) ends a process that never started a process
    group with a plain exit: asking for help costs no torch import (1.5-2 s of CPU)."""
    code = ("import atexit, sys\n"
            "atexit.register(lambda: print('torch imported:', 'torch' in sys.modules))\n"
            f"sys.argv = ['tessel', *{argv!r}, '--help']\n"
            "from tessel.cli import run\n"
            "run()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].startswith("usage: tessel")
    assert proc.stdout.splitlines()[-1] == "torch imported: False"
