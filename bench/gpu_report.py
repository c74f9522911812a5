"""The GPU check's figures: one row per figure, printed as it comes, kept as a CSV and a Markdown table.

A row is ``(stage, figure, value, unit, detail)`` (:data:`COLUMNS`, fixed). :class:`Report` prints each row on its
own stdout line as it comes; the check rewrites both files after every stage, so a run cut short (a device lent for a
few minutes) still leaves every stage it finished. :func:`goal_lines` reads the rows back into the goals of
docs/BENCHMARKS.md.
"""

from __future__ import annotations

import csv
import io
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from utils.run_dir import atomic_write_text

COLUMNS = ("stage", "figure", "value", "unit", "detail")
CSV_FILE = "gpu_check.csv"
MARKDOWN_FILE = "gpu_check.md"
FAILED = "failed"
SKIPPED = "skipped"
ERROR_FIGURE = "error"


@dataclass(frozen=True)
class Row:
    """One figure. ``value`` is a number, or text (a device name, ``failed``, ``skipped``, ``not installed``)."""

    stage: str
    figure: str
    value: float | str
    unit: str = ""
    detail: str = ""

    @property
    def shown(self) -> str:
        """The value as the files and the console show it: numbers to 4 significant digits."""
        if isinstance(self.value, bool) or not isinstance(self.value, (int, float)):
            return str(self.value)
        return f"{self.value:.4g}" if math.isfinite(self.value) else str(self.value)

    def line(self) -> str:
        """The console line: ``stage  figure = value unit  (detail)``."""
        unit = f" {self.unit}" if self.unit else ""
        detail = f"  ({self.detail})" if self.detail else ""
        return f"{self.stage:12s} {self.figure} = {self.shown}{unit}{detail}"


@dataclass
class Report:
    """Rows in the order they were measured; ``out`` (a folder, or None: print only) receives both files.

    Args:
        header: Markdown lines above the table (what was run, where, when).
        notes: Markdown lines below the goals (the paper-grid projection's assumptions).
    """

    out: Path | None
    header: list[str]
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    dry_run: bool = False

    def add(self, row: Row) -> None:
        """Keep the row and print it on its own line."""
        self.rows.append(row)
        print(row.line(), flush=True)

    def value(self, stage: str, figure: str) -> float | str | None:
        """The value of a figure, or None when it was not recorded."""
        return next((row.value for row in self.rows if (row.stage, row.figure) == (stage, figure)), None)

    def write(self) -> None:
        """Rewrite the CSV and the Markdown (atomically: a reader never sees half a file)."""
        if self.out is None:
            return
        atomic_write_text(self.out / CSV_FILE, csv_text(self.rows))
        atomic_write_text(self.out / MARKDOWN_FILE, self.markdown())

    def markdown(self) -> str:
        lines = [*self.header, "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(cell(text) for text in (row.stage, row.figure, row.shown, row.unit, row.detail))
                  + " |" for row in self.rows]
        goals = goal_lines(self)
        if goals:
            lines += ["", "## The goals", "", "| goal | measured | verdict |", "|---|---|---|", *goals]
        if self.notes:
            lines += ["", *self.notes]
        return "\n".join(lines) + "\n"


