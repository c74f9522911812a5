"""Worker processes that die with the process that started them.

A pool's workers outlive a parent killed with SIGKILL (no cleanup code runs in it): they
would keep training and writing into run folders that a rerun is using. On Linux the kernel
can send a signal to a child when its parent dies (``prctl(PR_SET_PDEATHSIG)``); elsewhere a
daemon thread polls the parent's pid. Python's standard library has no wrapper for prctl, so
it is called through ctypes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
POLL_SECONDS = 0.2


def die_with_parent(parent_pid: int) -> str:
    """Make this process die (SIGKILL) as soon as ``parent_pid``, its parent, is gone.

    Call it first thing in a worker (a pool's initializer). Returns how: ``"prctl"`` or ``"watcher"``.
    """
    if sys.platform.startswith("linux") and _set_parent_death_signal(signal.SIGKILL):
        # The parent may have died before the call took effect: then this process already has a new
        # parent and the signal will never come.
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)
        return "prctl"
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="watch-parent", daemon=True).start()
    return "watcher"


def _set_parent_death_signal(signum: int) -> bool:
    """prctl(PR_SET_PDEATHSIG, signum); False where libc or the call is not available."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return False
    return libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signum), 0, 0, 0) == 0


def _watch_parent(parent_pid: int) -> None:
    """Kill this process once the parent is gone (an orphan is re-parented, so its ppid changes)."""
    while os.getppid() == parent_pid:
        time.sleep(POLL_SECONDS)
    os.kill(os.getpid(), signal.SIGKILL if hasattr(signal, "SIGKILL") else signal.SIGTERM)
