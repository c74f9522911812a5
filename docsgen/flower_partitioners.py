"""The reference page of TaskHet's Flower Datasets partitioners (``partitioning/flwr_partitioners.py``).

Read from the module's source with ``ast``, not imported: the module imports Hugging Face's ``datasets``, which
cannot share a process with the repository's own ``datasets`` package (docs/DESIGN.md §2), and the other generators
import that one. Every public class of the module is listed with its constructor's arguments, defaults and the
lines of its docstring's ``Args:`` section, so the page cannot fall behind the code.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from docsgen.markdown import code, escape, first_paragraph, table

ROOT = Path(__file__).resolve().parents[1]
MODULE = ROOT / "partitioning" / "flwr_partitioners.py"
_ARG_LINE = re.compile(r"^(\*{0,2}\w+): (.*)$")


def public_classes(tree: ast.Module) -> list[ast.ClassDef]:
    """The module's public classes, in source order."""
    return [node for node in tree.body if isinstance(node, ast.ClassDef) and not node.name.startswith("_")]


def documented_args(docstring: str) -> dict[str, str]:
    """A Google-style docstring's ``Args:`` section: argument -> its text, continuation lines joined."""
    args: dict[str, str] = {}
    section, current = False, None
    for line in docstring.splitlines():
        stripped = line.strip()
        if stripped in ("Args:", "Arguments:"):
            section = True
            continue
        if section and stripped.endswith(":") and not line.startswith(" " * 8) and _ARG_LINE.match(stripped) is None:
            break  # the next section (Raises:, Attributes:)
        if not section or not stripped:
            continue
        match = _ARG_LINE.match(stripped)
        if match and not line.startswith(" " * 8):
            current = match.group(1).lstrip("*")
            args[current] = match.group(2)
        elif current is not None:
            args[current] += " " + stripped
    return args


def constructor_rows(node: ast.ClassDef) -> list[list[str]]:
    """One row per argument of the class's ``__init__``: name, default, documentation."""
    init = next((item for item in node.body if isinstance(item, ast.FunctionDef) and item.name == "__init__"), None)
    if init is None:
        return []
    docs = documented_args(ast.get_docstring(node) or "")
    arguments = init.args
    positional = arguments.args[1:]  # without self
    defaults = [None] * (len(positional) - len(arguments.defaults)) + list(arguments.defaults)
    rows = [[code(arg.arg), "required" if default is None else code(ast.unparse(default)), escape(docs.get(arg.arg, ""))]
            for arg, default in zip(positional, defaults)]
    rows += [[code(arg.arg), "required" if default is None else code(ast.unparse(default)),
              escape(docs.get(arg.arg, ""))] for arg, default in zip(arguments.kwonlyargs, arguments.kw_defaults)]
    if arguments.kwarg is not None:
        rows.append([code("**" + arguments.kwarg.arg), "", escape(docs.get(arguments.kwarg.arg, ""))])
    return rows


def method_rows(node: ast.ClassDef) -> list[list[str]]:
    """One row per public method or property the class defines itself: its call and its docstring's first line."""
    rows = []
    for item in node.body:
        if isinstance(item, ast.FunctionDef) and not item.name.startswith("_"):
            is_property = any(ast.unparse(decorator) == "property" for decorator in item.decorator_list)
            arguments = ", ".join(arg.arg for arg in item.args.args[1:])
            call = item.name if is_property else f"{item.name}({arguments})"
            rows.append([code(call), escape(first_paragraph(ast.get_docstring(item)))])
    return rows


def page() -> str:
    """The page's Markdown."""
    tree = ast.parse(MODULE.read_text(encoding="utf-8"))
    lines = ["# Flower Datasets partitioners", "",
             escape(first_paragraph(ast.get_docstring(tree))) + " From `partitioning/flwr_partitioners.py` "
             "(generated from its source); how to use them: [the how-to](../howto/flower-partitioners.md).", ""]
    for node in public_classes(tree):
        # the module's name of Flower's base class, spelled as a Flower user imports it
        bases = ", ".join(ast.unparse(base) for base in node.bases).replace("flwr_partitioner.", "flwr_datasets.partitioner.")
        lines += [f"## {node.name}", "", f"`{node.name}({bases})`: " + escape(first_paragraph(ast.get_docstring(node))),
                  ""]
        rows = constructor_rows(node)
        if rows:
            lines += [table(["argument", "default", "meaning"], rows), ""]
        methods = method_rows(node)
        if methods:
            lines += [table(["method", "what it does"], methods), ""]
    return "\n".join(lines)
