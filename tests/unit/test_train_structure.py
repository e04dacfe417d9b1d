"""The trainer stays an orchestrator (docs/architecture.md, DESIGN.md): its class small, its
imports few (counting every import it makes, function-level and `if TYPE_CHECKING:` ones
included), and no part taking the whole trainer. (No import circle anywhere, counting every
import: tests/unit/test_structure.py.)"""

from __future__ import annotations

import ast
from pathlib import Path

from test_structure import module_imports, trees

TESSEL = Path(__file__).resolve().parents[2] / "tessel"
TRAINER = TESSEL / "train" / "trainer.py"
MAX_TRAINER_LINES = 300
MAX_TRAINER_IMPORTS = 20


def graph() -> dict[str, set[str]]:
    """Every tessel module's imports, counted as test_structure's layering checks count them
    (module level, inside functions, under TYPE_CHECKING), from its syntax trees."""
    return {name: module_imports(name, tree, type_checking=True) for name, tree in trees().items()}


def test_the_import_count_sees_function_level_and_type_checking_imports():
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
              "    from tessel.train.trainer import Trainer\n"
              "def f():\n    from tessel.train import state\n")
    # (counted as if it were the source of tessel.train.result, a module of the package)
    assert module_imports("tessel.train.result", ast.parse(source), type_checking=True) == {
        "tessel.train.trainer", "tessel.train.state"}
    relative = "def f():\n    from .state import Counters\n    from . import eval\n"
    assert module_imports("tessel.train.result", ast.parse(relative), type_checking=True) == {
        "tessel.train.state", "tessel.train.eval"}


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
