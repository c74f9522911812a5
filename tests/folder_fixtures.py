"""Tiny folders of a user's own images, for the folder data families (imagefolder, paired_folders).

Builders, not fixtures: each test makes its folder in its own ``tmp_path`` (a few kB, milliseconds), so a
test that breaks a file breaks only its own copy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml
from PIL import Image

IMAGE_SIZE = (12, 10)  # width, height: not square, as a user's photos are not
CLASSES = ("cat", "dog", "owl")
PAIRED_TARGETS = {
    "depth": {"kind": "regression", "channels": 1, "scale": 1000, "ignore": 0},
    "semantic": {"kind": "segmentation", "classes": 3, "ignore": 255},
    "boundaries": {"kind": "edges"},
}


def save_rgb(path: Path, pixels: np.ndarray) -> Path:
    """uint8 ``[H, W, 3]`` as an image file (the format from the extension)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels, mode="RGB").save(path)
    return path


def class_image(label: int, index: int, size: tuple[int, int] = IMAGE_SIZE) -> np.ndarray:
    """An image whose colour tells its class (a step-2 model can learn it), with a little seeded noise."""
    rng = np.random.default_rng(100 * label + index)
    base = np.zeros((size[1], size[0], 3), dtype=np.int64)
    base[..., label % 3] = 200
    return np.clip(base + rng.integers(0, 40, base.shape), 0, 255).astype(np.uint8)


def write_imagefolder(root: Path, per_class: int = 6, classes: tuple[str, ...] = CLASSES) -> Path:
    """``root/<class>/<class>_<i>.png`` (one ``.JPG`` per class: extensions count in any case); returns root."""
    for label, name in enumerate(classes):
        for index in range(per_class):
            suffix = ".JPG" if index == per_class - 1 else ".png"
            save_rgb(root / name / f"{name}_{index}{suffix}", class_image(label, index))
    return root


def paired_sample(index: int, size: tuple[int, int] = IMAGE_SIZE) -> dict[str, np.ndarray]:
    """One image and its three targets: depth in mm (0 = no depth), 3 classes (255 = unlabelled), edges 0/255."""
    width, height = size
    rng = np.random.default_rng(index)
    image = rng.integers(0, 256, (height, width, 3)).astype(np.uint8)
    depth = (500 + 100 * index + 10 * np.arange(width)[None, :] + np.zeros((height, 1))).astype(np.uint16)
    depth[0, 0] = 0
    semantic = (np.arange(width)[None, :] // 4 + np.zeros((height, 1), dtype=np.int64)).astype(np.int64) % 3
    semantic[-1, :] = 255
    edges = np.zeros((height, width), dtype=np.uint8)
    edges[:, index % width] = 255
    return {"image": image, "depth": depth, "semantic": semantic, "boundaries": edges}


def write_paired_folders(root: Path, n_images: int = 12, labels: bool = True, sources: bool = True) -> Path:
    """``images/img_<i>.png`` with depth (16-bit PNG), semantic (.npy) and boundaries (8-bit PNG), targets.yaml and,
    unless both are off, groups.csv (labels ``a``/``b`` by parity, sources ``s0``..``s3``); returns root."""
    for index in range(n_images):
        sample = paired_sample(index)
        stem = f"img_{index:02d}"
        save_rgb(root / "images" / f"{stem}.png", sample["image"])
        (root / "depth").mkdir(parents=True, exist_ok=True)
        Image.fromarray(sample["depth"]).save(root / "depth" / f"{stem}.png")
        (root / "semantic").mkdir(exist_ok=True)
        np.save(root / "semantic" / f"{stem}.npy", sample["semantic"])
        (root / "boundaries").mkdir(exist_ok=True)
        Image.fromarray(sample["boundaries"], mode="L").save(root / "boundaries" / f"{stem}.png")
    (root / "targets.yaml").write_text(yaml.safe_dump(PAIRED_TARGETS, sort_keys=False))
    columns = (["label"] if labels else []) + (["source"] if sources else [])
    if columns:
        lines = ["stem," + ",".join(columns)]
        for index in range(n_images):
            values = (["ab"[index % 2]] if labels else []) + ([f"s{index % 4}"] if sources else [])
            lines.append(f"img_{index:02d}," + ",".join(values))
        (root / "groups.csv").write_text("\n".join(lines) + "\n")
    return root
