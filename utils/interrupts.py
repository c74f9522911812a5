"""Ctrl-C and SIGTERM: one line saying where a run stopped and how to go on, then exit 130 or 143.

Python turns SIGINT (Ctrl-C) into ``KeyboardInterrupt`` and dies of SIGTERM without running any
``finally``. :func:`raise_on_sigterm` makes SIGTERM raise :class:`Interrupted` too, a
``KeyboardInterrupt`` that carries its signal and the line to print; the code that knows where the
run is (step 4's engine: the round and the last checkpoint; step 2's loop: the epoch; the pipeline:
the stage) re-raises any interrupt with that line (:func:`interrupted`), and ``utils.cli.run_main``
prints it and exits with the shell's code for the signal, 128 + its number: 130 for SIGINT, 143 for
SIGTERM. No traceback: nothing went wrong, and every step resumes from its checkpoint.

A pool worker (run_pipeline.py ``--jobs N``) calls :func:`quiet_worker`: a terminal's Ctrl-C reaches
every process of its group, and the pipeline alone answers it (:func:`stop_workers`), naming the
stages that were running; the workers die of SIGTERM without a word.
"""

from __future__ import annotations

import multiprocessing
import signal
import threading
from typing import Iterable

RESUME_HINT = "rerun the same command to resume"


class Interrupted(KeyboardInterrupt):
    """A run stopped by a signal (SIGINT or SIGTERM); ``str()`` is the one line to print.

    A ``KeyboardInterrupt``, so that code which cleans up after Ctrl-C does the same after SIGTERM.
    """

    def __init__(self, signum: int = signal.SIGINT, message: str = f"interrupted; {RESUME_HINT}") -> None:
        super().__init__(message)
        self.signum, self.message = int(signum), message

    @property
    def exit_code(self) -> int:
        """The shell's code for death by this signal: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + self.signum

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):  # a worker's interrupt crosses to the pipeline pickled
        return type(self), (self.signum, self.message)


def signal_of(error: BaseException) -> int:
    """The signal behind an interrupt: its own for :class:`Interrupted`, SIGINT for a plain ``KeyboardInterrupt``."""
    return error.signum if isinstance(error, Interrupted) else int(signal.SIGINT)


def message_of(error: BaseException) -> str:
    """The line of an interrupt: its own for :class:`Interrupted`, the plain one for a bare ``KeyboardInterrupt``."""
    return error.message if isinstance(error, Interrupted) else Interrupted().message


def interrupted(error: BaseException, message: str) -> Interrupted:
    """``error`` (an interrupt) as :class:`Interrupted` with ``message``, keeping its signal; raise it ``from None``."""
    return Interrupted(signal_of(error), message)


def _raise_interrupted(signum: int, frame: object) -> None:
    raise Interrupted(signum)


def raise_on_sigterm() -> None:
    """Make SIGTERM raise :class:`Interrupted` in the main thread (signal handlers can be set only there)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_interrupted)


def quiet_worker() -> None:
    """A pool worker's signals: Ctrl-C is left to the pipeline (it reaches the whole process group), and SIGTERM,
    which the pipeline sends, ends the worker at once, with no traceback (its run resumes from its checkpoint)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def stop_workers() -> None:
    """SIGTERM to every live worker process this process started (multiprocessing's children), and wait for them."""
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join()


def stages_message(error: BaseException, names: Iterable[str]) -> Interrupted:
    """The pipeline's line when workers were running stages: ``interrupted while running A, B; each resumes from its
    last checkpoint: rerun the same command to resume``."""
    names = list(names)
    running = f" while running {', '.join(names)}" if names else ""
    return Interrupted(signal_of(error), f"interrupted{running}; each resumes from its last checkpoint: {RESUME_HINT}")
