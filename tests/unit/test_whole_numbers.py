"""Whole numbers typed by users or set in the environment: ASCII digits only. str.isdigit()
also takes '²' (which int() refuses: a traceback) and '٣' (which int() reads as 3)."""

from __future__ import annotations

import pytest

from tessel.cli import main
from tessel.numbers import whole_number
from tessel.scaling import allocation
from tessel.scaling.allocation import Allocation
from tessel.train.control import STOPPED_EXIT_ENV, exit_code_for


def test_only_ascii_digits_are_a_whole_number():
    assert [whole_number(t) for t in ("0", "7", "0042", "65535")] == [0, 7, 42, 65535]
    for text in ("²", "٣", "１", "", "-1", "+1", " 1", "1_000", "1.0", "x"):
        assert whole_number(text) is None, text


@pytest.mark.parametrize("argv, needle", [
    (["bench", "--warmup", "²"], "--warmup takes a whole number, not '²'"),
    (["bench", "--steps", "²"], "--steps takes a whole number, not '²'"),
    (["scale", "--gpus", "8,²"], "'²' is not a GPU count"),
    (["scale", "--measure", "--nproc", "1", "--warmup", "²"],
     "--warmup takes a whole number >= 0, not '²'"),
    (["scale", "--measure", "--nproc", "²"], "'²' is not a process count"),
])
def test_a_unicode_digit_in_a_flag_is_one_line(capsys, argv: list[str], needle: str):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("tessel: error: "), err
    assert needle in err


def test_a_unicode_digit_in_the_environment_or_a_job_id_is_no_number(monkeypatch):
    monkeypatch.setenv(STOPPED_EXIT_ENV, "²")
    assert exit_code_for("SIGTERM") == 0
    monkeypatch.setenv(STOPPED_EXIT_ENV, "٣")
    assert exit_code_for("SIGTERM") == 0
    cmd = allocation.command_for(Allocation("²", ("n0",)))(2, ["c.toml"])
    assert cmd[cmd.index("--master-port") + 1] == str(29500 + 2)
