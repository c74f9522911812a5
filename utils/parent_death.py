"""Worker processes that die with the process that started them.

A pool's workers outlive a parent killed with SIGKILL (no cleanup code runs in it): they
would keep training and writing into run folders that a rerun is using. multiprocessing gives
each child a sentinel of its parent: the read end of a pipe whose write end only the parent
holds, which the kernel closes when the parent dies, however it dies. A daemon thread in the
worker waits on it and kills the worker.

Why not ``prctl(PR_SET_PDEATHSIG)``: it follows the process that forked the worker, and the
pool's workers are forked by multiprocessing's fork server (pipeline/pool.py), which lives as
long as any worker holds its pipe, so it would never die first. The sentinel follows the
process that asked for the worker, and it works on every platform.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import threading


def die_with_parent() -> None:
    """Make this multiprocessing child die (SIGKILL) as soon as its parent is gone; at once if it already is.

    Call it first thing in a worker (a pool's initializer).

    Raises:
        RuntimeError: this process is not a multiprocessing child.
    """
    parent = multiprocessing.parent_process()
    if parent is None:
        raise RuntimeError("die_with_parent() is for a process started by multiprocessing")
    threading.Thread(target=_kill_this_process_when_closed, args=(parent.sentinel,), name="watch-parent",
                     daemon=True).start()


def _kill_this_process_when_closed(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])  # returns when the parent's end of the pipe is closed
    os.kill(os.getpid(), signal.SIGKILL if hasattr(signal, "SIGKILL") else signal.SIGTERM)
