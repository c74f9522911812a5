"""Paired comparisons over seeds: the label-vs-embedding gap with a 95% confidence interval.

The same seed gives the same initial model and the same client sampling under both
partitions, so the runs pair up by seed and the per-seed difference removes that
shared noise. With differences d_s = embedding_s − label_s over n seeds, the interval
is Student's t: d̄ ± t_{0.975, n−1} · s_d / √n (s_d the sample standard deviation).
A verdict is counted only where the interval excludes 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from scipy import stats

EMBEDDING_WORSE, LABEL_WORSE, NO_DIFFERENCE, TOO_FEW = "embedding worse", "label worse", "no difference", "too few seeds"


@dataclass(frozen=True)
class PairedDifference:
    """embedding − label over paired seeds.

    Attributes:
        n: number of pairs.
        mean: d̄.
        low, high: the confidence interval of the mean difference (NaN with fewer than 2 pairs).
        relative: d̄ over the mean label value, in % (the "gap").
        verdict: ``embedding worse`` (interval above 0), ``label worse`` (below 0),
            ``no difference`` (it contains 0) or ``too few seeds``.
    """

    n: int
    mean: float
    low: float
    high: float
    relative: float
    verdict: str


def paired_difference(label: Sequence[float], embedding: Sequence[float], level: float = 0.95) -> PairedDifference:
    """The paired t interval of ``embedding − label`` (values listed in the same seed order)."""
    if len(label) != len(embedding) or not label:
        raise ValueError(f"need the same non-zero number of label and embedding values, got {len(label)} and {len(embedding)}")
    differences = [e - l for l, e in zip(label, embedding)]
    n = len(differences)
    mean = sum(differences) / n
    label_mean = sum(label) / n
    relative = 100 * mean / label_mean if label_mean else math.nan
    if n < 2:
        return PairedDifference(n, mean, math.nan, math.nan, relative, TOO_FEW)
    std = math.sqrt(sum((d - mean) ** 2 for d in differences) / (n - 1))
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * std / math.sqrt(n)
    low, high = mean - half, mean + half
    verdict = EMBEDDING_WORSE if low > 0 else LABEL_WORSE if high < 0 else NO_DIFFERENCE
    return PairedDifference(n, mean, low, high, relative, verdict)


def mean_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """``(mean, low, high)``: the t interval of the mean of ``values`` (NaN bounds with fewer than 2 values)."""
    if not values:
        raise ValueError("need at least one value")
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan, math.nan
    std = math.sqrt(sum((value - mean) ** 2 for value in values) / (n - 1))
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * std / math.sqrt(n)
    return mean, mean - half, mean + half
