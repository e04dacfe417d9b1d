"""The README (the front door) and docs/ (one page per topic) against the code: the set-up
commands are CI's, every command is listed, the commands, flags, config keys, file paths and
links the pages name exist, and docs/config-reference.md is the generated reference."""

from __future__ import annotations

import contextlib
import functools
import io
import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md")), *sorted((ROOT / "benchmarks").glob("**/*.md"))]
REFERENCE = DOCS / "config-reference.md"

DEMO_COMMAND = (
    "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e . && .venv/bin/tessel train"
)
TEST_COMMAND = (
    "python3 -m venv .venv && .venv/bin/pip install --no-compile torch==2.13.0 -e '.[dev]'"
    " && .venv/bin/pytest"
)


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _code_blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced block."""
    return re.findall(r"^```([^\n`]*)\n(.*?)^```", text, re.S | re.M)


def _code_lines(text: str) -> list[str]:
    """Lines of the fenced blocks, stripped, with `\\` continuations joined."""
    out = []
    for _, body in _code_blocks(text):
        joined = re.sub(r"\\\n\s*", " ", body)
        out += [line.strip() for line in joined.splitlines()]
    return out


def _prose(text: str) -> str:
    """The text outside fenced blocks."""
    return re.sub(r"^```[^\n`]*\n.*?^```", "", text, flags=re.S | re.M)


def _inline_code(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", _prose(text))


# ---- the README's set-up commands ------------------------------------------------------------


def test_ci_runs_the_readme_test_command():
    lines = _code_lines(README.read_text())
    test_cmd = next(line for line in lines if line.endswith("pytest"))
    assert test_cmd == TEST_COMMAND
    assert test_cmd in (ROOT / ".ci/run").read_text().splitlines()


def test_readme_demo_command_trains():
    lines = _code_lines(README.read_text())
    assert DEMO_COMMAND in lines
    assert any(line.startswith("python3 -m venv") and line.endswith("tessel train") for line in lines)


def test_readme_mentions_every_command():
    from tessel.cli import COMMANDS

    text = README.read_text()
    for name in COMMANDS:
        assert f"tessel {name}" in text


def test_readme_is_the_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) < 260, f"README.md has {len(lines)} lines; move detail to docs/"
    text = README.read_text()
    for page in sorted(DOCS.glob("*.md")):
        assert f"(docs/{page.name})" in text, f"the README's feature map does not link {page.name}"


# ---- the generated reference -----------------------------------------------------------------


def test_config_reference_page_is_current():
    from tessel.config import reference_markdown

    assert REFERENCE.read_text() == reference_markdown(), (
        "docs/config-reference.md is stale: regenerate it with "
        "`tessel config --reference > docs/config-reference.md`"
    )


# ---- commands and flags ----------------------------------------------------------------------


@functools.cache
def _help(*argv: str) -> str:
    from tessel.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = main([*argv, "--help"])
        except SystemExit as exc:
            code = exc.code
    assert code == 0, f"`tessel {' '.join(argv)} --help` failed"
    return out.getvalue()


def _tessel_commands(page: Path) -> list[str]:
    """Every `tessel ...` invocation a page shows: command lines in code blocks (comments
    dropped; pipelines and `&&` chains split; `-m tessel` of torchrun lines) and inline code
    that starts with `tessel `."""
    text = page.read_text()
    found = []
    for line in _code_lines(text):
        line = re.split(r"\s#", line, maxsplit=1)[0]
        for segment in re.split(r"\|\||&&|[|;]", line):
            segment = segment.strip().removeprefix(".venv/bin/")
            if " -m tessel " in f" {segment} ":
                segment = segment[segment.index("-m tessel") + 3:]
            if segment.startswith("tessel "):
                found.append(segment)
    for span in _inline_code(text):
        for segment in span.split("|"):
            if segment.strip().startswith("tessel "):
                found.append(segment.strip())
    return found


def _check_invocation(command: str) -> str | None:
    """Why `command` (`tessel ...`) is not something tessel accepts, or None."""
    from tessel.cli import COMMANDS

    words = command.split()
    name = words[1]
    if not re.fullmatch(r"[a-z][a-z-]*", name):  # a placeholder such as COMMAND
        return None
    if name in ("--version", "--help"):
        return None
    if name not in COMMANDS:
        return f"unknown command {name!r}"
    argv = [name]
    subs = re.search(r"^usage: tessel \S+ \[-h\] \{([\w,-]+)\}", _help(name), re.M)
    if subs and len(words) > 2 and not words[2].startswith("-"):
        if words[2] not in subs.group(1).split(","):
            return f"`tessel {name}` has no subcommand {words[2]!r}"
        argv.append(words[2])
    known = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", _help(*argv)))
    for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)(?![\w.-])", command):
        if flag not in known | {"--help"}:
            return f"`tessel {' '.join(argv)}` has no option {flag}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_commands_in_the_docs_exist(page: Path):
    problems = [f"{cmd!r}: {why}" for cmd in _tessel_commands(page)
                if (why := _check_invocation(cmd)) is not None]
    assert not problems, f"{_rel(page)}:\n" + "\n".join(problems)


# ---- config keys -----------------------------------------------------------------------------

# `metrics.jsonl`, `run.json`, `recovery.py`, `model.safetensors` are files, not keys.
_FILE_SUFFIXES = {"json", "jsonl", "toml", "py", "html", "txt", "md", "log", "safetensors", "bin",
                  "idx", "distcp", "sbatch", "yaml"}


def _config_keys() -> tuple[set[str], set[str]]:
    from tessel.config import Config, table_model

    sections, keys = set(), set()
    for section, info in Config.model_fields.items():
        model = table_model(info.annotation)
        if model is not info.annotation:  # [[alerts]]: written as `[[alerts]] key`
            continue
        sections.add(section)
        keys |= {f"{section}.{name}" for name in model.model_fields}
    return sections, keys


@pytest.mark.parametrize("page", [p for p in PAGES if p != REFERENCE], ids=_rel)
def test_config_keys_in_the_docs_exist(page: Path):
    sections, keys = _config_keys()
    pattern = re.compile(r"(?<![\w./])(" + "|".join(sorted(sections)) + r")\.([a-z][a-z0-9_]*)")
    unknown = sorted({f"{m[1]}.{m[2]}" for m in pattern.finditer(page.read_text())
                      if m[2] not in _FILE_SUFFIXES} - keys)
    assert not unknown, f"{_rel(page)} names config keys that do not exist: {unknown}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_toml_examples_in_the_docs_are_valid_configs(page: Path):
    from tessel.config import Config

    for info, body in _code_blocks(page.read_text()):
        if info.strip() == "toml":
            Config.from_dict(tomllib.loads(body))


# ---- file paths and links --------------------------------------------------------------------

_PATH = re.compile(r"(?<![\w./-])((?:tessel|tests|benchmarks|configs|docs|\.ci)/[\w./*-]*[\w*])")


def _exists(path: str) -> bool:
    return any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_file_paths_in_the_docs_exist(page: Path):
    missing = sorted({p for p in _PATH.findall(page.read_text()) if not _exists(p)})
    assert not missing, f"{_rel(page)} names files that do not exist: {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", _prose(page.read_text()), re.M)}


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve(page: Path):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{_rel(page)} has broken links: {broken}"


def _architecture_tree() -> set[str]:
    """The paths the tree in docs/architecture.md names (`tessel/config/load.py`, ...)."""
    text = (DOCS / "architecture.md").read_text()
    tree = next(body for _, body in _code_blocks(text) if body.startswith("tessel/\n"))
    stack: list[tuple[int, str]] = []  # (indent, directory)
    named = set()
    for line in tree.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        entry = line.split()[0]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        named.add("/".join([d for _, d in stack] + [entry.rstrip("/")]))
        if entry.endswith("/"):
            stack.append((indent, entry.rstrip("/")))
    return named


def test_architecture_tree_names_existing_files_and_every_package():
    """The tree in docs/architecture.md: every entry exists, and every package of tessel/
    is in it."""
    named = _architecture_tree()
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"
    packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "tessel").rglob("__init__.py")}
    assert not packages - named, f"packages missing from the tree: {sorted(packages - named)}"


def test_architecture_tree_names_every_module():
    """Every module of tessel/ has its line in the tree of docs/architecture.md (a package's
    own __init__.py is named by the package's line), so a reader finds where a change goes
    from the tree alone."""
    named = _architecture_tree()
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "tessel").rglob("*.py")
               if p.name != "__init__.py" or p.parent == ROOT / "tessel"}
    assert not modules - named, f"modules missing from docs/architecture.md: {sorted(modules - named)}"


def test_the_architecture_tree_check_finds_a_missing_module(monkeypatch, tmp_path):
    """The check above fails for a module the tree does not name."""
    (tmp_path / "architecture.md").write_text("```\ntessel/\n  __init__.py  the API\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "DOCS", tmp_path)
    with pytest.raises(AssertionError, match="modules missing from docs/architecture.md"):
        test_architecture_tree_names_every_module()


def test_evaluation_page_warns_that_a_task_directory_is_code():
    """lm_eval imports the Python a task YAML names (`!function`): the page says so."""
    text = " ".join((DOCS / "evaluation.md").read_text().split())
    assert "point `lm_eval.include_path` only at task files you trust" in text
    assert "`!function`" in text
