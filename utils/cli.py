"""Shared command-line plumbing for the numbered scripts."""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from utils.errors import TaskHetError, is_disk_full

# ----- numbers a user types -----
# ASCII digits only: written [0-9], never \d or str.isdigit()/int()/float(), which also take '²', '٣' or '1_000'.
INTEGER_PATTERN = re.compile(r"[+-]?[0-9]+", re.ASCII)
FLOAT_PATTERN = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)
# No value in range needs more characters; a longer text is refused before int() or float() reads it.
MAX_NUMBER_CHARS = 40
# Limits shared by several scripts (each script's own limits are named where its flags are defined).
MAX_THREADS = 1024  # --threads: torch CPU threads; far above any machine's cores, far below what crashes torch
MAX_WORKERS = 256  # worker processes: --num_workers, --workers, --jobs
MAX_SEED = 2**63 - 1  # seeds: non-negative and within int64 (config.json, numpy, torch)
MAX_LIST_ITEMS = 64  # values of one list flag (a grid searched or simulated item by item)
MAX_IMAGE_SIZE = 2048  # image side in pixels (Taskonomy's full resolution is 512)
MAX_BATCH_SIZE = 16_384
MAX_EPOCHS = 10_000
MAX_SAMPLES = 10**8  # sample counts (--n_samples, --minibatch_threshold, ...): beyond any data set here
MAX_LEARNING_RATE = 1e6  # far above any working rate; one that diverges is stopped by the loss check, by name
MAX_DECODER_WIDTH = 4096  # channels of a dense decoder
MAX_CLUSTERS = 10_000  # KMeans clusters (step 3's --n_clusters): the groups of an embedding-based partition


