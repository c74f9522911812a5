"""One loader per kind of file a step reads, and the checks every value read from a file passes.

Every file a step reads goes through one of these loaders: a missing, empty, truncated or
foreign file is a :class:`TaskHetError` that names the file and what was expected, never a
raw ``EOFError`` or ``EmptyDataError``. ``what`` is the caller's description of the file
(``"--checkpoint (a step-2 best.pt)"``), so the message says which input is wrong.

Values read from files are checked by the helpers below: numbers must be finite, ids integral
and in range (:func:`int_column`, :func:`finite_column`), and paths must stay inside their root
(:func:`inside_root`; names are plain names, :func:`plain_name`). Each error names the file, the
row (header = line 1) and the column.

Pickles are never read with plain :mod:`pickle`: :func:`load_data_pickle` admits only plain data and
numpy arrays (dataset files such as CIFAR's), and checkpoints go through ``torch.load(weights_only=True)``.
Every ``.npy`` file goes through :func:`load_npy`, which reads its header first (:func:`check_npy_header`): a
pickled array, an ``.npz`` archive, or a header claiming other than the bytes the file holds is refused before numpy
allocates or maps anything.

Folders of steps that did not finish hold an ``INCOMPLETE`` marker (utils/run_dir.py):
``finished=True`` makes a loader refuse a file from such a folder.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd
from numpy._core.multiarray import _reconstruct  # numpy >= 2 (requirements.txt)

from utils.errors import TaskHetError

# Written into a run folder before its step starts, removed after its last output (utils/run_dir.py).
INCOMPLETE = "INCOMPLETE"
# A plain name: no separators, no "..", nothing a shell or a path join could read as a place.
PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# An error message lists at most this many bad rows.
MAX_LISTED = 10
# The only globals a pickle of plain data and numpy arrays needs, and the objects they are: what ``ndarray`` and
# ``dtype`` reduce to. Python 2 and numpy 1.x wrote numpy.core.multiarray (the official CIFAR files), numpy 2 writes
# numpy._core.multiarray; both name the one function. Looked up here, never imported by the name a file gives.
# Dicts, lists, tuples, str, bytes, ints, floats, bools and None need no global: they are pickle opcodes.
ARRAY_PICKLE_GLOBALS = {("numpy.core.multiarray", "_reconstruct"): _reconstruct,
                        ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
                        ("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}


def require_file(path: Path, what: str, hint: str = "") -> Path:
    """``path`` as a Path if it is an existing regular file; a TaskHetError naming ``what`` (and ``hint``) otherwise."""
    path = Path(path)
    if path.is_dir():
        raise TaskHetError(f"{what} {path} is a folder, not a file")
    if not path.is_file():
        raise TaskHetError(f"{what} {path} does not exist" + (f" ({hint})" if hint else ""))
    return path


def require_finished(path: Path, what: str) -> None:
    """Refuse ``path`` when its folder belongs to a run that did not finish (it holds ``INCOMPLETE``)."""
    marker = Path(path).parent / INCOMPLETE
    if marker.is_file():
        raise TaskHetError(f"{what} {path} comes from a run that did not finish ({marker} exists); "
                           "finish or rerun that step first")


def load_checkpoint(path: Path, what: str = "checkpoint", keys: Sequence[str] = (), finished: bool = False,
                    hint: str = "") -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU, with every failure named.

    Args:
        path: the file.
        what: what the file is, for the message (``"--checkpoint (a step-2 best.pt)"``).
        keys: entries the loaded dict must have (then it must be a dict).
        finished: refuse a file from a folder marked ``INCOMPLETE``.
        hint: what to do when the file is missing.

    Raises:
        TaskHetError: missing, empty, not a torch checkpoint, or lacking ``keys``.
    """
    import torch

    path = require_file(path, what, hint)
    if finished:
        require_finished(path, what)
    if path.stat().st_size == 0:
        raise TaskHetError(f"{what} {path} is empty (0 bytes): expected a torch checkpoint")
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except (EOFError, IndexError, KeyError, ValueError, RuntimeError, pickle.UnpicklingError, zipfile.BadZipFile,
            UnicodeDecodeError, AttributeError, TypeError) as error:
        raise TaskHetError(f"{what} {path} is not a readable torch checkpoint "
                           f"({type(error).__name__}: {_first_line(error)})") from None
    if keys:
        missing = [key for key in keys if not isinstance(loaded, dict) or key not in loaded]
        if missing:
            raise TaskHetError(f"{what} {path} lacks {', '.join(map(repr, missing))}: not the checkpoint expected")
    return loaded


