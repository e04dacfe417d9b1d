"""The shape of the tree (docs/architecture.md): packages import only downward (the layers
below), no import circles, no module reaching into another's private names, no function past
~80 lines of code (what a reader holds at once), no file past ~500 lines, no module importing
the CLI."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "tessel"
MAX_LINES = 500
MAX_FUNCTION_CODE = 80  # lines of code in one function (see _code_lines)


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


def module_imports(name: str, tree: ast.AST, type_checking: bool = False) -> set[str]:
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


@functools.cache
def trees() -> dict[str, ast.Module]:
    """Every tessel module's syntax tree, parsed when a test first asks (not at collection,
    which every xdist worker does: ~1.5 s of CPU each)."""
    return {name: ast.parse(path.read_text()) for name, path in MODULES.items()}


def test_no_import_circles():
    """Counting every import: function-level ones and those under TYPE_CHECKING too (a helper
    that imports the Trainer only for its type still reaches into it)."""
    graph = {name: module_imports(name, tree, type_checking=True) for name, tree in trees().items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_only_the_cli_imports_the_cli():
    graph = {name: module_imports(name, tree) for name, tree in trees().items()}
    offenders = sorted(n for n, deps in graph.items()
                       if not n.startswith("tessel.cli") and n != "tessel.__main__"
                       and any(d.startswith("tessel.cli") for d in deps))
    assert offenders == []


def test_config_is_the_bottom_layer():
    """tessel.config imports nothing of tessel but errors (and fileio), not even for type
    checking or inside a function: every other package may build on it."""
    allowed = {"tessel", "tessel.errors", "tessel.fileio"}
    offenders = sorted(f"{name} -> {dep}" for name, tree in trees().items()
                       if name == "tessel.config" or name.startswith("tessel.config.")
                       for dep in module_imports(name, tree, type_checking=True)
                       if dep not in allowed and not dep.startswith("tessel.config"))
    assert offenders == []


def test_the_layer_check_counts_function_level_and_type_checking_imports():
    """The AST check above must see what it claims to: a function-level import and a
    TYPE_CHECKING one count."""
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from tessel.models import Transformer\n"
                     "def f():\n    import tessel.checkpoint.hf_models\n")
    assert module_imports("tessel.config.x", tree, type_checking=True) == {
        "tessel.models", "tessel.checkpoint.hf_models"}
    assert module_imports("tessel.config.x", tree) == {"tessel.checkpoint.hf_models"}


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
    defined = {name: _private_definitions(tree) for name, tree in trees().items()}
    offenders = []
    for name, tree in trees().items():
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
    """A backstop (cheap): size is held by function (test_no_function_is_past_what_a_reader_
    holds) and by the layers; a file past this holds more than one job."""
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
    graph = {name: module_imports(name, tree) for name, tree in trees().items()}
    offenders = sorted(f"{name} -> {dep}" for name, deps in graph.items()
                       for pkg in BELOW_THE_LOOP if name == pkg or name.startswith(pkg + ".")
                       for dep in deps
                       if any(dep == up or dep.startswith(up + ".") for up in ABOVE_THEM))
    assert offenders == []


def _code_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> int:
    """Lines of code of `fn`: its lines less those of nested functions and classes (each
    counted on its own), its docstring, blank lines and comment-only lines."""
    kept = set(range(fn.lineno, fn.end_lineno + 1))
    for node in ast.walk(fn):
        if node is not fn and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                ast.ClassDef)):
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            kept -= set(range(start, node.end_lineno + 1))
    first = fn.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
            isinstance(first.value.value, str):
        kept -= set(range(first.lineno, first.end_lineno + 1))
    return sum(1 for n in kept if lines[n - 1].strip() and not lines[n - 1].strip().startswith("#"))


def test_no_function_is_past_what_a_reader_holds():
    """Size is held by function (docs/architecture.md): a reader holds ~80 lines of code at
    once; a longer function is split by job into named helpers."""
    long = {}
    for name, path in MODULES.items():
        lines = path.read_text().splitlines()
        for node in ast.walk(trees()[name]):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    (n := _code_lines(node, lines)) > MAX_FUNCTION_CODE:
                long[f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name}"] = n
    assert long == {}


def test_the_function_size_counts_only_code():
    src = ('def f():\n    """Doc\n    string."""\n    # a comment\n\n    x = 1\n'
           '    def g():\n        return 2\n    return x\n')
    (fn,) = ast.parse(src).body
    assert _code_lines(fn, src.splitlines()) == 3  # def f, x = 1, return x


# The packages from the bottom up: a module imports only modules of its own package or of a
# lower layer, never a peer of its layer or anything above (module-level, function-level and
# TYPE_CHECKING imports alike). Each name is a top-level module or package of tessel.
LAYERS = (
    ("tessel.errors", "tessel.numbers"),  # import nothing of tessel
    ("tessel.fileio",),  # atomic writes and safe reads, with errors
    ("tessel.config",),  # the typed config: the bottom of everything that trains
    ("tessel.models",),  # model definitions, on config
    ("tessel.parallel", "tessel.optim", "tessel.data"),  # each on models, blind to the others
    ("tessel.launch", "tessel.checkpoint", "tessel.observe"),
    ("tessel.generate", "tessel.planner"),  # sampling from a checkpoint; the what-fits model
    ("tessel.train",),  # the loop: orchestrates everything below
    ("tessel.bench",),  # tessel against a plain PyTorch loop, through the trainer
    ("tessel.scaling",),  # measured sweeps, through bench and the planner
    ("tessel",),  # the package's front door: re-exports Config and Trainer (lazily)
    ("tessel.cli",),  # the commands
    ("tessel.__main__",),
)


def _layer(module: str) -> tuple[int, str]:
    """(layer number, top-level package) of a tessel module."""
    parts = module.split(".")
    top = ".".join(parts[:2])
    for number, layer in enumerate(LAYERS):
        if top in layer:
            return number, top
    raise AssertionError(f"{module}: its top-level package {top} has no place in LAYERS")


def test_every_package_has_a_layer():
    """A new top-level module or package is given its place in LAYERS (_layer says which)."""
    assert [_layer(m) for m in MODULES]


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """The edges of an import graph that go to another package of the same or a higher
    layer."""
    offenders = []
    for name, deps in sorted(graph.items()):
        here, package = _layer(name)
        for dep in sorted(deps):
            there, other = _layer(dep)
            if other != package and there >= here:
                offenders.append(f"{name} -> {dep}")
    return offenders


def test_packages_import_only_downward():
    graph = {name: module_imports(name, tree, type_checking=True) for name, tree in trees().items()}
    assert _upward(graph) == []


def test_the_layer_check_finds_upward_and_sideways_edges():
    assert _upward({"tessel.models.x": {"tessel.train.y", "tessel.models.z", "tessel.config"},
                    "tessel.data.a": {"tessel.optim", "tessel.errors"},
                    "tessel.cli.b": {"tessel", "tessel.train"}}) == [
        "tessel.data.a -> tessel.optim", "tessel.models.x -> tessel.train.y"]
