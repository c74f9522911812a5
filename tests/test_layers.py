"""No library module imports one from a higher layer (docs/DESIGN.md, "Layout").

The layers, lowest first: utils; datasets and losses; models (encoders, tasks and their metrics);
training (step 2) and partitioning; network and sparse (the federated core); pipeline and steps
(experiments and the scripts' libraries). A package may import its own layer and the ones below.
Imports under ``if TYPE_CHECKING:`` are annotations only and are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYER = {"utils": 0, "datasets": 1, "losses": 1, "models": 2, "training": 3, "partitioning": 3,
         "network": 4, "sparse": 4, "pipeline": 5, "steps": 5}
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
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pipeline import stages\n"
                     "def f():\n    from training import loop\n")
    assert runtime_imports(tree) == [(1, "typing"), (5, "training")]