class _RefusedGlobal(pickle.UnpicklingError):
    """A pickle asked for a global outside :data:`ARRAY_PICKLE_GLOBALS`."""


class _DataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose :meth:`find_class` admits only :data:`ARRAY_PICKLE_GLOBALS`.

    A pickle runs code only through the globals it names (any callable, reached by GLOBAL /
    STACK_GLOBAL / INST / OBJ / EXT opcodes, all of which go through ``find_class``); with these four
    it can only build numpy arrays. Persistent ids stay refused (pickle's default).
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ARRAY_PICKLE_GLOBALS:
            raise _RefusedGlobal(f"{module}.{name}")
        return ARRAY_PICKLE_GLOBALS[module, name]


def load_data_pickle(path: Path, what: str, encoding: str = "latin1") -> Any:
    """A pickle of plain data and numpy arrays (a dataset file), read without running any code it carries.

    Args:
        path: the file.
        what: what the file is, for the message (``"cifar10 file"``).
        encoding: how Python 2 ``str`` objects decode; ``latin1`` keeps numpy's raw array bytes
            exact (the reading the CIFAR page and torchvision use).

    Raises:
        TaskHetError: missing, empty, truncated or not a pickle, or needing any global beyond
            :data:`ARRAY_PICKLE_GLOBALS` (named; nothing of the file has run).
    """
    path = require_file(path, what)
    if path.stat().st_size == 0:
        raise TaskHetError(f"{what} {path} is empty (0 bytes): expected a pickle of data")
    try:
        with open(path, "rb") as file:
            return _DataUnpickler(file, encoding=encoding).load()
    except _RefusedGlobal as error:
        raise TaskHetError(f"{what} {path} asks for the Python object {error} while loading; a data file needs only "
                           "dicts, lists, strings, numbers and numpy arrays, so it is refused unread (a pickle can "
                           "run code)") from None
    except Exception as error:  # noqa: BLE001 - nothing of the file can run here, so any failure means a malformed file
        raise TaskHetError(f"{what} {path} is truncated or not a pickle of data ({error_summary(error)})") from None


def read_csv(path: Path, what: str, columns: Sequence[str] = (), finished: bool = False, hint: str = "",
             **options: Any) -> pd.DataFrame:
    """``pandas.read_csv`` with an empty, unreadable or column-less file named.

    Args:
        path: the file.
        what: what the file is, for the message.
        columns: columns the file must have.
        finished: refuse a file from a folder marked ``INCOMPLETE``.
        hint: what to do when the file is missing (``"run step 1 first"``).
        options: passed to ``pandas.read_csv`` (``dtype=str, keep_default_na=False`` are typical).
    """
    path = require_file(path, what, hint)
    if finished:
        require_finished(path, what)
    try:
        table = pd.read_csv(path, **options)
    except pd.errors.EmptyDataError:
        raise TaskHetError(f"{what} {path} is empty: expected a CSV with a header"
                           + (f" ({', '.join(columns)})" if columns else "")) from None
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError) as error:
        raise TaskHetError(f"{what} {path} is not a readable CSV ({_first_line(error)})") from None
    missing = [column for column in columns if column not in table.columns]
    if missing:
        raise TaskHetError(f"{what} {path}: missing column(s) {', '.join(missing)}; expected {', '.join(columns)}")
    return table


# The first bytes of a zip file: an .npz archive, which numpy.load would open as a lazy mapping of members.
ZIP_MAGIC = b"PK\x03\x04"


def npy_header(path: Path, what: str) -> tuple[tuple[int, ...], np.dtype, int]:
    """``(shape, dtype, bytes of data after the header)`` of a ``.npy`` file, from its header alone.

    Raises:
        TaskHetError: an .npz archive, or no .npy header (or a format version other than 1.0 and 2.0, the ones
            numpy writes for numbers).
    """
    try:
        with open(path, "rb") as file:
            if file.read(len(ZIP_MAGIC)) == ZIP_MAGIC:
                raise TaskHetError(f"{what} {path} is an .npz archive, expected one .npy array")
            file.seek(0)
            version = np.lib.format.read_magic(file)
            if version not in ((1, 0), (2, 0)):
                raise ValueError(f"format version {version[0]}.{version[1]}, expected 1.0 or 2.0 (numpy.save of numbers)")
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = read_header(file)
            return tuple(shape), dtype, os.fstat(file.fileno()).st_size - file.tell()
    except (OSError, ValueError, EOFError) as error:
        raise TaskHetError(f"{what} {path} is not a readable .npy array ({_first_line(error)})") from None


