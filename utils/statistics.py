"""The statistics every report uses: bounded intervals over seeds, paired verdicts, adjusted counts, headlines.

One module so that the main report (pipeline/studies/main_job/report.py), the studies (pipeline/studies/fedavg_sharding.py,
pipeline/studies/sparse_finetuning.py) and the hyperparameter search (training/search.py) decide the same way.

**Paired differences.** The same seed gives the same initial model and client sampling on both
sides, so runs pair up by seed. With differences d_s = b_s − a_s over n seeds, the interval is
Student's t: d̄ ± t_{0.975, n−1} · s_d / √n. A comparison is *decided* only when

* there are at least :data:`MIN_SEEDS` (3) pairs: with 2 the t quantile is 12.7 and one unlucky
  seed decides;
* the differences vary (s_d > 0): identical differences on every seed (one test image of 360, say)
  give a zero-width interval that says nothing about the next seed;
* the interval excludes 0.

Otherwise it is *undecided*, and :attr:`PairedDifference.reason` says which of the three.

**Bounded means.** A mean over seeds of a bounded metric gets an interval inside the metric's
range: the t interval is computed on a transformed scale and mapped back — logit for metrics in
[0, 1] (accuracies, mIoU), log for metrics ≥ 0 (losses, errors, epochs). Values on the bound
itself are moved :data:`EDGE` inside it first. The point estimate stays the plain mean (the interval is
widened to hold it where the transformed mean maps back elsewhere). We chose
the transform over a bootstrap percentile interval because with 3–5 seeds the percentile
bootstrap cannot reach past the observed minimum and maximum and covers far less than 95%.

**Multiple comparisons.** A report that counts decided cells also gives the count after
Benjamini–Hochberg at 5% false-discovery rate over all of its cells (scipy's
``false_discovery_control``); an undecidable cell (too few seeds, zero variance) enters with p = 1.
With 32 cells at 95%, about 1.6 would be decided by chance alone.

**Headlines.** :func:`direction` claims a direction only when at least half of the cells are
decided and at least two thirds of the decided cells agree; the sentence always carries the counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

LEVEL = 0.95
MIN_SEEDS = 3
EDGE = 1e-6  # how far inside a bound a value on it is moved before the logit / log transform
MIN_DECIDED_SHARE = 0.5  # a headline needs at least this share of its cells decided ...
CLEAR_MAJORITY = 2 / 3  # ... and at least this share of the decided cells agreeing

UNBOUNDED, UNIT, NONNEGATIVE = "unbounded", "unit", "nonnegative"
# Metrics whose values are fractions in [0, 1]; every other metric TaskHet logs (losses, l1, abs_rel, rmse,
# angles in degrees, epochs) is ≥ 0.
UNIT_METRICS = frozenset({"top1", "top5", "miou", "delta1", "within_11_25", "pixel_acc"})

TOO_FEW, ZERO_VARIANCE, CONTAINS_ZERO = "too few seeds", "zero variance", "interval contains 0"


def metric_scale(metric: str) -> str:
    """The range of ``metric``: :data:`UNIT` for fractions (accuracies), else :data:`NONNEGATIVE`."""
    return UNIT if metric in UNIT_METRICS else NONNEGATIVE


@dataclass(frozen=True)
class PairedDifference:
    """b − a over paired seeds.

    Attributes:
        n: number of pairs.
        mean: d̄.
        low, high: the t interval of d̄ (NaN with fewer than 2 pairs or zero variance).
        relative: d̄ over the mean of a, in % (the "gap").
        p_value: two-sided paired t test (NaN when undecidable: too few pairs or zero variance).
        sign: +1 (decided: b above a), −1 (decided: b below a) or 0 (undecided).
        reason: why undecided ("" when decided): ``too few seeds``, ``zero variance`` or
            ``interval contains 0``; :meth:`explain` gives the sentence.
    """

    n: int
    mean: float
    low: float
    high: float
    relative: float
    p_value: float
    sign: int
    reason: str

    @property
    def decided(self) -> bool:
        return self.sign != 0

    @property
    def testable(self) -> bool:
        """Enough pairs and nonzero variance: the interval and p-value mean something."""
        return self.reason not in (TOO_FEW, ZERO_VARIANCE)

    def explain(self) -> str:
        """``undecided: 2 paired seeds, 3 needed`` and the like; ``decided`` when decided."""
        if self.reason == TOO_FEW:
            return f"undecided: {self.n} paired seed{'s' if self.n != 1 else ''}, {MIN_SEEDS} needed"
        if self.reason == ZERO_VARIANCE:
            return f"undecided: zero variance (every seed gives {self.mean:+.4g})"
        if self.reason == CONTAINS_ZERO:
            return "undecided: the 95% interval contains 0"
        return "decided"


def paired_difference(a: Sequence[float], b: Sequence[float], level: float = LEVEL,
                      scale: str = UNBOUNDED) -> PairedDifference:
    """The paired t interval and verdict of ``b − a`` (values listed in the same seed order).

    ``scale`` :data:`UNIT` (both sides in [0, 1], e.g. accuracies): the difference lies in [−1, 1], so the
    interval is clipped there (a t interval of +0.64 ± 0.53 would otherwise claim up to +1.17). Clipping
    to a bound on the far side of 0 never changes the verdict."""
    if len(a) != len(b) or not len(a):
        raise ValueError(f"need the same non-zero number of values on both sides, got {len(a)} and {len(b)}")
    from scipy import stats  # here: scipy.stats takes 0.8 s to import, which every run_pipeline.py start paid
    differences = np.asarray(b, dtype=float) - np.asarray(a, dtype=float)
    n, mean = len(differences), float(differences.mean())
    a_mean = float(np.mean(a))
    relative = 100 * mean / a_mean if a_mean else math.nan
    std = float(differences.std(ddof=1)) if n > 1 else 0.0
    # Zero variance up to float noise: a difference of 0.003 stored as 0.0030000000000001 and 0.0029999999999999.
    no_variance = std <= 1e-12 * max(1.0, abs(mean))
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * std / math.sqrt(n) if n > 1 and not no_variance else math.nan
    low, high = mean - half, mean + half
    if scale == UNIT:
        low, high = max(low, -1.0), min(high, 1.0)
    if n < MIN_SEEDS:  # the first reason to give: more seeds are needed whatever the variance
        return PairedDifference(n, mean, low, high, relative, math.nan, 0, TOO_FEW)
    if no_variance:
        return PairedDifference(n, mean, math.nan, math.nan, relative, math.nan, 0, ZERO_VARIANCE)
    p_value = float(2 * stats.t.sf(abs(mean) / (std / math.sqrt(n)), n - 1))
    sign = 1 if low > 0 else -1 if high < 0 else 0
    return PairedDifference(n, mean, low, high, relative, p_value, sign, "" if sign else CONTAINS_ZERO)


POWER = 0.8  # the power a minimum detectable change is stated at


def minimum_detectable_change(std: float, n: int, level: float = LEVEL, power: float = POWER) -> float:
    """The smallest true mean change a two-sided one-sample t test at ``level`` detects with probability ``power``,
    for ``n`` seeds whose changes spread with standard deviation ``std`` (taken as the true one).

    Exact for normal changes: the t statistic of a true mean δ has the noncentral t distribution with n − 1 degrees
    of freedom and noncentrality δ√n/σ, so δ solves P(|T| > t_{(1+level)/2, n−1}) = ``power``. For many seeds this
    tends to (z_{0.975} + z_{0.8}) σ/√n = 2.80 σ/√n; at 3 seeds it is far larger (the t quantile of 2 degrees of
    freedom is 4.30). NaN below :data:`MIN_SEEDS` seeds or for a non-finite or zero spread (no interval exists)."""
    if n < MIN_SEEDS or not math.isfinite(std) or std <= 0:
        return math.nan
    from scipy import optimize, stats

    df, critical = n - 1, float(stats.t.ppf(0.5 + level / 2, n - 1))

    def shortfall(noncentrality: float) -> float:
        # scipy's noncentral t gives NaN far in the lower tail, where the probability is below 1e-12: read it as 0.
        lower = float(np.nan_to_num(stats.nct.cdf(-critical, df, noncentrality)))
        return float(stats.nct.sf(critical, df, noncentrality)) + lower - power

    # At noncentrality critical + 6 the power is above 0.83 for any degrees of freedom: the root lies below it.
    noncentrality = optimize.brentq(shortfall, 0.0, critical + 6.0, xtol=1e-12)
    return noncentrality * std / math.sqrt(n)


def mean_interval(values: Sequence[float], scale: str = UNBOUNDED, level: float = LEVEL) -> tuple[float, float, float]:
    """``(mean, low, high)`` of ``values`` over seeds; the interval lies inside ``scale``'s range.

    ``scale``: :data:`UNBOUNDED` (the plain t interval), :data:`UNIT` (t on the logit scale) or
    :data:`NONNEGATIVE` (t on the log scale). NaN bounds with fewer than 2 values.
    """
    if not len(values):
        raise ValueError("need at least one value")
    data = np.asarray(values, dtype=float)
    mean = float(data.mean())
    if len(data) < 2:
        return mean, math.nan, math.nan
    from scipy import stats  # see paired_difference

    forward, back = _transforms(scale)
    moved = forward(data)
    centre, std = float(moved.mean()), float(moved.std(ddof=1))
    half = float(stats.t.ppf(0.5 + level / 2, len(data) - 1)) * std / math.sqrt(len(data))
    # The back-transformed interval centres on the transformed mean, not the plain one; widen it to hold the plain
    # mean too (it can miss it by float rounding with zero spread, or by Jensen's gap with a wide spread).
    return mean, min(mean, float(back(centre - half))), max(mean, float(back(centre + half)))


def _transforms(scale: str):
    if scale == UNIT:
        return (lambda x: _logit(np.clip(x, EDGE, 1 - EDGE))), (lambda z: 1 / (1 + math.exp(-z)) if z > -700 else 0.0)
    if scale == NONNEGATIVE:
        return (lambda x: np.log(np.clip(x, EDGE, None))), (lambda z: math.exp(min(z, 700.0)))
    if scale == UNBOUNDED:
        return (lambda x: x), (lambda z: z)
    raise ValueError(f"unknown scale {scale!r}; expected {UNBOUNDED}, {UNIT} or {NONNEGATIVE}")


def _logit(p: np.ndarray) -> np.ndarray:
    return np.log(p) - np.log1p(-p)


def adjusted_decided(differences: Sequence[PairedDifference | None], rate: float = 1 - LEVEL) -> list[bool]:
    """Which comparisons stay decided after Benjamini–Hochberg at false-discovery ``rate`` over all of them.

    Every comparison counts in the adjustment; an undecidable one (None, too few seeds, zero
    variance) enters with p = 1, so adding undecidable cells never makes the others easier to decide.
    """
    if not len(differences):
        return []
    from scipy import stats  # see paired_difference

    p_values = [1.0 if item is None or not item.testable else item.p_value for item in differences]
    adjusted = stats.false_discovery_control(p_values, method="bh")
    return [bool(item is not None and item.decided and value <= rate) for item, value in zip(differences, adjusted)]


@dataclass(frozen=True)
class Counts:
    """How the cells of one report (or one of its groups) came out."""

    cells: int
    above: int
    below: int
    too_few: int
    zero_variance: int
    contains_zero: int
    above_adjusted: int
    below_adjusted: int
    adjusted_over: int  # how many cells the Benjamini–Hochberg adjustment ran over (the whole report's)

    @property
    def decided(self) -> int:
        return self.above + self.below

    def text(self, above: str = "above", below: str = "below") -> str:
        """``decided in 3 of 8 cells (above 2, below 1; after Benjamini–Hochberg over the report's 8: above 1,
        below 0); undecided 5 (2 with too few seeds, 0 with zero variance, 3 whose interval contains 0)``."""
        undecided = self.cells - self.decided
        return (f"decided in {self.decided} of {self.cells} cells ({above} {self.above}, {below} {self.below}; after "
                f"Benjamini–Hochberg over the report's {self.adjusted_over}: {above} {self.above_adjusted}, {below} {self.below_adjusted}); "
                f"undecided {undecided} ({self.too_few} with too few seeds, {self.zero_variance} with zero variance, "
                f"{self.contains_zero} whose interval contains 0)")


def count(differences: Sequence[PairedDifference | None], adjusted: Sequence[bool] | None = None,
          adjusted_over: int | None = None) -> Counts:
    """The counts of ``differences`` (None: a cell with no pairs, counted with too few seeds). ``adjusted``: which
    stay decided after the report-wide adjustment over ``adjusted_over`` cells (default: adjusting over
    ``differences`` alone)."""
    if adjusted is None:
        adjusted, adjusted_over = adjusted_decided(differences), len(differences)
    signs = [0 if item is None else item.sign for item in differences]
    reasons = [TOO_FEW if item is None else item.reason for item in differences]
    return Counts(len(differences), signs.count(1), signs.count(-1), reasons.count(TOO_FEW), reasons.count(ZERO_VARIANCE),
                  reasons.count(CONTAINS_ZERO),
                  sum(1 for sign, keep in zip(signs, adjusted) if keep and sign > 0),
                  sum(1 for sign, keep in zip(signs, adjusted) if keep and sign < 0),
                  len(differences) if adjusted_over is None else adjusted_over)


def direction(counts: Counts) -> int:
    """+1 / −1 when the cells point that way clearly enough for a headline, else 0.

    Clearly enough: at least :data:`MIN_DECIDED_SHARE` of the cells are decided and at least
    :data:`CLEAR_MAJORITY` of the decided ones agree. One decided cell of eight is no direction.
    """
    if not counts.cells or counts.decided < MIN_DECIDED_SHARE * counts.cells:
        return 0
    if counts.above >= CLEAR_MAJORITY * counts.decided:
        return 1
    if counts.below >= CLEAR_MAJORITY * counts.decided:
        return -1
    return 0
