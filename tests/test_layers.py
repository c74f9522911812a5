"""No library module imports one from a higher layer, and no modules import each other in a circle
(docs/DESIGN.md, "Layout").

The layers, lowest first: utils; datasets and losses; models (encoders, tasks and their metrics);
training (step 2) and partitioning; network and sparse (the federated core); steps (the scripts'
libraries); pipeline (experiment files and studies). A package may import its own layer and the ones
below. Imports under ``if TYPE_CHECKING:`` are annotations only and are not counted; imports inside
functions are counted (a deferred import is still a dependency).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYER = {"utils": 0, "datasets": 1, "losses": 1, "models": 2, "training": 3, "partitioning": 3,
         "network": 4, "sparse": 4, "steps": 5, "pipeline": 6}
# Entry points that live inside a package: the Flower app's command line reads test_fed.py's flags.
ENTRY_POINTS = {("network/flower/app.py", "steps")}


def runtime_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import outside ``if TYPE_CHECKING:`` blocks."""
    skipped = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
               for statement in block.body for node in ast.walk(statement)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def higher_layer_imports(package: str) -> list[str]:
    files = sorted((ROOT / package).rglob("*.py")) if (ROOT / package).is_dir() else [ROOT / f"{package}.py"]
    wrong = []
    for path in files:
        relative = path.relative_to(ROOT).as_posix()
        for line, imported in runtime_imports(ast.parse(path.read_text(), relative)):
            if LAYER.get(imported, -1) > LAYER[package] and (relative, imported) not in ENTRY_POINTS:
                wrong.append(f"{relative}:{line} imports {imported}")
    return wrong


@pytest.mark.parametrize("package", sorted(LAYER))
def test_no_module_imports_a_higher_layer(package):
    assert higher_layer_imports(package) == []


def test_the_check_sees_a_higher_layer_import_and_skips_annotations(tmp_path):
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pipeline import runner\n"
                     "def f():\n    from training import loop\n")
    assert runtime_imports(tree) == [(1, "typing"), (5, "training")]


def module_name(path: Path) -> str:
    """``pipeline/studies/__init__.py`` -> ``pipeline.studies``; ``utils/cli.py`` -> ``utils.cli``."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    """Every module of the library packages and the top-level scripts, by dotted name."""
    files = [path for package in LAYER for path in (sorted((ROOT / package).rglob("*.py")) if (ROOT / package).is_dir()
                                                     else [ROOT / f"{package}.py"])]
    files += sorted(ROOT.glob("*.py"))
    return {module_name(path): path for path in files}


def imported_modules(tree: ast.Module, known: dict[str, Path]) -> set[str]:
    """The project modules a file imports (``from a.b import c`` is ``a.b.c`` when that is a module, else ``a.b``),
    outside ``if TYPE_CHECKING:`` blocks."""
    skipped = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
               for statement in block.body for node in ast.walk(statement)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in known:
            for alias in node.names:
                found.add(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module)
    return found


def import_graph() -> dict[str, set[str]]:
    known = project_modules()
    return {name: imported_modules(ast.parse(path.read_text(), str(path)), known) - {name}
            for name, path in known.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of ``graph`` as a list of modules (first == last), or [] when it has none (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node], path[len(path):] = 1, [node]
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = 2
        path.pop()
        return []

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return []


def test_the_project_imports_no_module_in_a_circle():
    assert find_cycle(import_graph()) == []


def test_the_circle_check_finds_a_circle_and_reads_imports_as_python_resolves_them(tmp_path):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
    known = {"pipeline.sections": Path(), "pipeline": Path(), "utils.cli": Path()}
    tree = ast.parse("from pipeline import sections\nimport utils.cli\nimport os\n"
                     "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pipeline import experiment\n"
                     "def f():\n    from pipeline.sections import MAX_RUNS\n")
    assert imported_modules(tree, known) == {"pipeline.sections", "utils.cli"}
