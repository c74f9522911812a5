"""Shared command-line plumbing for the numbered scripts."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from utils.errors import TaskHetError


def run_main(main: Callable[[list[str] | None], object], argv: list[str] | None = None) -> None:
    """Run a script's ``main``; bad input becomes one ``error:`` line on stderr and exit code 2.

    Bad input is a :class:`TaskHetError`, or an ``OSError`` about a path (an ``--out`` that is a
    file, a read-only folder, a missing file): the line names the path and the reason. Open
    progress bars are closed first, so the error never shares a line with a bar.
    """
    try:
        main(argv)
    except TaskHetError as error:
        fail(str(error))
    except OSError as error:
        if error.filename is None:
            raise  # not about a path the user gave: a real bug, keep the traceback
        fail(f"{error.filename}: {error.strerror or type(error).__name__}")


def fail(message: str) -> None:
    """Print ``error: message`` on its own line (after closing progress bars) and exit with code 2."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()
    sys.stdout.flush()
    print(f"error: {message}", file=sys.stderr)
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