@dataclass(frozen=True)
class Range:
    """A closed or half-open range of ints or floats: the one parser of every number a user types.

    As an argparse ``type`` it turns a flag's text into a number in the range, or an ``ArgumentTypeError``
    (``argument --x: must be an integer in [1, 1024], got '0'``); :class:`ArgumentParser` appends the range to the
    flag's ``--help``. :meth:`read` parses a number inside a mini-language (``--temporal rotate:3:5``) and names the
    flag in a :class:`TaskHetError`; :meth:`check` checks a number that arrived as one (a YAML or JSON value).
    """

    low: float
    high: float
    integer: bool = True
    low_open: bool = False
    high_open: bool = False

    def __str__(self) -> str:
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"{left}{_number_text(self.low)}, {_number_text(self.high)}{right}"

    def describe(self) -> str:
        """``an integer in [1, 1024]`` or ``a number in (0, 1]``."""
        return f"{'an integer' if self.integer else 'a number'} in {self}"

    def parse(self, text: str) -> int | float:
        """``text`` as a number in the range; a ``ValueError`` saying what is allowed otherwise."""
        if not isinstance(text, str):
            raise ValueError(f"must be {self.describe()}, got {quoted(text)}")
        stripped = text.strip()
        pattern = INTEGER_PATTERN if self.integer else FLOAT_PATTERN
        if len(stripped) > MAX_NUMBER_CHARS or not pattern.fullmatch(stripped):
            raise ValueError(f"must be {self.describe()}, got {quoted(text)}")
        return self.check(int(stripped) if self.integer else float(stripped), text)

    def check(self, value: Any, shown: Any = None) -> int | float:
        """``value`` (already a number) in the range; bools, NaN and inf refused. ``shown``: the text messages quote."""
        shown = value if shown is None else shown
        kind = int if self.integer else (int, float)
        # An int is compared as it is (math.isfinite of a 400-digit int overflows); a float must be finite.
        finite = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
        if isinstance(value, bool) or not isinstance(value, kind) or not finite or not self.contains(value):
            raise ValueError(f"must be {self.describe()}, got {quoted(shown)}")
        return value if self.integer else float(value)

    def contains(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def read(self, text: str, where: str) -> int | float:
        """:meth:`parse`, with a :class:`TaskHetError` ``WHERE must be ...`` (``where`` names the flag and part)."""
        try:
            return self.parse(text)
        except ValueError as error:
            raise TaskHetError(f"{where} {error}") from None

    def __call__(self, text: str) -> int | float:  # argparse type
        try:
            return self.parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None


def quoted(value: Any, most: int = 60) -> str:
    """``repr(value)`` for a message, cut to about ``most`` characters (a huge int is named by its digit count:
    Python refuses to print one of over 4,300 digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value).bit_length() > 3 * most:
        return f"an integer of about {int(abs(value).bit_length() * 0.30103) + 1} digits"
    text = repr(value)
    return text if len(text) <= most else f"{text[:most - 5]}...{text[-2:]}"


def ints(low: int, high: int) -> Range:
    """argparse type: an integer in [low, high]."""
    return Range(low, high)


def floats(low: float, high: float, low_open: bool = False, high_open: bool = False) -> Range:
    """argparse type: a finite number in [low, high] (``low_open``/``high_open``: that end excluded)."""
    return Range(low, high, integer=False, low_open=low_open, high_open=high_open)


def _number_text(value: float) -> str:
    """A range end as --help shows it: ints in full (2^63-1 by name), floats in %g form."""
    if isinstance(value, int):
        return "2^63-1" if value == 2**63 - 1 else "-2^63+1" if value == -(2**63 - 1) else str(value)
    return f"{value:g}"


def check_list(values: Sequence, flag: str, most: int = MAX_LIST_ITEMS) -> None:
    """A list flag holds at most ``most`` values, each once (every value is one more case to run)."""
    if len(values) > most:
        raise TaskHetError(f"{flag} lists {len(values)} values; at most {most} are allowed")
    if len(set(values)) != len(values):
        raise TaskHetError(f"{flag} lists a value twice: {', '.join(map(str, values))}")


SEEDS = ints(0, MAX_SEED)
THREADS = ints(1, MAX_THREADS)
WORKERS = ints(0, MAX_WORKERS)
IMAGE_SIZES = ints(1, MAX_IMAGE_SIZE)
BATCH_SIZES = ints(1, MAX_BATCH_SIZE)
EPOCHS = ints(1, MAX_EPOCHS)
LEARNING_RATES = floats(0.0, MAX_LEARNING_RATE, low_open=True)
MOMENTA = floats(0.0, 1.0, high_open=True)  # SGD momentum: 1 or more never forgets a gradient and diverges
WEIGHT_DECAYS = floats(0.0, 1.0)
FRACTIONS = floats(0.0, 1.0)  # a share, both ends allowed


def run_main(main: Callable[[list[str] | None], object], argv: list[str] | None = None) -> None:
    """Run a script's ``main``; bad input becomes one ``error:`` line on stderr and exit code 2.

    Bad input is a :class:`TaskHetError`, or an ``OSError`` about a path (an ``--out`` that is a
    file, a read-only folder, a missing file) or a full disk: the line names the path and the reason. Open
    progress bars are closed first, so the error never shares a line with a bar. Ctrl-C and SIGTERM
    (:mod:`utils.interrupts`) print one line instead of a traceback, the one the interrupted code gave
    (``interrupted at round 12 (checkpoint at round 10); rerun the same command to resume``), and exit 130 or 143.
    """
    from utils.interrupts import message_of, raise_on_sigterm, signal_of

    raise_on_sigterm()
    try:
        main(argv)
    except KeyboardInterrupt as error:  # Ctrl-C, or SIGTERM (utils.interrupts.Interrupted)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C while the line is printed changes nothing
        _close_bars()
        print(message_of(error), file=sys.stderr, flush=True)
        sys.exit(128 + signal_of(error))  # the shell's code for death by the signal: 130 (SIGINT), 143 (SIGTERM)
    except TaskHetError as error:
        fail(str(error))
    except OSError as error:
        if is_disk_full(error):  # a full disk is the user's to fix, named path or not (writes in utils/ name it)
            fail(f"{error.filename or 'a write'}: {error.strerror}; free some space (or write elsewhere) and rerun")
        if error.filename is None:
            raise  # not about a path the user gave: a real bug, keep the traceback
        fail(f"{error.filename}: {error.strerror or type(error).__name__}")


def leave_launched_process() -> None:
    """End a rank of a multi-process launch (``accelerate launch``, torchrun: ``WORLD_SIZE`` > 1) at once, without the
    interpreter's finalization; elsewhere return.

    Step 2's ranks close their process group before this, yet a rank was seen to abort as the interpreter finalized
    ("terminate called without an active exception" from a native thread, no Python frame left: twice under load, once
    in a CI run), failing a run whose every output was already written. Called after ``run_main`` returned, so every
    file is closed; logs and streams are flushed first. An error leaves through ``run_main``'s own exit, not here.
    """
    import logging

    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def nonnegative_int(text: str) -> int:
    """argparse type: an int in [0, 2^63-1] (bench scripts; a step's flag has its own, documented :class:`Range`)."""
    return _ANY_NONNEGATIVE_INT(text)


def fail(message: str) -> None:
    """Print ``error: message`` on its own line (after closing progress bars) and exit with code 2."""
    _close_bars()
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def _close_bars() -> None:
    """Close every open tqdm bar and flush stdout, so that a last line never shares a line with a bar."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()
    sys.stdout.flush()


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are a :class:`TaskHetError`: one ``error:`` line through
    :func:`run_main` (naming the flag), not a usage block, and catchable by a caller such as the pipeline."""

    def error(self, message: str) -> None:
        raise TaskHetError(f"{message} (see {self.prog} --help)")

    def format_help(self) -> str:
        """argparse's help, every numeric flag's allowed range appended to its line (from its :class:`Range` type)."""
        for action in self._actions:
            note = range_note(action.type)
            if note and action.help != argparse.SUPPRESS and note not in (action.help or ""):
                action.help = f"{action.help} ({note})" if action.help else note
        return super().format_help()


def range_note(kind: object) -> str | None:
    """What --help says of a flag's values: ``an integer in [1, 1024]`` (``each ...`` for a list type), or None."""
    if isinstance(kind, Range):
        return kind.describe()
    each = getattr(kind, "each", None)
    return f"each {each.describe()}" if isinstance(each, Range) else None


def finite_float(text: str) -> float:
    """argparse type: a finite float of ASCII digits (nan and inf are refused)."""
    return _ANY_FLOAT(text)


def nonnegative_float(text: str) -> float:
    """argparse type: a finite float >= 0."""
    return _ANY_NONNEGATIVE_FLOAT(text)


def positive_float(text: str) -> float:
    """argparse type: a finite float > 0."""
    return _ANY_POSITIVE_FLOAT(text)


def positive_int(text: str) -> int:
    """argparse type: an int in [1, 2^63-1] (bench scripts; a step's flag has its own, documented :class:`Range`)."""
    return _ANY_POSITIVE_INT(text)


_LARGEST_FLOAT = 1.7976931348623157e308
_ANY_FLOAT = floats(-_LARGEST_FLOAT, _LARGEST_FLOAT)
_ANY_NONNEGATIVE_FLOAT = floats(0.0, _LARGEST_FLOAT)
_ANY_POSITIVE_FLOAT = floats(0.0, _LARGEST_FLOAT, low_open=True)
_ANY_NONNEGATIVE_INT = ints(0, 2**63 - 1)
_ANY_POSITIVE_INT = ints(1, 2**63 - 1)


# Torch CPU threads of a step unless --threads says otherwise. One: on a loaded or shared machine, torch's own
# choice (one thread per core) spins in OpenMP waits while other processes hold the cores; measured on 2 loaded
# cores with two step-4 runs at once, a training round took 8-10 s at one thread and 208-238 s at torch's choice
# (docs/DESIGN.md §5, "Threads"), against at most 1.24x lost by one run alone on 2 idle cores. A thread count
# changes float rounding, so one count also keeps one machine's numbers the same from run to run.
DEFAULT_THREADS = 1


def add_runtime_flags(parser: argparse.ArgumentParser, threads_help: str | None = None) -> None:
    """``--progress/--no-progress`` and ``--threads``: how a step runs (every step script; ``threads_help``: another
    help for ``--threads``). The thread count is in no stage key, yet CPU training at another count sums in another
    order: step 2 then ends at another model (measured: a keypoints model's weights differ from epoch 1 on, its best
    epoch 50 against 46), while step 3's embeddings of one checkpoint are bit-identical at 1 and 2 threads; the
    pipeline therefore trains on one thread whatever its --threads (pipeline/runner.py, SUMS_GRADIENTS)."""
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help="progress bars; none are drawn when stdout is not a terminal (a log file, a pipe): "
                             "plain progress lines are printed instead")
    # None: not given (the pipeline then passes none on, and a Ray task may take its CPUs); apply_runtime_flags
    # reads it as DEFAULT_THREADS
    parser.add_argument("--threads", type=THREADS, default=None,
                        help=threads_help or f"torch CPU threads of this step (default: {DEFAULT_THREADS}). More threads spin in "
                             "OpenMP waits when other processes share the cores: on 2 busy cores a federated round "
                             "took 8-10 s at one thread and over 200 s at torch's one thread per core. Pass more on "
                             "an idle machine with cores to spare (CPU training of a large model); recorded in "
                             "config.json. CPU training at another count sums in another order and ends at another "
                             "model: compare such runs by their verdicts, not their digits")


def add_plots_flag(parser: argparse.ArgumentParser, pictures: str, drawn_from: str = "metrics.csv") -> None:
    """``--plots/--no-plots``: whether a step draws its ``pictures`` (made from its ``drawn_from`` file); every other
    output is the same either way (not in a run's signature: a resumed run may change it)."""
    parser.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True,
                        help=f"draw {pictures}; --no-plots skips them and every other output stays the same (their "
                             f"numbers are in {drawn_from}, written either way): up to a second of CPU each, "
                             "which a grid of thousands of runs whose pictures nobody opens can keep")


def refuse_several_processes(script: str) -> None:
    """Refuse to run ``script`` as one of several processes (``accelerate launch``/torchrun set WORLD_SIZE):
    each would write the same outputs. Only step 2 (train_centralized_task_model.py) trains data-parallel."""
    if world_size() > 1:
        raise TaskHetError(f"{script} runs in one process: accelerate launch (several processes) is for "
                           "train_centralized_task_model.py, one run at a time")


MAX_PROCESSES = 4096  # WORLD_SIZE: processes of one accelerate launch / torchrun


def world_size() -> int:
    """The processes ``accelerate launch``/torchrun started (``WORLD_SIZE``; 1 when unset), in [1, 4096]."""
    return ints(1, MAX_PROCESSES).read(os.environ.get("WORLD_SIZE", "1"), "the environment variable WORLD_SIZE")


def apply_runtime_flags(args: argparse.Namespace) -> argparse.Namespace:
    """Set torch's thread count from ``--threads`` (None: :data:`DEFAULT_THREADS`) and turn ``args.progress`` off when
    stdout is not a terminal."""
    import torch

    args.progress = bool(args.progress) and sys.stdout.isatty()
    if args.threads is None:
        args.threads = DEFAULT_THREADS
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
