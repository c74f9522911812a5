"""Run folders (DESIGN.md §3): config.json, run.log, metrics.csv and atomic checkpoints."""

from __future__ import annotations

import contextlib
import csv
import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Iterator

import torch

from utils import loaders
from utils.errors import TaskHetError, disk_full_names, is_disk_full
from utils.locks import folder_entries

LIBRARIES = ("torch", "torchvision", "numpy", "scikit-learn", "pandas", "accelerate", "timm", "flwr")

RUN_LOG = "run.log"  # every run folder's log (and the experiment folder's, pipeline/runner.py)


def git_revision() -> str:
    """The repository's HEAD commit (with '+dirty' for local changes), or 'unknown'."""
    root = Path(__file__).resolve().parent.parent
    try:
        revision = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return revision + ("+dirty" if dirty else "")


def library_versions() -> dict[str, str]:
    """Installed versions of the libraries whose behaviour a run depends on."""
    versions = {"python": sys.version.split()[0]}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def write_config(out_dir: Path, config: dict[str, Any], step: str | None = None) -> dict[str, Any]:
    """Write ``config.json``: every argument plus git revision and library versions.

    ``step`` names the step that owns the folder (:func:`claim_folder` reads it).
    """
    record = {"args": config, "git_revision": git_revision(), "versions": library_versions(), "command": sys.argv,
              "step": step}
    atomic_write_text(Path(out_dir) / "config.json", json.dumps(record, indent=2, default=str, sort_keys=True))
    return record


def atomic_write_text(path: Path, text: str) -> None:
    """Write a text file via a temp file and rename, so a reader never sees half of it."""
    with _atomic_target(path) as temp_name:
        Path(temp_name).write_text(text)


def atomic_copy_file(source: Path, path: Path) -> None:
    """Copy ``source`` to ``path`` via a temp file and rename (a full disk names ``path``, leaves nothing)."""
    with _atomic_target(path) as temp_name:
        shutil.copyfile(source, temp_name)


def atomic_torch_save(obj: Any, path: Path) -> None:
    """torch.save via a temp file and rename: a crash never leaves a truncated checkpoint.

    The bytes depend on ``obj`` only: given a path, torch.save names the archive's records after
    the file (here the temp file's random name), so two identical runs wrote different bytes and
    the stage folders hashed from them differed; given an open file it names them ``archive``.
    Streaming into the file (not into memory first) keeps a large checkpoint's peak memory.
    A full disk is a :class:`utils.errors.DiskFullError` naming ``path``, not torch's
    ``inline_container.cc`` RuntimeError, and leaves no temp file.
    """
    with _atomic_target(path) as temp_name, open(temp_name, "wb") as handle:
        writer = _KeepWriteError(handle)
        try:
            torch.save(obj, writer)
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None
            raise


class _KeepWriteError:
    """A file's ``write``/``flush`` that keeps the OSError torch.save's C++ writer turns into a bare RuntimeError."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle = handle
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.handle.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self.handle.flush()


# Temporary files of atomic writes: a kill between writing and renaming leaves one behind,
# and the next run of the same folder removes it (remove_stale_temporaries).
TEMP_PREFIX, TEMP_SUFFIX = ".partial-", ".tmp"


def remove_stale_temporaries(folder: Path) -> int:
    """Delete the temporary files that killed atomic writes left in ``folder`` (recursively); returns how many.

    Call it only where no other process writes into ``folder`` (the start or resume of its run).
    """
    stale = list(Path(folder).rglob(f"{TEMP_PREFIX}*{TEMP_SUFFIX}")) if Path(folder).is_dir() else []
    for path in stale:
        path.unlink(missing_ok=True)
    return len(stale)


@contextlib.contextmanager
def _atomic_target(path: Path) -> Iterator[str]:
    """A temp file next to ``path`` to write; renamed onto ``path`` on success, removed on failure."""
    path = Path(path)
    with disk_full_names(path, exact=True):
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temp_name = tempfile.mkstemp(dir=path.parent, prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX)
        os.close(handle)
        try:
            yield temp_name
            _fsync(temp_name)
            os.replace(temp_name, path)
        finally:
            if os.path.exists(temp_name):
                os.remove(temp_name)


def _fsync(name: str) -> None:
    # The data must be on disk before the rename: after a power cut the new name must not point at an empty
    # file. The folder is not synced: losing the rename then leaves the old whole file, which is still consistent.
    handle = os.open(name, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def load_checkpoint(path: Path, what: str = "checkpoint", keys: tuple[str, ...] = (), finished: bool = False) -> Any:
    """torch.load with ``weights_only=True``; a missing, empty or foreign file is a named TaskHetError.

    The one checkpoint loader is :func:`utils.loaders.load_checkpoint`; this name stays for its callers.
    """
    return loaders.load_checkpoint(path, what, keys, finished)


# ----- which step a folder belongs to, and whether its run finished -----
def claim_folder(out_dir: Path, step: str, flag: str = "--out") -> None:
    """Refuse to write into ``out_dir`` unless it is missing, empty, or a folder of the same ``step``.

    A step's folder is recognised by the ``step`` its ``config.json`` records (:func:`write_config`).
    Nothing is written here: a refused run leaves the folder as it was.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise TaskHetError(f"{flag} {out_dir} is a file, not a folder")
    if not out_dir.is_dir() or not folder_entries(out_dir):  # a folder holding only its lock is empty
        return
    owner = folder_step(out_dir)
    if owner != step:
        found = f"a folder of {owner}" if owner else "not empty and not a folder of any step (no config.json naming one)"
        raise TaskHetError(f"{flag} {out_dir} is {found}; {step} writes only into its own or an empty folder: "
                           "choose another " + flag)


