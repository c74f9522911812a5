"""Ctrl-C and SIGTERM: one line saying where a run stopped and how to go on, then exit 130 or 143.

Python turns SIGINT (Ctrl-C) into ``KeyboardInterrupt`` and dies of SIGTERM without running any
``finally``. :func:`raise_on_sigterm` makes SIGTERM raise :class:`Interrupted` too, a
``KeyboardInterrupt`` that carries its signal and the line to print; the code that knows where the
run is (step 4's engine: the round and the last checkpoint; step 2's loop: the epoch; the pipeline:
the stage) re-raises any interrupt with that line (:func:`interrupted`), and ``utils.cli.run_main``
prints it and exits with the shell's code for the signal, 128 + its number: 130 for SIGINT, 143 for
SIGTERM. No traceback: nothing went wrong, and every step resumes from its checkpoint.

A pool worker of the pipeline (run_pipeline.py ``--jobs N``) calls :func:`stoppable_worker`: a terminal's
Ctrl-C reaches every process of its group, and the pipeline alone answers it (:func:`stop_workers`),
naming the stages that were running and those not started. SIGTERM from the pipeline raises
:class:`WorkerStopped` in the worker, so the stage it runs unwinds (its ``finally`` blocks release the
folder's lock) and the worker ends without a word. Other pools (the renderer's) call :func:`quiet_worker`:
their workers hold no lock, and die of SIGTERM at once.
"""

from __future__ import annotations

import multiprocessing
import signal
import threading
import time
from typing import Iterable

RESUME_HINT = "rerun the same command to resume"
STOP_GRACE_S = 60.0  # how long a stopped worker may take to unwind its stage before it is killed
SHOWN_NOT_STARTED = 3  # stages named as not started; the rest are counted (a grid may hold hundreds)


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


class WorkerStopped(SystemExit):
    """SIGTERM in a pipeline pool worker (:func:`stoppable_worker`).

    A ``SystemExit``, not a ``KeyboardInterrupt``: no code that reports Ctrl-C (step 4's round line) answers it,
    while every ``finally`` on the way out runs (the folder's lock is released). Its code is SIGTERM's, 143.
    """

    def __init__(self) -> None:
        super().__init__(128 + int(signal.SIGTERM))


def _stop_worker(signum: int, frame: object) -> None:
    # Once: a second SIGTERM (the pool's own, once it sees a worker gone) must not cut the unwinding short.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise WorkerStopped()


def stoppable_worker() -> None:
    """A pipeline pool worker's signals: Ctrl-C is left to the pipeline (it reaches the whole process group), and
    SIGTERM, which the pipeline sends, raises :class:`WorkerStopped` (the stage unwinds, then the worker ends)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stop_worker)


def stop_workers(grace: float = STOP_GRACE_S) -> None:
    """SIGTERM to every live worker process this process started (multiprocessing's children), and wait for them to
    end; one still alive after ``grace`` seconds (a stage that did not unwind) is killed."""
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    deadline = time.monotonic() + grace
    for child in children:
        child.join(max(deadline - time.monotonic(), 0.0))
        if child.is_alive():
            child.kill()
            child.join()


def names_text(names: list[str], shown: int) -> str:
    """``A, B, C`` for at most ``shown`` names, else the first ``shown`` and ``and N more``."""
    rest = len(names) - shown
    return ", ".join(names) if rest <= 0 else f"{', '.join(names[:shown])} and {rest} more"


def stages_message(error: BaseException, running: Iterable[str], not_started: Iterable[str] = ()) -> Interrupted:
    """The pipeline's line when it stopped its workers: ``interrupted while running A, B; not started: C; each resumes
    from its last checkpoint: rerun the same command to resume``.

    ``running`` are the stages the workers had begun, ``not_started`` those no worker had been handed (named up to
    :data:`SHOWN_NOT_STARTED`, then counted).
    """
    running, not_started = list(running), list(not_started)
    parts = ["interrupted" + (f" while running {', '.join(running)}" if running else "")]
    if not_started:
        parts.append(f"not started: {names_text(not_started, SHOWN_NOT_STARTED)}")
    parts.append(f"each resumes from its last checkpoint: {RESUME_HINT}")
    return Interrupted(signal_of(error), "; ".join(parts))
