"""Taskonomy's domains: the one table of file spellings and one documented decoder per domain.

Real files spell two domains differently from their folders
(``segment_semantic/…_domain_segmentsemantic.png``, ``class_scene/…_domain_class_places.npy``);
:data:`DOMAIN_SPECS` is the one place that knows the spellings. Each decoder turns one file into
``(values, own_mask)``: units, scale, invalid code and conventions (segmentation ids raw − 1 with an
ignore index; normals x right, y down, z away from the camera) are documented per decoder and in
``docs/DATA.md``. ``datasets/taskonomy.py`` builds samples and the data family on top of this table.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Mapping, Sequence

import numpy as np

from utils import loaders
from utils.errors import TaskHetError

NUM_SEMANTIC_CLASSES = 17
# Taskonomy's segment_semantic classes, class id = index = raw file value - 1 (raw 0 is unlabelled).
# Background first, then the 16 indoor COCO classes in COCO category order; Taskonomy labelled
# them by distilling an FCIS model trained on COCO. docs/DATA.md says where the names come from.
SEMANTIC_CLASS_NAMES = (
    "background", "bottle", "chair", "couch", "potted_plant", "bed", "dining_table", "toilet", "tv",
    "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock", "vase",
)
# The target value of unlabelled pixels (raw 0, or a raw id above 17): losses and metrics skip it.
# 255 rather than -1 so decoded labels fit the uint8 decoded-sample cache.
SEGMENT_IGNORE_INDEX = 255
NUM_SCENE_SCORES = 365
DEPTH_INVALID = 65535
DEPTH_UNITS_PER_METRE = 512.0
NORMAL_INVALID = 128

Decoded = tuple[np.ndarray, "np.ndarray | None"]


@dataclass(frozen=True)
class DomainSpec:
    """How one domain is stored and decoded.

    Attributes:
        name: domain (and folder) name.
        file_tokens: spellings of the domain in file names; the first is the one written.
        extension: file extension without the dot.
        channels: channels of the decoded array (0 for the per-image class_scene vector).
        decode: path -> (values, validity). ``values`` is float32 ``[C, H, W]`` (int64 ``[H, W]``
            for segment_semantic, bool ``[1, H, W]`` for mask_valid, float32 ``[365]`` for
            class_scene) at the file's resolution; ``validity`` is a bool
            ``[H, W]`` array of the domain's own valid pixels, or None when it marks none invalid.
        interpolation: "bilinear" (rgb) or "nearest" (labels) when resizing; "none" for class_scene.
    """

    name: str
    file_tokens: tuple[str, ...]
    extension: str
    channels: int
    decode: Callable[[Path], Decoded]
    interpolation: str

    @property
    def dense(self) -> bool:
        """True for per-pixel domains (everything but class_scene)."""
        return self.interpolation != "none"

    def file_name(self, point: int, view: int) -> str:
        """The canonical file name of a sample in this domain (real Taskonomy spelling)."""
        return f"point_{point}_view_{view}_domain_{self.file_tokens[0]}.{self.extension}"


def _read_png(path: Path, modes: Sequence[str]) -> np.ndarray:
    """Decode a PNG whose PIL mode is one of ``modes`` into an ``[H, W]`` or ``[H, W, C]`` array."""
    image = loaders.load_image(path, "PNG")
    mode = image.mode
    if mode not in modes:
        raise TaskHetError(f"{path}: PNG mode {mode!r}, expected one of {', '.join(modes)}")
    if mode == "P":
        # Palette images store the class id as the palette index.
        return np.array(image.getdata(), dtype=np.uint8).reshape(image.height, image.width)
    return np.array(image)


def _first_channel(array: np.ndarray) -> np.ndarray:
    return array if array.ndim == 2 else array[..., 0]


def decode_rgb(path: Path) -> Decoded:
    """8-bit RGB(A) PNG -> float32 [3, H, W] in [0, 1]; every pixel valid."""
    pixels = _read_png(path, ("RGB", "RGBA"))[..., :3]
    return pixels.transpose(2, 0, 1).astype(np.float32) / 255.0, None


def decode_depth(path: Path) -> Decoded:
    """16-bit PNG in 1/512 m -> float32 [1, H, W] metres; 65535 = no surface (set to 0, invalid)."""
    raw = _first_channel(_read_png(path, ("I;16", "I;16B", "I"))).astype(np.int64)
    valid = raw != DEPTH_INVALID
    metres = np.where(valid, raw / DEPTH_UNITS_PER_METRE, 0.0).astype(np.float32)
    return metres[None], valid


def decode_normal(path: Path) -> Decoded:
    """8-bit RGB PNG -> float32 [3, H, W] in [-1, 1]; (128,128,128) invalid.

    Camera frame as measured on real omnidata files: x right, y down, z away from the
    camera, so a floor has G < 128, a ceiling G > 128 and a surface facing the camera B < 128.
    """
    pixels = _read_png(path, ("RGB", "RGBA"))[..., :3]
    valid = ~np.all(pixels == NORMAL_INVALID, axis=-1)
    return pixels.transpose(2, 0, 1).astype(np.float32) / 255.0 * 2.0 - 1.0, valid


def decode_reshading(path: Path) -> Decoded:
    """8-bit grey (or RGB, first channel) PNG -> float32 [1, H, W] in [0, 1]."""
    pixels = _first_channel(_read_png(path, ("L", "RGB", "RGBA")))
    return pixels[None].astype(np.float32) / 255.0, None


def decode_segment_semantic(path: Path) -> Decoded:
    """8-bit raw-id PNG -> int64 [H, W]: class = raw - 1 for raw 1..17 (0 = background);
    raw 0 (unlabelled) and raw > 17 -> :data:`SEGMENT_IGNORE_INDEX`. As Taskonomy's own loader."""
    raw = _first_channel(_read_png(path, ("L", "P", "RGB", "RGBA"))).astype(np.int64)
    labelled = (raw >= 1) & (raw <= NUM_SEMANTIC_CLASSES)
    return np.where(labelled, raw - 1, SEGMENT_IGNORE_INDEX), None


