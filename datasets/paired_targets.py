"""The dense targets of the ``paired_folders`` family: ``targets.yaml``, and reading and decoding one target file.

``targets.yaml`` at the data root declares each target folder (its name is the folder's)::

    depth:                # root/depth/<stem>.png or .npy
      kind: regression    # regression | segmentation | edges
      channels: 1         # regression: channels of the target
      scale: 1000         # regression: target = stored value / scale (a 16-bit PNG in mm -> metres); default 1
      ignore: 0           # stored value of a pixel without a target (masked out of loss and metrics); optional
    semantic:
      kind: segmentation
      classes: 6          # class ids 0..5, 2 to 255 classes
      ignore: 255         # stored value of unlabelled pixels; optional
    boundaries:
      kind: edges         # binary: 0 = no edge, any other value = edge (but ignore); one channel
      ignore: 128         # optional, never 0

A target file is a PNG (8 or 16 bits, grey, palette, RGB or RGBA; a palette PNG gives its indices, as segmentation
masks are usually stored) or a ``.npy`` array (``numpy.load(allow_pickle=False)``; ``[H, W]`` or ``[H, W, C]``, the
layout of a PNG's pixels; numbers only, every value finite). Its height and width are the image's. A ``.npy``
header is checked before its data is read: its shape times its dtype's item size must be exactly the bytes after
the header (a header claiming a huge shape would otherwise make numpy allocate it), and an object (pickled) dtype
is refused (:func:`utils.loaders.check_npy_header`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from datasets.taskonomy_domains import SEGMENT_IGNORE_INDEX
from utils import cli
from utils.errors import TaskHetError
from utils.loaders import load_image, load_npy, load_yaml, plain_name

TARGETS_FILE = "targets.yaml"
KINDS = ("regression", "segmentation", "edges")
TARGET_EXTENSIONS = (".png", ".npy")
# The keys each kind takes (besides kind); the first one listed is required where it is not a default.
KIND_KEYS = {"regression": ("channels", "scale", "ignore"), "segmentation": ("classes", "ignore"), "edges": ("ignore",)}
CHANNELS = cli.ints(1, 64)
# Class ids 0..254: the decoder writes SEGMENT_IGNORE_INDEX (255) where a pixel has no label, as Taskonomy's does.
CLASSES = cli.ints(2, SEGMENT_IGNORE_INDEX)
SCALES = cli.floats(0.0, 1e9, low_open=True)
IGNORE_VALUES = cli.floats(-1e12, 1e12)
RESERVED_NAMES = ("images",)  # the input folder


@dataclass(frozen=True)
class TargetSpec:
    """One declared target.

    Attributes:
        name: the target's folder under the data root.
        kind: "regression", "segmentation" or "edges".
        channels: regression: the target's channels; segmentation: its classes; edges: 1.
        scale: regression: the target is the stored value divided by it; 1.0 for the other kinds.
        ignore: the stored value of a pixel without a target (regression: every channel equals it), or None.
    """

    name: str
    kind: str
    channels: int
    scale: float = 1.0
    ignore: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "channels": self.channels, "scale": self.scale, "ignore": self.ignore}


def make_spec(name: Any, fields: Any, where: str) -> TargetSpec:
    """A :class:`TargetSpec` from one entry of targets.yaml (or a manifest's columns); one error naming ``where``."""
    plain_name(name, f"{where}: a target's name (its folder)")
    if name in RESERVED_NAMES:
        raise TaskHetError(f"{where}: target {name!r}: the folder {name}/ holds the input images and cannot be a target")
    where = f"{where}: target {name!r}"
    if not isinstance(fields, dict):
        raise TaskHetError(f"{where} must be a mapping (kind: ..., and its keys)")
    kind = fields.get("kind")
    if kind not in KINDS:
        raise TaskHetError(f"{where}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    unknown = sorted(str(key) for key in fields if key != "kind" and key not in KIND_KEYS[kind])
    if unknown:
        raise TaskHetError(f"{where}: unknown key {unknown[0]!r} for kind {kind}; its keys: kind, {', '.join(KIND_KEYS[kind])}")
    ignore = None if fields.get("ignore") is None else _number(IGNORE_VALUES, fields["ignore"], f"{where}: ignore")
    if kind == "regression":
        if "channels" not in fields:
            raise TaskHetError(f"{where}: a regression target needs channels (1 for depth, 3 for normals, ...)")
        channels = int(_number(CHANNELS, fields["channels"], f"{where}: channels"))
        scale = _number(SCALES, fields.get("scale", 1.0), f"{where}: scale")
        return TargetSpec(name, kind, channels, scale, ignore)
    if kind == "segmentation":
        if "classes" not in fields:
            raise TaskHetError(f"{where}: a segmentation target needs classes (its class ids are 0..classes-1)")
        classes = int(_number(CLASSES, fields["classes"], f"{where}: classes"))
        if ignore is not None and (ignore != round(ignore) or 0 <= ignore < classes):
            raise TaskHetError(f"{where}: ignore {ignore:g} must be a whole number outside the class ids 0..{classes - 1}")
        return TargetSpec(name, kind, classes, 1.0, ignore)
    if ignore == 0:
        raise TaskHetError(f"{where}: ignore cannot be 0, which marks a pixel without an edge")
    return TargetSpec(name, kind, 1, 1.0, ignore)


def _number(kind: cli.Range, value: Any, where: str) -> float:
    """A YAML or manifest value as a number in ``kind``'s range (text such as "1000" read as a number)."""
    if isinstance(value, str):
        try:
            return kind.parse(value)
        except ValueError as error:
            raise TaskHetError(f"{where} {error}") from None
    try:
        return kind.check(value)
    except ValueError as error:
        raise TaskHetError(f"{where} {error}") from None


def read_targets(root: Path, names: list[str] | None = None) -> list[TargetSpec]:
    """The targets ``root/targets.yaml`` declares (those of ``names`` when given, in their order), at most one per
    kind; every target folder exists.

    Raises:
        TaskHetError: a missing or malformed file, an entry that is not a target, a name ``names`` gives that the
            file does not declare, two targets of one kind, a missing folder; each names the file or flag.
    """
    path = Path(root) / TARGETS_FILE
    if not path.is_file():
        raise TaskHetError(f"{path} does not exist: paired_folders needs it to declare each target folder's kind "
                           "(docs/DATA.md, \"Your own images\")")
    declared = load_yaml(path, "targets file")
    if not isinstance(declared, dict) or not declared:
        raise TaskHetError(f"targets file {path} must map each target folder's name to its kind and keys")
    specs = {str(name): make_spec(name, fields, str(path)) for name, fields in declared.items()}
    if names:
        unknown = [name for name in names if name not in specs]
        if unknown:
            raise TaskHetError(f"--targets: {unknown[0]!r} is not declared in {path}; it declares {', '.join(specs)}")
        specs = {name: specs[name] for name in dict.fromkeys(names)}
    for kind in KINDS:
        same = [name for name, spec in specs.items() if spec.kind == kind]
        if len(same) > 1:
            raise TaskHetError(f"{path}: {' and '.join(same)} are both {kind} targets, but a manifest holds one target "
                               f"of each kind (one task each); choose with --targets, e.g. --targets {same[0]}")
    for name in specs:
        if not (Path(root) / name).is_dir():
            raise TaskHetError(f"target folder {Path(root) / name} does not exist ({path} declares {name!r})")
    return list(specs.values())


def read_target(path: Path, spec: TargetSpec) -> np.ndarray:
    """A target file's stored values as ``[C, H, W]`` (PNG pixels or the .npy array), its channels checked.

    Raises:
        TaskHetError: unreadable, not numbers, or with other channels than ``spec`` declares; naming the file.
    """
    what = f"{spec.name} target"
    if path.suffix.lower() == ".npy":
        raw = load_npy(path, what)  # its header checked first: no pickles, exactly shape x item size bytes
        if raw.dtype.kind not in "biuf":
            raise TaskHetError(f"{what} {path} holds {raw.dtype} values, expected numbers")
    else:
        raw = np.asarray(load_image(path, what))
    if raw.ndim not in (2, 3):
        raise TaskHetError(f"{what} {path} has shape {tuple(raw.shape)}, expected [H, W] or [H, W, C]")
    raw = raw[None] if raw.ndim == 2 else np.moveaxis(raw, -1, 0)
    wanted = spec.channels if spec.kind == "regression" else 1
    if raw.shape[0] != wanted:
        raise TaskHetError(f"{what} {path} has {raw.shape[0]} channel(s), expected {wanted} ({spec.kind}"
                           + (f", channels {spec.channels} in {TARGETS_FILE})" if spec.kind == "regression" else ")"))
    return raw


def decode_target(raw: np.ndarray, spec: TargetSpec, path: Path) -> tuple[np.ndarray, np.ndarray]:
    """``(target, valid)`` of stored values ``raw`` ``[C, H, W]``; ``valid`` is bool ``[H, W]``.

    Regression: float32 ``[C, H, W]`` = raw / scale, a pixel invalid where every channel equals ``ignore``.
    Segmentation: uint8 ``[H, W]`` class ids, :data:`SEGMENT_IGNORE_INDEX` where raw equals ``ignore``.
    Edges: float32 ``[1, H, W]``, 1 where raw is neither 0 nor ``ignore``.

    Raises:
        TaskHetError: a segmentation value that is not a class id (nor ignore), naming the file and the value.
    """
    values = raw.astype(np.float64)
    if spec.kind == "regression":
        valid = np.ones(raw.shape[1:], dtype=bool) if spec.ignore is None else ~(values == spec.ignore).all(axis=0)
        return (values / spec.scale).astype(np.float32), valid
    valid = np.ones(raw.shape[1:], dtype=bool) if spec.ignore is None else values[0] != spec.ignore
    if spec.kind == "edges":
        return ((values[0] != 0) & valid).astype(np.float32)[None], valid
    labels = values[0]
    bad = valid & ((labels != np.round(labels)) | (labels < 0) | (labels >= spec.channels))
    if bad.any():
        row, column = (int(i) for i in np.argwhere(bad)[0])
        ignore = "" if spec.ignore is None else f" or ignore {spec.ignore:g}"
        raise TaskHetError(f"{spec.name} target {path}: pixel (row {row}, column {column}) holds {labels[row, column]:g}, "
                           f"not a class id 0..{spec.channels - 1}{ignore} ({int(bad.sum())} such pixels; classes and "
                           f"ignore in {TARGETS_FILE})")
    return np.where(valid, labels, SEGMENT_IGNORE_INDEX).astype(np.uint8), valid