def check_npy_header(path: Path, what: str) -> tuple[tuple[int, ...], np.dtype]:
    """The ``(shape, dtype)`` of a ``.npy`` file's header, refused before numpy reads the file: an object (pickled)
    dtype, a negative size, or data after the header that is not exactly shape x item size bytes (a header may
    claim any shape: numpy would allocate it all before reading, or grow a memory-mapped file to it).

    Raises:
        TaskHetError: naming the file, the claimed shape and dtype, and the bytes the file holds.
    """
    shape, dtype, held = npy_header(path, what)
    if dtype.hasobject:
        raise TaskHetError(f"{what} {path} holds Python objects (dtype {dtype}), which are never unpickled; save an array "
                           "of numbers")
    if any(size < 0 for size in shape):
        raise TaskHetError(f"{what} {path}: its header claims shape {shape}, with a negative size; the file is damaged "
                           "or not what it says")
    claimed = math.prod(shape) * dtype.itemsize  # Python integers: a huge shape cannot overflow
    if claimed != held:
        raise TaskHetError(f"{what} {path}: its header claims shape {shape} of {dtype} ({claimed} bytes of data) but "
                           f"the file holds {held} bytes after its header; the file is damaged or not what it says")
    return shape, dtype


def load_npy(path: Path, what: str, shape: tuple[int, ...] | None = None, finite: bool = True,
             finished: bool = False, mmap_mode: str | None = None) -> np.ndarray:
    """``numpy.load`` (no pickles) of a ``.npy`` file whose header passed :func:`check_npy_header`, with the shape
    (from the header, before any data is read) and the finiteness checked. An ``.npz`` archive is refused unread.

    Args:
        shape: the expected shape; ``-1`` in a dimension accepts any size.
        finite: refuse NaN and infinite values (floating arrays); this reads every value, so a memory-mapped read
            usually passes False.
        finished: refuse a file from a folder marked ``INCOMPLETE``.
        mmap_mode: ``numpy.load``'s (``"r"``, ``"r+"``, ...), or None to read the array into memory.
    """
    path = require_file(path, what)
    if finished:
        require_finished(path, what)
    found, _ = check_npy_header(path, what)
    if shape is not None and (len(found) != len(shape) or any(want not in (-1, got) for want, got in zip(shape, found))):
        wanted = "x".join("N" if size == -1 else str(size) for size in shape)
        raise TaskHetError(f"{what} {path} has shape {found}, expected {wanted}")
    try:
        array = np.load(path, allow_pickle=False, mmap_mode=mmap_mode)
    except (OSError, ValueError, EOFError) as error:
        raise TaskHetError(f"{what} {path} is not a readable .npy array ({_first_line(error)})") from None
    if finite and np.issubdtype(array.dtype, np.number) and not np.isfinite(array).all():
        index = tuple(int(i) for i in np.argwhere(~np.isfinite(array))[0])
        raise TaskHetError(f"{what} {path} holds a non-finite value ({array[index]}) at index {index}")
    return array


def load_json(path: Path, what: str, finished: bool = False) -> Any:
    """A JSON file's value; an empty or invalid file is named with the line of the problem."""
    path = require_file(path, what)
    if finished:
        require_finished(path, what)
    try:
        return json.loads(path.read_text())
    except UnicodeDecodeError:
        raise TaskHetError(f"{what} {path} is not a text file: expected JSON") from None
    except json.JSONDecodeError as error:
        raise TaskHetError(f"{what} {path} is not valid JSON (line {error.lineno}: {error.msg})") from None


def load_yaml(path: Path, what: str) -> Any:
    """A YAML file's value (a safe loader: no Python objects); an empty file is an error, and so is a YAML 1.1
    number or boolean form whose reading a writer may not mean (``010`` is 8, ``yes`` is true: utils/plain_yaml.py)."""
    import yaml

    from utils import plain_yaml

    path = require_file(path, what)
    try:
        text = path.read_text()
        value = plain_yaml.load(text)
    except UnicodeDecodeError:
        raise TaskHetError(f"{what} {path} is not a text file: expected YAML") from None
    except yaml.YAMLError as error:
        raise TaskHetError(f"{what} {path} is not valid YAML ({' '.join(str(error).split())})") from None
    if value is None:
        raise TaskHetError(f"{what} {path} is empty: expected a mapping of keys")
    found = plain_yaml.check_plain(value)
    if found is not None:
        key, scalar = found
        raise TaskHetError(f"{what} {path}, line {scalar.line}: {key + ': ' if key else ''}{scalar.reason()}")
    return value


