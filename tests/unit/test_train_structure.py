"""The trainer stays an orchestrator (docs/architecture.md, DESIGN.md): its class small, its
imports few (counting every import it makes, function-level and `if TYPE_CHECKING:` ones
included), and no part taking the whole trainer. (No import circle anywhere, counting every
import: tests/unit/test_structure.py.)"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

TESSEL = Path(__file__).resolve().parents[2] / "tessel"
TRAINER = TESSEL / "train" / "trainer.py"
MAX_TRAINER_LINES = 300
MAX_TRAINER_IMPORTS = 20


def _module_names() -> dict[str, Path]:
    names = {}
    for path in TESSEL.rglob("*.py"):
        dotted = path.relative_to(TESSEL.parent).with_suffix("").parts
        names[".".join(dotted[:-1] if dotted[-1] == "__init__" else dotted)] = path
    return names


NAMES = _module_names()


def _every_import(name: str, source: str, is_package: bool = False) -> set[str]:
    """Every tessel module that module `name` (with `source`) imports anywhere: module
    level, inside functions, under TYPE_CHECKING."""
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package `level - 1` above this one's
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in NAMES else base)
    return {m for m in out if m in NAMES and m != name}


@functools.cache
def graph() -> dict[str, set[str]]:
    """Every tessel module's imports, parsed when a test first asks (not at collection,
    which every xdist worker does: ~1.7 s of CPU each)."""
    return {name: _every_import(name, path.read_text(), path.name == "__init__.py")
            for name, path in NAMES.items()}


def test_the_import_count_sees_function_level_and_type_checking_imports():
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
              "    from tessel.train.trainer import Trainer\n"
              "def f():\n    from tessel.train import state\n")
    assert _every_import("tessel.train.probe", source) == {"tessel.train.trainer",
                                                           "tessel.train.state"}
    relative = "def f():\n    from .state import Counters\n    from . import eval\n"
    assert _every_import("tessel.train.probe", relative) == {"tessel.train.state",
                                                             "tessel.train.eval"}


def _trainer_class() -> ast.ClassDef:
    tree = ast.parse(TRAINER.read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")


def test_the_trainer_class_stays_small():
    cls = _trainer_class()
    assert cls.end_lineno is not None
    assert cls.end_lineno - cls.lineno + 1 <= MAX_TRAINER_LINES


def test_the_trainer_imports_few_tessel_modules():
    assert len(graph()["tessel.train.trainer"]) <= MAX_TRAINER_IMPORTS, sorted(
        graph()["tessel.train.trainer"])


def test_no_helper_takes_the_trainer():
    """Parts get the parts they need: nothing in tessel imports the Trainer (for its type or
    otherwise) but its package entry and tessel.bench, which runs it."""
    importers = sorted(n for n, deps in graph().items() if "tessel.train.trainer" in deps)
    assert importers == ["tessel.bench", "tessel.train"]
