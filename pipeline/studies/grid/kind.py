"""A grid-study kind from its report: the shared grid keys, validation and runner, plus the kind's own keys,
checks and report (what each kind module under pipeline/studies/ registers)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable

from pipeline.schema import Check
from pipeline.studies.grid.config import GRID_HELP, GRID_TYPES, Extra, grid_schema, load_grid_study
from pipeline.studies.grid.disk import disk_plan
from pipeline.studies.grid.runner import GridStudy
from pipeline.studies.registry import StudyKind, register

if TYPE_CHECKING:
    import pandas as pd

    from pipeline.runner import Pipeline

# write_report(config, out_dir, run_dirs, centralized, command[, meters]) -> the report table
WriteReport = Callable[..., "pd.DataFrame"]


def register_grid_kind(name: str, summary: str, write_report: WriteReport, report_unit: str,
                       extra_schema: dict[str, Any] | None = None, extra_types: dict[str, Check] | None = None,
                       extra_checks: tuple[Extra, ...] = (), free_form: frozenset[str] = frozenset(),
                       reads_meters: bool = False, extra_help: dict[str, str] | None = None) -> StudyKind:
    """Register a grid-study kind named ``name`` whose report is ``write_report``.

    Args:
        extra_schema, extra_types, extra_help: the kind's own top-level keys with their defaults, their checks, and
            what each does (the reference page's line).
        extra_checks: the kind's own checks of a merged, validated config (they name the key).
        free_form: dotted keys of the kind whose mappings are taken whole.
        reads_meters: the report takes step 3c's folders (``meters=``).
    """
    schema = grid_schema(extra_schema)
    types = {**GRID_TYPES, **(extra_types or {})}
    help_lines = {**GRID_HELP, **(extra_help or {})}
    load = functools.partial(load_grid_study, schema=schema, types=types, extra_checks=extra_checks,
                             free_form=free_form)

    def run(pipeline: "Pipeline") -> "pd.DataFrame":
        result = GridStudy(pipeline).run()
        if not pipeline.writes_report:  # a shard: its share of the runs is done; the final call reports
            import pandas as pd

            return pd.DataFrame()
        extra = {"meters": result.meters} if reads_meters else {}
        return write_report(pipeline.config, pipeline.out_dir, result.run_dirs, result.centralized, pipeline.command,
                            **extra)

    return register(StudyKind(name=name, summary=summary, schema=schema, load=load, run=run,
                              report_unit=report_unit, types=types, help=help_lines, disk_plan=disk_plan))
