"""Shared command-line plumbing for the numbered scripts."""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Callable

from utils.errors import TaskHetError, is_disk_full


def run_main(main: Callable[[list[str] | None], object], argv: list[str] | None = None) -> None:
    """Run a script's ``main``; bad input becomes one ``error:`` line on stderr and exit code 2.

    Bad input is a :class:`TaskHetError`, or an ``OSError`` about a path (an ``--out`` that is a
    file, a read-only folder, a missing file) or a full disk: the line names the path and the reason. Open
    progress bars are closed first, so the error never shares a line with a bar.
    """
    try:
        main(argv)
    except TaskHetError as error:
        fail(str(error))
    except OSError as error:
        if is_disk_full(error):  # a full disk is the user's to fix, named path or not (writes in utils/ name it)
            fail(f"{error.filename or 'a write'}: {error.strerror}; free some space (or write elsewhere) and rerun")
        if error.filename is None:
            raise  # not about a path the user gave: a real bug, keep the traceback
        fail(f"{error.filename}: {error.strerror or type(error).__name__}")


def nonnegative_int(text: str) -> int:
    """argparse type: an int >= 0."""
    return _int_at_least(text, 0)


def fail(message: str) -> None:
    """Print ``error: message`` on its own line (after closing progress bars) and exit with code 2."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()
    sys.stdout.flush()
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are a :class:`TaskHetError`: one ``error:`` line through
    :func:`run_main` (naming the flag), not a usage block, and catchable by a caller such as the pipeline."""

    def error(self, message: str) -> None:
        raise TaskHetError(f"{message} (see {self.prog} --help)")


def finite_float(text: str) -> float:
    """argparse type: a finite float (nan and inf are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def nonnegative_float(text: str) -> float:
    """argparse type: a finite float >= 0."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite float > 0."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    return _int_at_least(text, 1)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
    return value


def add_runtime_flags(parser: argparse.ArgumentParser) -> None:
    """``--progress/--no-progress`` and ``--threads``: how a step runs, never what it computes (every step script)."""
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help="progress bars; none are drawn when stdout is not a terminal (a log file, a pipe)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch CPU threads of this step; default: torch's own choice, one per core. On a machine "
                             "shared with other jobs, 1 is often several times faster. Recorded in config.json")


def refuse_several_processes(script: str) -> None:
    """Refuse to run ``script`` as one of several processes (``accelerate launch``/torchrun set WORLD_SIZE):
    each would write the same outputs. Only step 2 (train_centralized_task_model.py) trains data-parallel."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise TaskHetError(f"{script} runs in one process: accelerate launch (several processes) is for "
                           "train_centralized_task_model.py, one run at a time")


def apply_runtime_flags(args: argparse.Namespace) -> argparse.Namespace:
    """Set torch's thread count from ``--threads`` and turn ``args.progress`` off when stdout is not a terminal."""
    args.progress = bool(args.progress) and sys.stdout.isatty()
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    return args


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, but a help that already names its default (``(default: none)``, or says what
    an unset flag means) is left as it is, and an unset (None) default is not printed as ``(default: None)``."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        if "default" in help_text.lower() or action.default is None:
            return help_text
        return super()._get_help_string(action)
