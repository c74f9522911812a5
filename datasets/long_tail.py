"""Long-tailed subsets (CIFAR-10-LT, CIFAR-100-LT) and the head / middle / tail class groups.

The exponential profile of Cao et al. 2019 ("LDAM") that CIFAR-LT uses: class c of C keeps
n_c = ⌊n_max · IF^{c/(C−1)}⌋ images, with imbalance factor IF = n_min / n_max (e.g. 0.01),
so class 0 keeps n_max and class C−1 keeps ⌊n_max · IF⌋. Which images a class keeps is a
seeded draw. Two conventions name the head, middle and tail classes:

* by shots (Liu et al. 2019, "OLTR"): many (> 100 images), medium (20–100), few (< 20);
* by cumulative mass (FedLoGe, Xiao et al. 2024): classes sorted by count, the head holds
  the first 75% of the images, the middle the next 20% (to 95%), the tail the last 5%.
"""

from __future__ import annotations

import math

import numpy as np

from utils.errors import TaskHetError
from utils.seeding import numpy_rng

HEAD, MIDDLE, TAIL = "head", "middle", "tail"


def long_tail_counts(n_max: int, num_classes: int, imbalance_factor: float) -> np.ndarray:
    """n_c = ⌊n_max · IF^{c/(C−1)}⌋ for c = 0..C−1."""
    if not 0 < imbalance_factor <= 1:
        raise TaskHetError(f"--imbalance_factor must be in (0, 1], got {imbalance_factor}")
    if num_classes < 2 or n_max < 1:
        raise TaskHetError(f"a long-tailed profile needs >= 2 classes and n_max >= 1, got {num_classes}, {n_max}")
    exponents = np.arange(num_classes) / (num_classes - 1)
    # math.floor on Python floats: the profile must match the published counts exactly (10,847 for CIFAR-100).
    return np.array([math.floor(n_max * imbalance_factor ** exponent) for exponent in exponents], dtype=np.int64)


def long_tail_indices(labels: np.ndarray, imbalance_factor: float, seed: int, num_classes: int | None = None,
                      source: str = "labels") -> np.ndarray:
    """Sorted indices of a long-tailed subset of ``labels`` (classes 0..C−1, n_max = the smallest class's size).

    Args:
        labels: int class of every image.
        imbalance_factor: n_min / n_max.
        seed: root seed of the draw.
        num_classes: C; default the largest label + 1 (a dataset should pass its own, so that a
            missing last class is not silently dropped from the profile).
        source: what ``labels`` come from, for the message (the data files).

    Raises:
        TaskHetError: a class with no images (named, with ``source``): the profile is defined over
            every class, with n_max the smallest class's size.
    """
    labels = np.asarray(labels)
    classes = np.bincount(labels, minlength=num_classes or 0)
    empty = np.flatnonzero(classes == 0)
    if empty.size:
        which = f"class {empty[0]} has" if empty.size == 1 else f"classes {', '.join(map(str, empty[:10].tolist()))} have"
        raise TaskHetError(f"{source}: {which} no images, but a long-tailed profile (imbalance factor "
                           f"{imbalance_factor}) needs images of all {classes.size} classes")
    counts = long_tail_counts(int(classes.min()), classes.size, imbalance_factor)
    rng = numpy_rng(seed, "long_tail")
    kept = [rng.choice(np.flatnonzero(labels == label), size=count, replace=False)
            for label, count in enumerate(counts)]
    return np.sort(np.concatenate(kept))


def groups_by_shots(counts: np.ndarray, many: int = 100, few: int = 20) -> dict[str, list[int]]:
    """Classes with > ``many`` images (head), ``few``..``many`` (middle) and < ``few`` (tail)."""
    counts = np.asarray(counts)
    return {HEAD: np.flatnonzero(counts > many).tolist(),
            MIDDLE: np.flatnonzero((counts >= few) & (counts <= many)).tolist(),
            TAIL: np.flatnonzero(counts < few).tolist()}


def groups_by_mass(counts: np.ndarray, head_mass: float = 0.75, middle_mass: float = 0.95) -> dict[str, list[int]]:
    """Classes by cumulative share of the images, most frequent first: head up to ``head_mass``, middle up to ``middle_mass``.

    A class belongs to the group in which its cumulative share *starts* (so the class that crosses 75%
    is still head); ties in count keep class order (a stable sort).
    """
    counts = np.asarray(counts)
    order = np.argsort(-counts, kind="stable")
    start = np.concatenate([[0.0], np.cumsum(counts[order])[:-1]]) / counts.sum()
    groups = {HEAD: [], MIDDLE: [], TAIL: []}
    for label, share in zip(order.tolist(), start):
        groups[HEAD if share < head_mass else MIDDLE if share < middle_mass else TAIL].append(label)
    return groups


# Metric names of the six class groups (models.metrics.ClassificationMetrics reports top1_<name>).
MASS_GROUPS = {HEAD: "head", MIDDLE: "middle", TAIL: "tail"}
SHOT_GROUPS = {HEAD: "many", MIDDLE: "medium", TAIL: "few"}


def class_groups(counts: np.ndarray) -> dict[str, list[int]]:
    """The classes of both conventions, keyed by metric name: head/middle/tail (cumulative mass 75/95%,
    FedLoGe) and many/medium/few (shots, OLTR); empty groups are left out (e.g. no class with > 100 images)."""
    named = {MASS_GROUPS[group]: classes for group, classes in groups_by_mass(counts).items()}
    named.update({SHOT_GROUPS[group]: classes for group, classes in groups_by_shots(counts).items()})
    return {name: classes for name, classes in named.items() if classes}


def proportional_test_indices(train_counts: np.ndarray, test_labels: np.ndarray, rng: np.random.Generator,
                              client: str = "") -> np.ndarray:
    """FedLoGe's local test set: ⌊n_c/N·|test|⌋ images of each class c from the (balanced) test set.

    ``train_counts`` is the client's training histogram (n_c, summing to N); ``test_labels`` the labels of
    the global test set. Clients draw independently, so their sets may overlap. Within a class the
    images are a seeded draw without replacement; a class asked for more images than the test set has
    (a client that is nearly all one class) takes every image of it, repeated, plus a draw for the rest,
    so the proportions still equal the training ones up to rounding.

    Raises:
        TaskHetError: the client has no training rows (its proportions are undefined).
    """
    train_counts = np.asarray(train_counts, dtype=np.int64)
    test_labels = np.asarray(test_labels)
    total = int(train_counts.sum())
    if total == 0:
        raise TaskHetError(f"client {client}: a local test set drawn in its training class proportions needs "
                           "training rows, and it has none")
    wanted = (train_counts * test_labels.size) // total  # ⌊n_c/N·|test|⌋ in exact integer arithmetic
    chosen = []
    for label in np.flatnonzero(wanted):
        pool = np.flatnonzero(test_labels == label)
        if pool.size == 0:
            raise TaskHetError(f"client {client}: trains on class {label}, which the test set does not have")
        repeats, rest = divmod(int(wanted[label]), pool.size)
        chosen += [np.tile(pool, repeats), rng.choice(pool, size=rest, replace=False)]
    return np.sort(np.concatenate(chosen)) if chosen else np.empty(0, dtype=np.int64)
