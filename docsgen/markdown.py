"""Small Markdown writers shared by the reference generators: escaped table cells and tables."""

from __future__ import annotations

import re
from typing import Any, Iterable, Sequence

# Text that Markdown would read as HTML, a table border, emphasis or a link; backticks are left alone (code spans).
_ESCAPES = {"\\": "\\\\", "&": "&amp;", "<": "&lt;", ">": "&gt;", "|": "\\|", "*": "\\*", "_": "\\_", "[": "\\[",
            "]": "\\]"}
_SPECIAL = re.compile("[" + re.escape("".join(_ESCAPES)) + "]")


_CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def escape(text: Any) -> str:
    """``text`` as one line of Markdown that shows exactly those characters, in a table cell too; its code spans
    (between backticks) are kept as code (Python-Markdown escapes their insides, and its tables skip their pipes)."""
    flat = " ".join(str(text).split())
    parts, position = [], 0
    for match in _CODE_SPAN.finditer(flat):
        parts.append(_SPECIAL.sub(lambda found: _ESCAPES[found.group(0)], flat[position:match.start()]))
        parts.append(match.group(0))
        position = match.end()
    parts.append(_SPECIAL.sub(lambda found: _ESCAPES[found.group(0)], flat[position:]))
    return "".join(parts)


def code(text: Any) -> str:
    """``text`` as a code span."""
    flat = " ".join(str(text).split())
    return f"`` {flat} ``" if "`" in flat else f"`{flat}`"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A Markdown table; cells are used as given (escape them with :func:`escape` or :func:`code`)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def first_paragraph(docstring: str | None) -> str:
    """The first paragraph of a docstring, on one line ("" when there is none)."""
    paragraph = (docstring or "").strip().split("\n\n")[0]
    return " ".join(paragraph.split())


def anchor(name: str) -> str:
    """The id a heading ``name`` gets (Python-Markdown's toc slug of a plain identifier: lower case, '_' kept)."""
    return re.sub(r"[^\w-]", "", name.strip().lower().replace(" ", "-"))