def folder_step(folder: Path) -> str | None:
    """The step recorded in ``folder/config.json``, or None."""
    path = Path(folder) / "config.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record.get("step") if isinstance(record, dict) else None


@contextlib.contextmanager
def unfinished(out_dir: Path, step: str) -> Iterator[None]:
    """Mark ``out_dir`` ``INCOMPLETE`` while the block runs; the marker goes only when the block succeeds.

    Later steps refuse the outputs of a folder that still has the marker (``finished=True`` of the
    loaders in utils/loaders.py), so a run that failed half-way never looks finished.
    """
    marker = Path(out_dir) / loaders.INCOMPLETE
    atomic_write_text(marker, f"{step} started and has not finished; its outputs must not be used.\n")
    yield
    marker.unlink(missing_ok=True)


def run_logger_name(out_dir: Path) -> str:
    """The name of ``out_dir``'s logger: one logger per run folder, whichever step writes it."""
    return f"taskhet.run.{Path(out_dir).resolve()}"


def setup_logging(out_dir: Path) -> logging.Logger:
    """A logger that writes to the console (stdout: progress, not errors, so it reaches a log file of stdout alone)
    and, with timestamps, to ``out_dir/run.log``; the same logger again while the folder's run goes on. A step
    holds it through :func:`run_log`, which closes it when the step ends."""
    logger = logging.getLogger(run_logger_name(out_dir))
    logger.setLevel(logging.INFO)
    logger.propagate = False
    if not logger.handlers:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        file_handler = _RunLog(Path(out_dir) / RUN_LOG)
        file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        console = logging.StreamHandler(sys.stdout)
        console.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(file_handler)
        logger.addHandler(console)
    return logger


def close_logging(out_dir: Path) -> None:
    """Close ``out_dir``'s run.log and forget its logger (nothing when it has none). Without this a process that runs
    many steps one after another (the pipeline's local executor, a pool worker, a notebook) keeps every run.log
    open, a file descriptor each, until it runs out of them; and logging's registry keeps every logger. A later
    :func:`setup_logging` of the folder, a rerun in the same process, starts a new logger that appends to run.log."""
    logger = logging.Logger.manager.loggerDict.pop(run_logger_name(out_dir), None)  # the registry has no remove call
    if isinstance(logger, logging.Logger):
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
            handler.close()


@contextlib.contextmanager
def run_log(out_dir: Path) -> Iterator[logging.Logger]:
    """``out_dir``'s logger (:func:`setup_logging`) for the block; its run.log closed when the block ends, however."""
    logger = setup_logging(out_dir)
    try:
        yield logger
    finally:
        close_logging(out_dir)


class _RunLog(logging.FileHandler):
    """run.log's handler: a full disk stops the run with one error line naming run.log.

    logging's default prints a "--- Logging error ---" traceback for every record it cannot write
    and goes on; a run whose log cannot be written must stop like one whose metrics cannot.
    """

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if is_disk_full(error):
            with disk_full_names(self.baseFilename, exact=True):
                raise error
        super().handleError(record)


class MetricsCSV:
    """Appends rows to a long-format metrics CSV (header written once).

    ``truncate_after`` lets a resumed run drop rows from after its checkpoint, so
    a resumed run's file ends identical to an uninterrupted one.
    """

    def __init__(self, path: Path, columns: Iterable[str]) -> None:
        self.path = Path(path)
        self.columns = list(columns)
        if not self.path.exists():
            with _atomic_target(self.path) as temp_name, open(temp_name, "w", newline="") as handle:
                csv.writer(handle).writerow(self.columns)

    def write(self, rows: Iterable[dict[str, Any]]) -> None:
        """Append rows (dicts with exactly the columns) and flush.

        A full disk cuts the file back to its previous end (no half row for a resume to read) and is a
        :class:`utils.errors.DiskFullError` naming the file.
        """
        with disk_full_names(self.path, exact=True):
            size = self.path.stat().st_size
            try:
                with self.path.open("a", newline="") as handle:
                    writer = csv.DictWriter(handle, fieldnames=self.columns)
                    for row in rows:
                        writer.writerow({key: _format(value) for key, value in row.items()})
            except OSError:
                os.truncate(self.path, size)
                raise

    def truncate_after(self, column: str, last_kept: int) -> None:
        """Drop rows whose integer ``column`` is greater than ``last_kept``.

        The file is rewritten atomically: a kill during the rewrite leaves the old file whole.
        """
        with self.path.open(newline="") as handle:
            rows = [row for row in csv.DictReader(handle) if int(row[column]) <= last_kept]
        with _atomic_target(self.path) as temp_name, open(temp_name, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=self.columns)
            writer.writeheader()
            writer.writerows(rows)


def _format(value: Any) -> Any:
    # repr-exact floats: a resumed run's CSV must equal an uninterrupted run's byte for byte.
    if isinstance(value, float):
        return repr(value)
    return value