def load_image(path: Path, what: str = "image"):
    """A fully decoded ``PIL.Image`` (loaded, file closed); unreadable or truncated files are named."""
    from PIL import Image, UnidentifiedImageError

    path = require_file(path, what)
    try:
        with Image.open(path) as image:
            image.load()
            return image.copy()
    except (OSError, ValueError, SyntaxError, UnidentifiedImageError, Image.DecompressionBombError) as error:
        raise TaskHetError(f"{what} {path} is not a readable image ({_first_line(error)})") from None


# ----- values read from files -----
def plain_name(text: Any, what: str) -> str:
    """``text`` if it is a plain name (letters, digits, ``._-``; not starting with a dot): no path can hide in it."""
    if not isinstance(text, str) or not PLAIN_NAME.fullmatch(text):
        raise TaskHetError(f"{what} must be a plain name (letters, digits, '.', '_', '-'; not starting with '.' "
                           f"or '-'), got {text!r}")
    return text


def inside_root(root: Path, relative: str | Path, what: str) -> Path:
    """``root / relative``, refused unless ``relative`` is a relative path that stays inside ``root``.

    The check is on the path as written (no ``..``, not absolute, no drive): a file named in a
    manifest can only point inside the data root. Symbolic links inside the root are the
    owner's choice and are followed (README: "What TaskHet guarantees").
    """
    text = str(relative)
    candidate = Path(text)
    if not text or candidate.is_absolute() or candidate.drive or ".." in candidate.parts or text.startswith("~"):
        raise TaskHetError(f"{what} {text!r} must be a path relative to {root} without '..'")
    return Path(root) / candidate


def finite_column(table: pd.DataFrame, column: str, source: str, low: float | None = None,
                  high: float | None = None, rows: pd.Series | None = None) -> pd.Series:
    """``table[column]`` as float64, every cell finite and in ``[low, high]``; bad rows named.

    ``rows`` gives the file's line numbers (default: index + 2, the header being line 1).
    """
    values = pd.to_numeric(table[column], errors="coerce").astype(np.float64)
    bad = ~np.isfinite(values)
    if low is not None:
        bad |= values < low
    if high is not None:
        bad |= values > high
    _raise_rows(table, column, bad, source, rows, _range_text("a finite number", low, high))
    return values


def int_column(table: pd.DataFrame, column: str, source: str, low: int | None = None,
               high: int | None = None, rows: pd.Series | None = None) -> pd.Series:
    """``table[column]`` as int64: every cell a finite integer in ``[low, high]`` (an id); bad rows named.

    Cells like ``1e30``, ``inf`` or ``2.5`` are refused before any cast, so nothing overflows.
    """
    values = pd.to_numeric(table[column], errors="coerce").astype(np.float64)
    bounded = np.isfinite(values) & (values.abs() < 2**53)
    bad = ~bounded | (values != values.round())
    if low is not None:
        bad |= values < low
    if high is not None:
        bad |= values > high
    _raise_rows(table, column, bad, source, rows, _range_text("an integer", low, high))
    return values.astype(np.int64)


def _range_text(kind: str, low: float | None, high: float | None) -> str:
    if low is not None and high is not None:
        return f"{kind} in [{low}, {high}]"
    if low is not None:
        return f"{kind} >= {low}"
    if high is not None:
        return f"{kind} <= {high}"
    return kind


def _raise_rows(table: pd.DataFrame, column: str, bad: pd.Series, source: str, rows: pd.Series | None,
                expected: str) -> None:
    bad = np.asarray(bad, dtype=bool)
    if not bad.any():
        return
    lines = (np.asarray(rows) if rows is not None else np.arange(len(table)) + 2)[bad]
    cells = table[column].to_numpy()[bad]
    listed = ", ".join(f"row {line} ({cell!r})" for line, cell in list(zip(lines, cells))[:MAX_LISTED])
    more = f" ... ({int(bad.sum())} rows in all)" if bad.sum() > MAX_LISTED else ""
    raise TaskHetError(f"{source}: column {column!r} must be {expected}: {listed}{more}")


def error_summary(error: BaseException) -> str:
    """``"TypeName: first line of the message"``: what a one-line error says about a library's exception."""
    return f"{type(error).__name__}: {_first_line(error)}"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
