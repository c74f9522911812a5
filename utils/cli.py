"""Shared command-line plumbing for the numbered scripts."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from utils.errors import TaskHetError


def run_main(main: Callable[[list[str] | None], object], argv: list[str] | None = None) -> None:
    """Run a script's ``main``; a :class:`TaskHetError` becomes one line on stderr and exit code 2."""
    try:
        main(argv)
    except TaskHetError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


def positive_float(text: str) -> float:
    """argparse type: a float > 0."""
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value
