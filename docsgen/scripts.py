"""The reference page of every script's flags, read from the scripts' own argparse parsers.

Each top-level script is a thin CLI over a ``steps/`` module that holds its parser (``build_parser()``);
step 1 has one parser per data family. A top-level script this module does not know stops the build,
so a new script cannot be left off the page.
"""

from __future__ import annotations

import argparse
import importlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from docsgen.markdown import code, escape, table

ROOT = Path(__file__).resolve().parents[1]
NOT_SCRIPTS = frozenset({"losses.py"})  # top-level modules that are libraries, not command lines


@dataclass(frozen=True)
class Script:
    """One command line: how it is called, what it is, and how to get its parser."""

    command: str
    title: str
    parser: Callable[[], argparse.ArgumentParser]


def _step(module: str, *args: str) -> Callable[[], argparse.ArgumentParser]:
    return lambda: importlib.import_module(f"steps.{module}").build_parser(*args)


def _run_pipeline_parser() -> argparse.ArgumentParser:
    return importlib.import_module("pipeline.command").build_parser()


def _step1(family: str) -> Callable[[], argparse.ArgumentParser]:
    def parser() -> argparse.ArgumentParser:
        from steps.select import STEP1_MODULES

        return STEP1_MODULES[family].build_parser()

    return parser


def scripts() -> dict[str, list[Script]]:
    """Top-level script file -> its command lines, in pipeline order (step 1 has one per data family)."""
    from steps.select import STEP1_MODULES

    step1 = [Script(f"extract_datapoints_for_experiments.py --family {family}",
                    f"step 1, the {family} family" + (" (the default)" if family == "taskonomy" else ""), _step1(family))
             for family in STEP1_MODULES]
    return {
        "render_synthetic_buildings.py": [Script("render_synthetic_buildings.py", "step 0, synthetic buildings",
                                                 _step("render"))],
        "download_taskonomy.py": [Script("download_taskonomy.py", "step 0, real Taskonomy", _step("download"))],
        "extract_datapoints_for_experiments.py": step1,
        "train_centralized_task_model.py": [Script("train_centralized_task_model.py", "step 2",
                                                   _step("train_centralized"))],
        "search_centralized_hparams.py": [Script("search_centralized_hparams.py", "step 2's hyperparameter search",
                                                 _step("search_centralized"))],
        "extract_embeddings.py": [Script("extract_embeddings.py", "step 3", _step("embed"))],
        "group_by_target_property.py": [Script("group_by_target_property.py", "step 3p, the positive control's groups",
                                               _step("target_groups"))],
        "make_client_assignments.py": [Script("make_client_assignments.py", "step 3b", _step("assign"))],
        "measure_heterogeneity.py": [Script("measure_heterogeneity.py", "step 3c", _step("meter"))],
        "explain_heterogeneity.py": [Script("explain_heterogeneity.py", "the quadratic explainer", _step("explain"))],
        "test_fed.py": [Script("test_fed.py", "step 4 (each algorithm's settings: the algorithms page)",
                               _step("federated"))],
        "merge_task_vectors.py": [Script("merge_task_vectors.py", "task arithmetic", _step("merge"))],
        "run_pipeline.py": [Script("run_pipeline.py", "every step from one experiment file", _run_pipeline_parser)],
    }


def top_level_scripts() -> list[str]:
    """The repository's top-level command lines (every ``*.py`` at the root but the library modules)."""
    return sorted(path.name for path in ROOT.glob("*.py") if path.name not in NOT_SCRIPTS)


def flag_rows(parser: argparse.ArgumentParser) -> list[list[str]]:
    """One row per argument: its spelling and its help exactly as ``--help`` prints it (default and range)."""
    parser.format_help()  # the project's parsers append each number's range to its help here
    formatter = parser._get_formatter()
    rows = []
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        spelling = ", ".join(action.option_strings) or action.dest
        metavar = "" if action.nargs == 0 else formatter._format_args(action, formatter._get_default_metavar_for_optional(action)
                                                                      if action.option_strings else action.dest)
        shown = f"{spelling} {metavar}".strip() if action.option_strings else metavar
        required = " (required)" if action.required and action.option_strings else ""
        rows.append([code(shown) + required, escape(formatter._expand_help(action) if action.help else "")])
    return rows


def page() -> str:
    """The flags page (Markdown)."""
    known = scripts()
    unknown = sorted(set(top_level_scripts()) - set(known))
    if unknown:
        raise RuntimeError(f"docsgen/scripts.py does not know the top-level script(s) {', '.join(unknown)}: add their "
                           "parsers to scripts() so the flag reference lists them")
    parts = ["# Every script's flags",
             "Generated at build time from each script's own parser (`docsgen/scripts.py`), so it is what `--help` "
             "prints. Every step script also takes `--progress/--no-progress` and `--threads`. "
             "Each algorithm's settings (`test_fed.py --method X --name value`) are on the "
             "[algorithms page](algorithms.md); `python -m network.flower.app` takes exactly `test_fed.py`'s flags."]
    parts.append(table(["command", "what"], ([f"[{code(entry.command)}](#{_slug(entry.command)})", escape(entry.title)]
                                            for entries in known.values() for entry in entries)))
    for entries in known.values():
        for entry in entries:
            parser = entry.parser()
            parts.append(f"## {entry.command} {{#{_slug(entry.command)}}}")
            parts.append(f"*{escape(entry.title)}.* " + escape(parser.description or ""))
            parts.append(table(["flag", "help"], flag_rows(parser)))
    return "\n\n".join(parts) + "\n"


def _slug(command: str) -> str:
    """The id of a command's heading: ``extract_datapoints_for_experiments.py --family digits`` ->
    ``extract_datapoints_for_experiments-family-digits``."""
    return re.sub(r"[^a-z0-9_]+", "-", command.lower().replace(".py", "")).strip("-")
