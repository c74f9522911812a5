"""Progress that a log file can hold: one plain line per finished piece of work, with the time left.

A tqdm bar is drawn only on a terminal (``utils.cli.apply_runtime_flags``); under ``make demo > log 2>&1``
or a batch job nothing else would say how far a run is. These helpers give the lines that do: step 4's
line per evaluated round, step 2's per epoch, and the pipeline's per step (:class:`StepLines`), all on
stdout. ``ETA hh:mm`` is always the time *left* (hours:minutes, rounded up; hours may pass 24), the
remaining pieces times the mean of those done so far.
"""

from __future__ import annotations

import math
import sys
import time
from typing import TextIO


def eta_text(seconds_left: float) -> str:
    """``ETA hh:mm``: ``seconds_left`` in hours and minutes, rounded up (a run with 10 s to go says 00:01)."""
    minutes = math.ceil(max(seconds_left, 0.0) / 60) if math.isfinite(seconds_left) else 0
    return f"ETA {minutes // 60:02d}:{minutes % 60:02d}"


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

    Only the pieces done here count towards the pace: a resumed run's earlier rounds took unknown time.
    """

    def __init__(self, start: int, total: int) -> None:
        self.start, self.total, self.began = start, total, time.perf_counter()

    def eta(self, done: int) -> str:
        """``ETA hh:mm`` after ``done`` pieces in all (``start`` included)."""
        return eta_text(seconds_left(time.perf_counter() - self.began, done - self.start, self.total - self.start))