def csv_text(rows: list[Row]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(COLUMNS)
    writer.writerows((row.stage, row.figure, row.shown, row.unit, row.detail) for row in rows)
    return buffer.getvalue()


def cell(text: str) -> str:
    """A Markdown table cell: a ``|`` in an error message would split the row."""
    return text.replace("|", "\\|").replace("\n", " ")


def progress(message: str) -> None:
    """A progress line (with its ETA) on stderr, so stdout keeps one line per figure."""
    print(message, file=sys.stderr, flush=True)


# ----- the goals of docs/BENCHMARKS.md, read back from the rows -----

VECTORISED_GOAL = 10.0  # vectorised ÷ sequential rounds/s at 128 clients
LOOP_GOAL = 0.9  # step 2's loop ÷ a plain bf16 loop
PFL_GOAL = 1.0  # TaskHet ÷ pfl rounds/s
GRID_GOAL_HOURS = 48.0  # the paper grid on one GPU


def number(value: float | str | None) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def verdict(measured: float | None, goal: float, at_most: bool = False) -> str:
    if measured is None:
        return "not measured"
    met = measured <= goal if at_most else measured >= goal
    return "met" if met else "not met"


def goal_lines(report: Report) -> list[str]:
    """One Markdown table line per goal: what was measured and whether it meets the goal (none without the rows)."""
    lines = []
    ratios = {row.figure.split("_k")[0]: number(row.value) for row in report.rows
              if row.stage == "vectorised" and row.figure.endswith("_ratio") and "_k128_" in row.figure}
    if any(row.stage == "vectorised" for row in report.rows):
        shown = ", ".join(f"{model} {value:.2f}×" if value is not None else f"{model} —"
                          for model, value in ratios.items())
        verdicts = ", ".join(f"{model}: {verdict(value, VECTORISED_GOAL)}" for model, value in ratios.items())
        lines.append(goal_row(report, f"vectorised ≥ {VECTORISED_GOAL:g}× sequential at 128 clients", shown or "—",
                              verdicts or "not measured"))
    if any(row.stage == "train_loop" for row in report.rows):
        loop = number(report.value("train_loop", "taskhet_over_plain"))
        lines.append(goal_row(report, f"step 2's loop ≥ {LOOP_GOAL:g} of a plain bf16 loop",
                              "—" if loop is None else f"{loop:.3f}", verdict(loop, LOOP_GOAL)))
    if any(row.stage == "pfl" for row in report.rows):
        lines.append(pfl_goal(report))
    if any(row.stage == "paper_round" for row in report.rows):
        lines.append(paper_goal(report))
    return lines


def paper_goal(report: Report) -> str:
    """The grid goal, judged on the whole grid (steps 2–4 and the checkpoint writes) where it was projected, else on
    step 4's runs alone."""
    step4 = number(report.value("paper_round", "grid_1gpu"))
    complete = number(report.value("paper_round", "complete_1gpu"))
    hours = step4 if complete is None else complete
    eight = number(report.value("paper_round", "grid_8gpu" if complete is None else "complete_8gpu"))
    shown = "—" if hours is None else f"{hours:.1f} h on 1 GPU" + ("" if eight is None else f", {eight:.1f} h on 8")
    if complete is not None and step4 is not None:
        shown = f"the whole grid {shown} (step 4 alone {step4:.1f} h)"
    return goal_row(report, f"the paper grid ≤ {GRID_GOAL_HOURS:g} h on one GPU", shown,
                    verdict(hours, GRID_GOAL_HOURS, at_most=True))


def pfl_goal(report: Report) -> str:
    ratios = {row.figure: number(row.value) for row in report.rows
              if row.stage == "pfl" and row.figure.endswith("_over_pfl")}
    if not ratios:
        reason = next((f"{row.value}: {row.detail}" for row in report.rows if row.stage == "pfl"), "not measured")
        return goal_row(report, f"TaskHet ≥ {PFL_GOAL:g}× pfl", "—", f"not measured ({reason})")
    shown = ", ".join(f"{figure.replace('_over_pfl', '')} {value:.2f}×" for figure, value in ratios.items()
                      if value is not None)
    vectorised = [value for figure, value in ratios.items() if figure.endswith("vectorised_over_pfl")]
    met = bool(vectorised) and all(value is not None and value >= PFL_GOAL for value in vectorised)
    return goal_row(report, f"TaskHet ≥ {PFL_GOAL:g}× pfl", shown,
                    ("met" if met else "not met") + " (TaskHet's vectorised engine, at every K)")


def goal_row(report: Report, goal: str, measured: str, result: str) -> str:
    if report.dry_run:
        result = "dry run: tiny sizes on the CPU, not a measurement of the goal"
    return f"| {cell(goal)} | {cell(measured)} | {cell(result)} |"
