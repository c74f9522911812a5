"""The top-level scripts are thin command lines over library modules, and no library module imports one."""

from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIBRARY_PACKAGES = ("datasets", "models", "network", "partitioning", "pipeline", "sparse", "steps", "training", "utils")
ALLOWED_SCRIPT_IMPORTS: set[tuple[str, str]] = set()
THIN_SCRIPTS = {
    "render_synthetic_buildings.py": "Step 0 (data)",
    "extract_datapoints_for_experiments.py": "Step 1:",
    "train_centralized_task_model.py": "Step 2 of TaskHet",
    "extract_embeddings.py": "Step 3:",
    "make_client_assignments.py": "Step 3b:",
    "group_by_target_property.py": "Step 3p:",
    "test_fed.py": "Step 4 of TaskHet",
    "download_taskonomy.py": "Step 0 (data): download real Taskonomy",
    "measure_heterogeneity.py": "Step 3c:",
    "merge_task_vectors.py": "Task arithmetic (TaLoS, Iurada et al., ICLR 2025)",
    "search_centralized_hparams.py": "Search the centralized baseline",
    "explain_heterogeneity.py": "The quadratic explainer",
}


def test_every_script_is_thin():
    scripts = {path.name for path in ROOT.glob("*.py")} - {"losses.py"}
    assert scripts == set(THIN_SCRIPTS) | {"run_pipeline.py"}
    for script in scripts:
        assert len((ROOT / script).read_text().splitlines()) <= 60, script


def top_level_scripts() -> set[str]:
    """Module names of the repository root's scripts (every root .py file is one)."""
    return {path.stem for path in ROOT.glob("*.py")}


def imported_modules(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports, at any depth of its code."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_library_module_imports_a_script():
    scripts = top_level_scripts() - {"losses"}  # losses.py is a library module kept at the root
    found = {
        (path.relative_to(ROOT).as_posix(), name)
        for package in LIBRARY_PACKAGES
        for path in (ROOT / package).rglob("*.py")
        for name in imported_modules(path) & scripts
    }
    assert found <= ALLOWED_SCRIPT_IMPORTS, sorted(found - ALLOWED_SCRIPT_IMPORTS)


@pytest.mark.parametrize("script", sorted(THIN_SCRIPTS))
def test_thin_script_prints_its_steps_help(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(ROOT / script), run_name="__main__")
    assert exit_info.value.code == 0
    assert THIN_SCRIPTS[script] in capsys.readouterr().out
