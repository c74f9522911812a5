"""Progress that a log file can hold: one plain line per finished piece of work, with the time left.

A tqdm bar is drawn only on a terminal (``utils.cli.apply_runtime_flags``); under ``make demo > log 2>&1``
or a batch job nothing else would say how far a run is. These helpers give the lines that do: step 4's
line per evaluated round, step 2's per epoch, and the pipeline's per step (:class:`StepLines`), all on
stdout. Every time they print, elapsed or left, is :func:`clock_text`'s ``H:MM:SS`` (``0:03:21``; hours may pass
24), and ``ETA H:MM:SS`` (:func:`eta_text`) is always the time *left*: the remaining pieces times the mean of those
done so far in this process (:class:`Pace`).
"""

from __future__ import annotations

import math
import sys
import time
from typing import Callable, TextIO


def clock_text(seconds: float) -> str:
    """``H:MM:SS``, the one format of every printed duration: ``seconds`` to the nearest whole second (half up),
    hours growing past 24 (``25:00:01``, never days); a negative or non-finite time prints as ``0:00:00``."""
    whole = math.floor(seconds + 0.5) if math.isfinite(seconds) and seconds > 0 else 0
    hours, rest = divmod(whole, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


def eta_text(seconds_left: float) -> str:
    """``ETA H:MM:SS``: the time left, in :func:`clock_text`'s format (``ETA 0:03:21``)."""
    return f"ETA {clock_text(seconds_left)}"


def seconds_left(elapsed: float, done: int, total: int) -> float:
    """The time the ``total - done`` pieces left take at the mean pace of the ``done`` ones (0 when none is done)."""
    return elapsed / done * max(total - done, 0) if done > 0 else 0.0


class StepLines:
    """What a tqdm bar over steps gives where none is drawn: the step count, and one line per finished step.

    It takes the calls the pipeline makes on its bar (``set_description``, ``update``, ``close``, a ``with``
    block), counts the steps (a disabled tqdm counts nothing), and :meth:`finished` prints
    ``step k of N: <name>, <seconds> s``.
    """

    def __init__(self, total: int, file: TextIO | None = None) -> None:
        self.total, self.n, self.file = total, 0, file
        self.description = ""

    def set_description(self, description: str) -> None:
        self.description = description

    def update(self, count: int = 1) -> None:
        self.n += count

    def finished(self, name: str, seconds: float) -> None:
        """One line for the step just counted: ``step 3 of 12: step 2: train normal, 41 s``."""
        print(f"step {self.n} of {self.total}: {name}, {seconds:.0f} s", file=self.file or sys.stdout, flush=True)

    def close(self) -> None:
        pass

    def __enter__(self) -> "StepLines":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Pace:
    """The ETA of a loop over ``total`` pieces of which ``start`` were done before this process began (a resume).

    Only the pieces done here count towards the pace: a resumed run's earlier epochs or rounds took unknown time,
    and counting them as done in no time would shrink the ETA. ``clock``: seconds, monotonic (a test's fake one).
    """

    def __init__(self, start: int, total: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self.start, self.total, self.clock = start, total, clock
        self.began = clock()

    def eta(self, done: int) -> str:
        """``ETA H:MM:SS`` after ``done`` pieces in all (``start`` included)."""
        return eta_text(seconds_left(self.clock() - self.began, done - self.start, self.total - self.start))
