"""Folder locks: one run at a time writes a folder (DESIGN.md §3, "Folder locks").

Two runs writing one results folder at once corrupt it for good (duplicated rows in an
appended metrics.csv, a report written from half of the runs). Every step and
run_pipeline.py therefore hold :func:`folder_lock` on the folder they write while they run.

The lock is an OS lock (``fcntl.flock``) on the file ``LOCK`` inside the folder, so checking
and taking it is one atomic call, and the kernel drops it when its process dies, even by
kill -9. The file records the holder's pid, host, start time and command: a second run is
refused with one ``error:`` line naming them, and a file left behind by a dead run (a stale
lock) is simply taken over, with one short line naming the pid that left it. The holder deletes
the file when it finishes.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shlex
import socket
import sys
from pathlib import Path
from typing import Callable, Iterator

from utils.errors import FolderInUseError, TaskHetError, disk_full_names

try:
    import fcntl
except ImportError:  # Windows: no flock; _take_by_pid below decides from the recorded pid instead
    fcntl = None

LOCK_FILE = "LOCK"
# The pipeline's stage lock (utils/stages.py): a second process reaching a stage another one runs waits for it.
STAGE_LOCK = ".stage-lock"


def folder_entries(folder: Path) -> list[Path]:
    """The entries of ``folder`` other than its lock files (what "is the folder empty?" must look at)."""
    return [entry for entry in Path(folder).iterdir() if entry.name not in (LOCK_FILE, STAGE_LOCK)]


@contextlib.contextmanager
def waiting_lock(path: Path, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold an OS lock on the file ``path`` (made if missing) while the block runs, WAITING for another holder.

    Unlike :func:`folder_lock`, a second process does not stop: it waits until the first lets go (``on_wait`` is
    called once when it has to). The file is never deleted (deleting a lock file lets two processes hold locks on
    two different files); the kernel drops the lock when its holder dies. Without flock (Windows) it locks nothing.
    """
    handle = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if fcntl is not None:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if on_wait is not None:
                    on_wait()
                fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)  # closing the descriptor releases its flock


@contextlib.contextmanager
def folder_lock(folder: Path, flag: str = "--out") -> Iterator[Path]:
    """Hold ``folder``'s lock while the block runs; a second live run is refused with :class:`FolderInUseError`.

    A full disk inside the block becomes one :class:`DiskFullError` naming the file (or the folder).
    A folder that had to be made only to hold the lock is removed again if the block leaves it
    empty, so a refused run leaves the file system as it was.

    Args:
        folder: the folder the run writes (made if missing).
        flag: the flag or key that named it, for error messages.

    Returns:
        A context manager yielding ``folder``.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise TaskHetError(f"{flag} {folder} is a file, not a folder")
    made = _make_folder(folder)
    try:
        with disk_full_names(folder):
            handle = _take(folder / LOCK_FILE, flag)
            try:
                yield folder
            finally:
                _give_back(handle, folder / LOCK_FILE)
    finally:
        for path in made:  # deepest first; stops at the first that holds something
            if any(path.iterdir()):
                break
            path.rmdir()


def _make_folder(folder: Path) -> list[Path]:
    """Make ``folder`` and its missing parents; returns the ones made, deepest first."""
    missing = [path for path in [folder, *folder.parents] if not path.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    return missing


def _take(path: Path, flag: str) -> int:
    """Lock ``path`` (made if missing) and write this run's record into it; returns the open descriptor."""
    if fcntl is None:
        return _take_by_pid(path, flag)
    while True:
        handle = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_record(handle)
            os.close(handle)
            raise FolderInUseError(_in_use_message(path, flag, holder)) from None
        # The holder deletes the file before it lets go: a lock won on a file that is no longer
        # at ``path`` guards nothing, so try again on the file that is there now.
        if _same_file(handle, path):
            break
        os.close(handle)
    _warn_if_stale(path, _read_record(handle))
    try:
        _write_record(handle)
    except BaseException:  # a full disk, say: give the lock back rather than leave an empty record
        _give_back(handle, path)
        raise
    return handle


def _take_by_pid(path: Path, flag: str) -> int:
    """Where there is no flock: refuse if the recorded holder may be alive, else take the file over.

    Not atomic (two runs starting in the same instant may both pass); flock is used wherever it exists.
    """
    if path.exists():
        try:
            holder = json.loads(path.read_text() or "{}")
        except ValueError:
            holder = {}
        holder = holder if isinstance(holder, dict) else {}  # not a record of ours: no holder, so stale
        if not _is_stale(holder):
            raise FolderInUseError(_in_use_message(path, flag, holder))
        _warn_if_stale(path, holder)
    handle = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    _write_record(handle)
    return handle


def _give_back(handle: int, path: Path) -> None:
    # Delete before unlocking: a run waiting on this file then finds it gone and makes a fresh one.
    if _same_file(handle, path):
        path.unlink()
    os.close(handle)


def _same_file(handle: int, path: Path) -> bool:
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(handle)
    return (found.st_dev, found.st_ino) == (held.st_dev, held.st_ino)


def this_run() -> dict:
    """The record a lock file holds: pid, host, start time (UTC) and command line."""
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join([Path(sys.executable).name, *sys.argv])}


def _write_record(handle: int) -> None:
    os.ftruncate(handle, 0)
    os.pwrite(handle, json.dumps(this_run()).encode(), 0)
    os.fsync(handle)


def _read_record(handle: int) -> dict:
    """The holder's record; empty when it is being written or unreadable (then the message says so)."""
    try:
        record = json.loads(os.pread(handle, 1 << 16, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def describe(holder: dict) -> str:
    """``pid P on host H since T (command)``, from a lock record."""
    if not holder:
        return "a run that is just starting (its lock record is not written yet)"
    command = f" ({holder['command']})" if holder.get("command") else ""
    return f"pid {holder.get('pid')} on host {holder.get('host')} since {holder.get('since')}{command}"


def _in_use_message(path: Path, flag: str, holder: dict) -> str:
    return (f"{flag} {path.parent} is being written by another run: {describe(holder)}; wait for it to finish or "
            f"stop it (lock file {path}), or choose another {flag}: two runs writing one folder corrupt it")


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True


def _is_stale(holder: dict) -> bool:
    """A record whose process is known to be gone: same host, pid no longer running (or no record at all)."""
    if not holder:
        return True
    return holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int) and not pid_alive(holder["pid"])


def _warn_if_stale(path: Path, holder: dict) -> None:
    """Say so, in one short line, when the lock was left behind by a run that died (a finished run deletes its file,
    and so does one stopped by Ctrl-C or SIGTERM, a pipeline's workers included; a killed one leaves it)."""
    if holder:
        gone = "ended" if _is_stale(holder) else "no longer held"
        host = "" if holder.get("host") == socket.gethostname() else f" on {holder.get('host')}"
        print(f"note: {path.parent}: took over the lock left by pid {holder.get('pid')}{host} ({gone})",
              file=sys.stderr, flush=True)
