"""Paste an experiment's report.md into README.md between two marker lines, so the README shows it unedited.

``python -m pipeline.readme_report results/demo/report.md README.md`` replaces everything between
``<!-- demo report: start -->`` and ``<!-- demo report: end -->``: the report's own title is dropped,
its ``##`` headings become ``####`` (they sit under "What the demo found"), and its image links point
into the report's folder. Nothing else of the README changes; without both markers it is an error.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from utils.errors import TaskHetError
from utils.run_dir import atomic_write_text

START, END = "<!-- demo report: start -->", "<!-- demo report: end -->"


def readme_block(report: str, report_dir: str) -> str:
    """The report's text as it sits in the README: no title, headings two levels down, images under ``report_dir``."""
    lines = [line for line in report.splitlines() if not line.startswith("# ")]
    lines = ["##" + line if line.startswith("## ") else line for line in lines]
    text = "\n".join(lines).strip("\n")
    return re.sub(r"!\[([^\]]*)\]\(([^/)]+\.png)\)", rf"![\1]({report_dir}/\2)", text)


def paste(readme: str, report: str, report_dir: str) -> str:
    """``readme`` with the text between the markers replaced by :func:`readme_block` of ``report``."""
    if readme.count(START) != 1 or readme.count(END) != 1 or readme.index(START) > readme.index(END):
        raise TaskHetError(f"README: expected one {START!r} line followed by one {END!r} line")
    before, rest = readme.split(START)
    _, after = rest.split(END)
    return f"{before}{START}\n\n{readme_block(report, report_dir)}\n\n{END}{after}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", type=Path, help="an experiment's report.md, e.g. results/demo/report.md")
    parser.add_argument("readme", type=Path, help="the README to update in place")
    args = parser.parse_args(argv)
    if not args.report.is_file():
        raise TaskHetError(f"{args.report}: no such report (run the experiment first)")
    folder = args.report.parent.as_posix()
    atomic_write_text(args.readme, paste(args.readme.read_text(), args.report.read_text(), folder))


if __name__ == "__main__":
    from utils.cli import run_main

    run_main(main)
