"""Stage parameters as command lines: the pipeline calls every step through the ``main(argv)`` a user runs."""

from __future__ import annotations

import shlex
from typing import Any


def flags(params: dict[str, Any]) -> list[str]:
    """argparse flags from a dict: booleans as --x / --no-x, lists comma-joined, None left out."""
    argv = []
    for key, value in params.items():
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(f"--{key}" if value else f"--no-{key}")
        elif isinstance(value, (list, tuple)):
            argv += [f"--{key}", ",".join(map(str, value))]
        else:
            argv += [f"--{key}", str(value)]
    return argv


def command_line(argv: list[str]) -> str:
    """The run_pipeline.py command that ``argv`` stands for (recorded in reports)."""
    return "python run_pipeline.py " + " ".join(shlex.quote(arg) for arg in argv)
