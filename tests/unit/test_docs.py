import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _code_lines(text: str) -> list[str]:
    return [line.strip() for block in re.findall(r"```\n(.*?)```", text, re.S)
            for line in block.splitlines()]


def test_ci_runs_the_readme_test_command():
    lines = _code_lines((ROOT / "README.md").read_text())
    test_cmd = next(line for line in lines if line.endswith("pytest"))
    assert test_cmd in (ROOT / ".ci/run").read_text().splitlines()


def test_readme_demo_command_trains():
    lines = _code_lines((ROOT / "README.md").read_text())
    assert any(line.startswith("python3 -m venv") and line.endswith("tessel train") for line in lines)


def test_readme_mentions_every_command():
    from tessel.cli import COMMANDS

    text = (ROOT / "README.md").read_text()
    for name in COMMANDS:
        assert f"tessel {name}" in text