def decode_unit16(path: Path) -> Decoded:
    """16-bit PNG -> float32 [1, H, W] = value / 65535 (edges, keypoints)."""
    raw = _first_channel(_read_png(path, ("I;16", "I;16B", "I")))
    return raw[None].astype(np.float32) / 65535.0, None


def decode_principal_curvature(path: Path) -> Decoded:
    """8-bit RGB PNG -> float32 [2, H, W] = first two channels / 255; (0, 0) invalid (omnidata mask_val 0)."""
    pixels = _read_png(path, ("RGB", "RGBA"))[..., :2]
    valid = np.any(pixels != 0, axis=-1)
    return pixels.transpose(2, 0, 1).astype(np.float32) / 255.0, valid


def decode_mask_valid(path: Path) -> Decoded:
    """8/16-bit PNG -> bool [1, H, W]; 0 = invalid."""
    valid = _first_channel(_read_png(path, ("L", "1", "I;16", "I;16B", "I", "RGB"))) > 0
    return valid[None], valid


def decode_class_scene(path: Path) -> Decoded:
    """.npy of 365 Places365 scores -> float32 [365]."""
    scores = loaders.load_npy(path, "class_scene scores", shape=(NUM_SCENE_SCORES,))  # NaN never labels class 0
    return scores.astype(np.float32), None


DOMAIN_SPECS: Mapping[str, DomainSpec] = MappingProxyType(
    {
        spec.name: spec
        for spec in (
            DomainSpec("rgb", ("rgb",), "png", 3, decode_rgb, "bilinear"),
            DomainSpec("depth_euclidean", ("depth_euclidean",), "png", 1, decode_depth, "nearest"),
            DomainSpec("depth_zbuffer", ("depth_zbuffer",), "png", 1, decode_depth, "nearest"),
            DomainSpec("normal", ("normal", "normals"), "png", 3, decode_normal, "nearest"),
            DomainSpec("reshading", ("reshading",), "png", 1, decode_reshading, "nearest"),
            DomainSpec("segment_semantic", ("segmentsemantic", "segment_semantic"), "png", 1, decode_segment_semantic, "nearest"),
            DomainSpec("edge_texture", ("edge_texture",), "png", 1, decode_unit16, "nearest"),
            DomainSpec("edge_occlusion", ("edge_occlusion",), "png", 1, decode_unit16, "nearest"),
            DomainSpec("keypoints2d", ("keypoints2d",), "png", 1, decode_unit16, "nearest"),
            DomainSpec("keypoints3d", ("keypoints3d",), "png", 1, decode_unit16, "nearest"),
            DomainSpec("principal_curvature", ("principal_curvature", "curvature"), "png", 2, decode_principal_curvature, "nearest"),
            DomainSpec("mask_valid", ("mask_valid",), "png", 1, decode_mask_valid, "nearest"),
            DomainSpec("class_scene", ("class_places", "class_scene"), "npy", 0, decode_class_scene, "none"),
        )
    }
)
DOMAINS = tuple(DOMAIN_SPECS)
# A task is named after the domain holding its target; rgb is the input and mask_valid only masks.
TASKS = tuple(domain for domain in DOMAINS if domain not in ("rgb", "mask_valid"))


def get_domain(name: str) -> DomainSpec:
    """The spec of a domain; a :class:`TaskHetError` listing the known domains otherwise."""
    if name not in DOMAIN_SPECS:
        raise TaskHetError(f"unknown domain {name!r}; known domains: {', '.join(DOMAINS)}")
    return DOMAIN_SPECS[name]
