"""Paste an experiment's report.md into a Markdown file between two marker lines, so the file shows it unedited.

``python -m pipeline.readme_report results/demo/report.md docs/results/main-job.md --images docs/demo``
replaces everything between ``<!-- demo report: start -->`` and ``<!-- demo report: end -->``: the report's
own title is dropped, its ``##`` headings become ``####`` (they sit under a heading of the page), and its
image links point, relative to the target file's folder, into the report's folder or, with ``--images
docs/demo``, into a folder the report's PNG plots are copied to (committed, so that the page shows them on a
fresh clone). ``--sections Summary,Results`` keeps the report's opening text and only those ``##`` sections
(the README shows the answer; the results page of the documentation shows the whole report). Nothing else of
the file changes; without both markers it is an error, and so are a linked plot that is not there and a
section the report lacks, before anything is written. ``--block mechanism`` uses the markers
``<!-- mechanism report: start -->`` and ``<!-- mechanism report: end -->`` instead, so one file can hold the
reports of several experiments.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from utils.errors import TaskHetError
from utils.run_dir import atomic_copy_file, atomic_write_text

DEFAULT_BLOCK = "demo"
START, END = "<!-- demo report: start -->", "<!-- demo report: end -->"


def markers(block: str = DEFAULT_BLOCK) -> tuple[str, str]:
    """The start and end lines of a pasted block (``demo``: :data:`START` and :data:`END`)."""
    return f"<!-- {block} report: start -->", f"<!-- {block} report: end -->"


def pasted_block(text: str, block: str = DEFAULT_BLOCK) -> str | None:
    """What sits between a block's markers in ``text`` (None without both)."""
    start, end = markers(block)
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        return None
    return text.split(start, 1)[1].split(end, 1)[0]
IMAGE = re.compile(r"!\[([^\]]*)\]\(([^/)]+\.png)\)")  # a plot beside report.md


def select_sections(report: str, sections: list[str]) -> str:
    """``report`` with its text before the first ``##`` heading and only the ``##`` sections named, in report order.

    Raises:
        TaskHetError: a named section the report does not have (naming it and the report's sections).
    """
    parts = re.split(r"(?m)^(?=## )", report)
    found = {part.splitlines()[0][3:].strip(): part for part in parts[1:]}
    missing = [name for name in sections if name not in found]
    if missing:
        raise TaskHetError(f"--sections: the report has no section {missing[0]!r}; its sections: {', '.join(found)}")
    return parts[0] + "".join(part for name, part in found.items() if name in sections)


def readme_block(report: str, report_dir: str) -> str:
    """The report's text as it sits in the target file: no title, headings two levels down, images under
    ``report_dir``."""
    lines = [line for line in report.splitlines() if not line.startswith("# ")]
    lines = ["##" + line if line.startswith("## ") else line for line in lines]
    text = "\n".join(lines).strip("\n")
    return IMAGE.sub(rf"![\1]({report_dir}/\2)", text)


def paste(readme: str, report: str, report_dir: str, block: str = DEFAULT_BLOCK) -> str:
    """``readme`` with the text between ``block``'s markers replaced by :func:`readme_block` of ``report``."""
    start, end = markers(block)
    if pasted_block(readme, block) is None:
        raise TaskHetError(f"README: expected one {start!r} line followed by one {end!r} line")
    before, rest = readme.split(start)
    _, after = rest.split(end)
    return f"{before}{start}\n\n{readme_block(report, report_dir)}\n\n{end}{after}"


def plots(report: str, report_dir: Path) -> list[Path]:
    """The PNG files ``report`` links, in ``report_dir``; a missing one is an error naming it."""
    files = [report_dir / name for name in dict.fromkeys(match.group(2) for match in IMAGE.finditer(report))]
    missing = [path for path in files if not path.is_file()]
    if missing:
        raise TaskHetError(f"{report_dir / 'report.md'} links {missing[0].name}, but {missing[0]} does not exist")
    return files


def block_name(text: str) -> str:
    """argparse type of ``--block``: a plain lower-case name (it becomes part of an HTML comment)."""
    if not re.fullmatch(r"[a-z][a-z0-9_-]{0,31}", text):
        raise argparse.ArgumentTypeError(f"a block is a lower-case name such as demo or mechanism, got {text!r}")
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", type=Path, help="an experiment's report.md, e.g. results/demo/report.md")
    parser.add_argument("readme", type=Path, help="the file to update in place (README.md, docs/results/main-job.md)")
    parser.add_argument("--images", type=Path, default=None,
                        help="copy the report's PNG plots into this folder and link them there (e.g. docs/demo); "
                             "default: link them in the report's folder")
    parser.add_argument("--sections", type=lambda text: [name.strip() for name in text.split(",") if name.strip()],
                        default=None, help="comma-separated ## sections to keep, e.g. Summary,Results (default: all)")
    parser.add_argument("--block", default=DEFAULT_BLOCK, type=block_name,
                        help="the markers to paste between: <!-- BLOCK report: start --> and <!-- BLOCK report: end "
                             f"--> (default: {DEFAULT_BLOCK})")
    args = parser.parse_args(argv)
    if not args.report.is_file():
        raise TaskHetError(f"{args.report}: no such report (run the experiment first)")
    if not args.readme.is_file():
        raise TaskHetError(f"{args.readme}: no such file")
    report = args.report.read_text()
    if args.sections is not None:
        report = select_sections(report, args.sections)
    files = plots(report, args.report.parent)
    target = args.report.parent if args.images is None else args.images
    folder = Path(os.path.relpath(target.resolve(), args.readme.resolve().parent)).as_posix()
    text = paste(args.readme.read_text(), report, folder, args.block)  # markers checked before any plot is copied
    if args.images is not None:
        for path in files:
            if (args.images / path.name).resolve() != path.resolve():
                atomic_copy_file(path, args.images / path.name)
    atomic_write_text(args.readme, text)


if __name__ == "__main__":
    from utils.cli import run_main

    run_main(main)
