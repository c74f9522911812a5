"""The study-kind registry: one registered unit per kind of experiment file.

A study kind owns its keys (schema and types), its validation (everything checked before step 0) and its
runner and report. ``run_pipeline.py`` reads a file's ``study:`` key (none: the main job) and hands the file
to that kind, so adding a kind is one module under ``pipeline/studies/`` plus its import in
``pipeline/studies/__init__.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from utils.registry import Registry

if TYPE_CHECKING:
    import pandas as pd

    from pipeline.runner import Pipeline

MAIN_JOB = "main_job"  # the kind of a file without a ``study:`` key


@dataclass(frozen=True)
class StudyKind:
    """One kind of experiment file.

    Attributes:
        name: the file's ``study:`` value (``main_job``: a file without one).
        summary: one line for ``--help`` and the reference pages.
        schema: every key the kind reads, with its default (nested dicts are sections).
        load: ``(raw mapping, file path) -> config``: merges the file with ``schema``, type-checks and validates
            it, and raises a ``TaskHetError`` naming the YAML key; nothing is read but the file itself.
        run: ``(pipeline) -> report table``: every step of the validated config through the shared step runner,
            then the kind's report (report.md, report.csv, plots) in ``pipeline.out_dir``.
        report_unit: what one row of report.csv is, for the console line after a run.
        types: every dotted key of ``schema`` -> its check (pipeline/schema.py), which ``load`` applies; the
            documentation's experiment-file reference reads it too.
        help: every dotted key of ``types`` -> one line on what it does, for that reference page.
        disk_plan: ``(config, experiment folder) -> pipeline.disk_projection.DiskPlan``: every stage the grid will
            write with its size, for run_pipeline.py's disk check before step 0 (None: the kind is not projected).
    """

    name: str
    summary: str
    schema: dict[str, Any]
    load: Callable[[dict[str, Any], Path], dict[str, Any]]
    run: Callable[["Pipeline"], "pd.DataFrame"]
    report_unit: str = "rows"
    free_form: frozenset[str] = frozenset()
    types: Mapping[str, Any] = field(default_factory=dict)
    help: Mapping[str, str] = field(default_factory=dict)
    disk_plan: Callable[[dict[str, Any], Path], Any] | None = None


STUDIES: Registry[StudyKind] = Registry("study kind")


def register(kind: StudyKind) -> StudyKind:
    """Register ``kind`` under its name (a duplicate name is an error)."""
    return STUDIES.register(kind.name)(kind)
