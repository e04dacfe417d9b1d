"""The shape of the tree (docs/architecture.md): no import circles, no module reaching into
another's private names, no file past ~500 lines, no module importing the CLI."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "tessel"
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST):
    """Every node except those under `if TYPE_CHECKING:` (never imported at run time)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _package(name: str) -> str:
    return name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]


def _imports(name: str, tree: ast.AST, type_checking: bool = False) -> set[str]:
    """The tessel modules `name` imports, at module level or inside functions (and under
    `if TYPE_CHECKING:` with `type_checking`)."""
    found = set()
    for node in (ast.walk(tree) if type_checking else _runtime_nodes(tree)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in MODULES}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = _package(name).split(".")
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            if not base.startswith("tessel"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


TREES = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}


def test_no_import_circles():
    """Counting every import: function-level ones and those under TYPE_CHECKING too (a helper
    that imports the Trainer only for its type still reaches into it)."""
    graph = {name: _imports(name, tree, type_checking=True) for name, tree in TREES.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_only_the_cli_imports_the_cli():
    graph = {name: _imports(name, tree) for name, tree in TREES.items()}
    offenders = sorted(n for n, deps in graph.items()
                       if not n.startswith("tessel.cli") and n != "tessel.__main__"
                       and any(d.startswith("tessel.cli") for d in deps))
    assert offenders == []


def test_config_is_the_bottom_layer():
    """tessel.config imports nothing of tessel but errors (and fileio), not even for type
    checking or inside a function: every other package may build on it."""
    allowed = {"tessel", "tessel.errors", "tessel.fileio"}
    offenders = sorted(f"{name} -> {dep}" for name, tree in TREES.items()
                       if name == "tessel.config" or name.startswith("tessel.config.")
                       for dep in _imports(name, tree, type_checking=True)
                       if dep not in allowed and not dep.startswith("tessel.config"))
    assert offenders == []


def test_the_layer_check_counts_function_level_and_type_checking_imports():
    """The AST check above must see what it claims to: a function-level import and a
    TYPE_CHECKING one count."""
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from tessel.models import Transformer\n"
                     "def f():\n    import tessel.checkpoint.hf_models\n")
    assert _imports("tessel.config.x", tree, type_checking=True) == {
        "tessel.models", "tessel.checkpoint.hf_models"}
    assert _imports("tessel.config.x", tree) == {"tessel.checkpoint.hf_models"}


def test_importing_the_config_imports_no_torch():
    """`import tessel.config` (what a CLI parser, a linter of configs or a planner on a laptop
    needs) loads no torch, in a fresh interpreter."""
    code = "import sys, tessel.config; assert 'torch' not in sys.modules, 'torch'; " \
           "print(sorted(m for m in sys.modules if m.startswith('tessel')))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT.parent)
    assert proc.returncode == 0, proc.stderr
    loaded = ast.literal_eval(proc.stdout.strip())
    assert [m for m in loaded if m.split(".")[:2] != ["tessel", "config"]
            and m not in ("tessel", "tessel.errors", "tessel.fileio")] == []


def _private_definitions(tree: ast.AST) -> set[str]:
    """Private names a module defines: top-level functions/classes/variables, methods, and
    attributes it assigns on self."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_module_uses_another_modules_private_names():
    defined = {name: _private_definitions(tree) for name, tree in TREES.items()}
    offenders = []
    for name, tree in TREES.items():
        elsewhere = set().union(*(d for n, d in defined.items() if n != name)) - defined[name]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tessel"):
                offenders += [f"{name}: from {node.module} import {a.name}"
                              for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__")]
            elif isinstance(node, ast.Attribute) and node.attr in elsewhere:
                owner = node.value
                if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                    offenders.append(f"{name}:{node.lineno}: .{node.attr}")
    assert offenders == []


def test_no_file_is_past_the_size_limit():
    big = {str(p.relative_to(ROOT.parent)): n for p in MODULES.values()
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert big == {}


def test_test_modules_have_distinct_names():
    """The test directories are not packages, so pytest imports each test module under its
    file name: two with one name stop the whole session at collection ("import file
    mismatch"), in CI, after the install."""
    names: dict[str, list[str]] = {}
    for path in (ROOT.parent / "tests").rglob("*.py"):
        if path.name != "conftest.py" and "__pycache__" not in path.parts:
            names.setdefault(path.name, []).append(str(path.relative_to(ROOT.parent)))
    assert not {n: p for n, p in names.items() if len(p) > 1}


# Packages that sit below the training loop and the CLI, and the layers above them that they
# may not import (at module level or inside functions): the trainer and the commands use them.
BELOW_THE_LOOP = {
    "tessel.launch": "starting processes and job files, on config and the mesh's degrees",
    "tessel.optim": "the optimizers and the learning-rate schedule, on config and models",
}
ABOVE_THEM = ("tessel.cli", "tessel.train", "tessel.checkpoint", "tessel.planner",
              "tessel.observe", "tessel.scaling", "tessel.bench", "tessel.generate")


def test_launch_and_optim_import_nothing_above_them():
    graph = {name: _imports(name, tree) for name, tree in TREES.items()}
    offenders = sorted(f"{name} -> {dep}" for name, deps in graph.items()
                       for pkg in BELOW_THE_LOOP if name == pkg or name.startswith(pkg + ".")
                       for dep in deps
                       if any(dep == up or dep.startswith(up + ".") for up in ABOVE_THEM))
    assert offenders == []
