"""How step 4 applies a client's recorded skews to its batches (partitioning/skews.py draws and records them).

:class:`ClientSkew` is a DataLoader ``collate_fn``: the default collation, then the client's feature
transforms (image shifts, then noise) and its concept transforms (a label permutation, or a target
variant's domain renamed to the task's). The transforms are small frozen dataclasses, so DataLoader
workers can receive them; :func:`partitioning.skews.client_skews` builds a client's from the record.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
from torch.utils.data import default_collate

from utils.seeding import torch_generator

# Transformed images a client keeps (bytes): a digits or CIFAR client's whole share at 32 px is a few MB; a
# Taskonomy client at 224 px fills it after ~400 images and recomputes the rest at every access.
MEMO_BYTES = 256 * 2**20


@dataclass(frozen=True)
class AddNoise:
    """Adds σ·N(0, 1) to each image; a sample's noise is seeded by (``seed``, its sample id)."""

    input_key: str
    sigma: float
    seed: int

    def __call__(self, batch: dict) -> dict:
        images = batch[self.input_key]
        noise = torch.stack([torch.randn(images.shape[1:], generator=torch_generator(self.seed, sample_id))
                             for sample_id in batch["sample_id"]])
        return {**batch, self.input_key: images + self.sigma * noise.to(images.dtype)}


@dataclass(frozen=True)
class ShiftImages:
    """A client's image shift: ``params`` maps names of :data:`SHIFT_LIMITS` to the client's drawn values."""

    input_key: str
    params: tuple[tuple[str, float], ...]

    def __call__(self, batch: dict) -> dict:
        images = batch[self.input_key]
        for name, value in self.params:
            images = _shift(images, name, value)
        return {**batch, self.input_key: images}


def _shift(images: torch.Tensor, name: str, value: float) -> torch.Tensor:
    import torchvision.transforms.v2.functional as TF  # here: torchvision takes seconds to import; only shifts need it

    if name == "brightness":
        return TF.adjust_brightness(images, value)
    if name == "contrast":
        return TF.adjust_contrast(images, value)
    if name == "saturation":
        return TF.adjust_saturation(images, value)
    if name == "hue":
        return TF.adjust_hue(images, value)
    if name == "blur":
        if value <= 0:
            return images
        size = 2 * math.ceil(3 * value) + 1  # ±3σ: torchvision's own rule of thumb for a Gaussian kernel
        return TF.gaussian_blur(images, [size, size], [value, value])
    return TF.rotate(images, value, interpolation=TF.InterpolationMode.BILINEAR)


@dataclass(frozen=True)
class SwapLabels:
    """Relabels class c as ``mapping[c]`` under every batch key in ``keys`` (the task's target, the family label)."""

    keys: tuple[str, ...]
    mapping: tuple[int, ...]

    def __call__(self, batch: dict) -> dict:
        table = torch.tensor(self.mapping, dtype=torch.int64)
        return {**batch, **{key: table[batch[key]] for key in self.keys if key in batch}}


@dataclass(frozen=True)
class UseVariant:
    """The target of ``domain`` is the variant domain's target of the same image (its mask comes with it)."""

    domain: str
    variant: str

    def __call__(self, batch: dict) -> dict:
        batch = dict(batch)
        batch[self.domain] = batch.pop(self.variant)
        return batch


def swap_mapping(pairs: Sequence[Sequence[int]], num_classes: int | None) -> list[int]:
    """The permutation c -> c' of ``pairs`` over classes 0..max (or 0..num_classes-1)."""
    size = num_classes if num_classes is not None else max(max(pair) for pair in pairs) + 1
    mapping = list(range(size))
    for a, b in pairs:
        mapping[a], mapping[b] = b, a
    return mapping


@dataclass(frozen=True)
class ClientSkew:
    """Everything one client's batches go through, in order (feature transforms first, then the concept).

    A sample's transformed image never changes (fixed parameters, noise seeded by its sample id), so
    it is computed once and kept in :attr:`memo` (up to :data:`MEMO_BYTES` per client; beyond that it
    is recomputed). The images a batch sees for the first time go through the transforms in one call
    (3× cheaper than one image at a time at batch 16, docs/BENCHMARKS.md). Every transform is
    batch-invariant, i.e. an image's pixels do not depend on which batch it first came in (elementwise
    ops, per-image means, depthwise blur, per-pixel sampling; ``tests/test_skews.py`` checks it bit for
    bit), so a resumed run and the cached-feature path (one image at a time) see the same values.

    Attributes:
        feature: transforms of the input image (the cached-feature path applies them before encoding).
        concept: transforms of the targets.
        input_key: the batch key of the image.
        pairs: label_swap's class pairs (empty when none).
        variant: target_variant's domain, or None.
        memo: sample id -> its transformed image (filled as samples are first seen).
    """

    feature: tuple[Callable[[dict], dict], ...]
    concept: tuple[Callable[[dict], dict], ...]
    input_key: str = "image"
    pairs: tuple[tuple[int, int], ...] = ()
    variant: str | None = None
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    def __call__(self, items: list[dict]) -> dict:
        """A DataLoader ``collate_fn``: the default collation, then every transform."""
        return self.apply(default_collate(items))

    def apply(self, batch: dict, feature: bool = True) -> dict:
        if feature and self.feature:
            batch = {**batch, self.input_key: self.images(batch[self.input_key], list(batch["sample_id"]))}
        for step in self.concept:
            batch = step(batch)
        return batch

    def images(self, images: torch.Tensor, sample_ids: list[str]) -> torch.Tensor:
        """The transformed ``[B, 3, H, W]`` images: seen ones from :attr:`memo`, the others in one call."""
        unseen = [index for index, sample_id in enumerate(sample_ids) if sample_id not in self.memo]
        fresh = {}
        if unseen:
            batch = {self.input_key: images[unseen], "sample_id": [sample_ids[index] for index in unseen]}
            for step in self.feature:
                batch = step(batch)
            fresh = dict(zip(unseen, batch[self.input_key]))
            for index, image in fresh.items():
                if (len(self.memo) + 1) * image.numel() * image.element_size() <= MEMO_BYTES:
                    self.memo[sample_ids[index]] = image.clone()  # not a view keeping the whole batch alive
        return torch.stack([fresh[index] if index in fresh else self.memo[sample_id]
                            for index, sample_id in enumerate(sample_ids)])

    def image(self, image: torch.Tensor, sample_id: str) -> torch.Tensor:
        """One sample's transformed image ``[3, H, W]`` (from :attr:`memo` when it was seen before)."""
        return self.images(image[None], [sample_id])[0]

    def counts(self, counts: Sequence[int]) -> tuple[int, ...]:
        """A client's training class counts as the client labels them (swapped classes swap counts)."""
        mapping = swap_mapping(self.pairs, len(counts)) if self.pairs else list(range(len(counts)))
        permuted = np.zeros(len(counts), dtype=np.int64)
        permuted[mapping] = np.asarray(counts)
        return tuple(permuted.tolist())
