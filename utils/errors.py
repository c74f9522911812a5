"""The one exception type for bad user input (files, flags, CSV rows).

Scripts catch it at the top level (see :func:`utils.cli.run_main`) and print its
message as one line, so a user sees what is wrong and where, not a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import os
from typing import Iterator


class TaskHetError(Exception):
    """Bad input: the message names the file, row or flag and what was expected."""


class NonFiniteLossError(TaskHetError):
    """A training loss became NaN or infinite; the run must stop (it keeps its last good checkpoint)."""


class DiskFullError(TaskHetError):
    """A write failed because the disk or the user's quota is full; the message names the path."""


class FolderInUseError(TaskHetError):
    """Another live run holds the lock of the folder this run would write (utils/locks.py)."""


# ENOSPC: the file system is full; EDQUOT: the user's quota is. Both mean "free space and rerun".
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` is an OSError saying the disk or the quota is full."""
    return isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS


@contextlib.contextmanager
def disk_full_names(path: os.PathLike | str, exact: bool = False) -> Iterator[None]:
    """Turn a full disk inside the block into a :class:`DiskFullError` naming the file (else ``path``).

    ``exact`` names ``path`` always (an atomic write's error names its temp file, not the file the user knows).

    Other errors pass unchanged, so a real bug keeps its traceback.
    """
    try:
        yield
    except OSError as error:
        if not is_disk_full(error):
            raise
        reason = "no space left on device" if error.errno == errno.ENOSPC else "disk quota exceeded"
        raise DiskFullError(f"{path if exact else error.filename or path}: {reason} while writing it; free some space (or write "
                            "elsewhere) and rerun: nothing half-written is kept as finished") from error
