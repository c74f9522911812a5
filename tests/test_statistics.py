"""The reports' statistics (utils/statistics.py), on hand-made numbers computed by hand."""

from __future__ import annotations

import math

import pytest

from utils.statistics import (CONTAINS_ZERO, NONNEGATIVE, TOO_FEW, UNIT, ZERO_VARIANCE, Counts, PairedDifference,
                              minimum_detectable_change,
                              adjusted_decided, count, direction, mean_interval, paired_difference)


def test_hand_computed_three_seeds():
    # d = (0.2, 0.4, 0.3): d̄ = 0.3, s = 0.1, t_{0.975,2} = 4.302653; half = 4.302653·0.1/√3 = 0.248414
    result = paired_difference([1.0, 2.0, 3.0], [1.2, 2.4, 3.3])
    assert result.n == 3 and result.mean == pytest.approx(0.3)
    assert result.low == pytest.approx(0.3 - 0.2484138, abs=1e-6) and result.high == pytest.approx(0.3 + 0.2484138, abs=1e-6)
    assert result.relative == pytest.approx(15.0)  # 0.3 over the mean of a, 2.0
    # t = 0.3 / (0.1/√3) = 5.196; two-sided p with 2 degrees of freedom = 1 − t/√(t²+2) = 0.035098
    assert result.p_value == pytest.approx(1 - 5.196152 / math.sqrt(5.196152 ** 2 + 2), abs=1e-6)
    assert result.sign == 1 and result.decided and result.explain() == "decided"


def test_pairing_removes_the_shared_seed_noise():
    a, b = [1.0, 5.0, 9.0, 13.0], [1.1, 5.12, 9.09, 13.11]
    assert paired_difference(a, b).sign == 1
    assert paired_difference(b, a).sign == -1


def test_two_seeds_are_undecided_however_far_apart():
    result = paired_difference([0.5, 0.6], [0.9, 0.95])  # d = (0.4, 0.35): large, but only two seeds
    assert result.sign == 0 and result.reason == TOO_FEW and math.isnan(result.p_value)
    assert result.explain() == "undecided: 2 paired seeds, 3 needed"
    single = paired_difference([1.0], [1.5])
    assert single.reason == TOO_FEW and math.isnan(single.low) and single.mean == 0.5


def test_zero_variance_is_undecided():
    # One test image of 360 on every seed: +0.00278 three times, as floats give it (not bit-equal).
    a = [0.9, 0.8, 0.7]
    b = [value + 1 / 360 for value in a]
    result = paired_difference(a, b)
    assert result.reason == ZERO_VARIANCE and result.sign == 0 and math.isnan(result.low)
    assert result.explain().startswith("undecided: zero variance")


def test_an_interval_containing_zero_is_undecided():
    result = paired_difference([1.0, 2.0, 3.0], [1.1, 1.9, 3.05])
    assert result.reason == CONTAINS_ZERO and result.sign == 0 and result.low < 0 < result.high
    with pytest.raises(ValueError, match="same non-zero number"):
        paired_difference([1.0, 2.0], [1.0])


def test_accuracy_intervals_stay_inside_zero_one():
    # The first use's 0.933 [0.686, 1.180]: two seeds 0.9139 and 0.9527 under a plain t interval.
    mean, low, high = mean_interval([0.9139, 0.9527], UNIT)
    assert mean == pytest.approx(0.9333) and 0 <= low < mean < high <= 1
    plain = mean_interval([0.9139, 0.9527])
    assert plain[2] > 1  # what the plain interval did
    # By hand on the logit scale: z = logit(0.8), logit(0.9), logit(0.95); t_{0.975,2} = 4.302653.
    z = [math.log(p / (1 - p)) for p in (0.8, 0.9, 0.95)]
    centre = sum(z) / 3
    s = math.sqrt(sum((value - centre) ** 2 for value in z) / 2)
    half = 4.302653 * s / math.sqrt(3)
    expit = lambda value: 1 / (1 + math.exp(-value))  # noqa: E731
    mean, low, high = mean_interval([0.8, 0.9, 0.95], UNIT)
    assert mean == pytest.approx(0.8833333) and low == pytest.approx(expit(centre - half), abs=1e-6)
    assert high == pytest.approx(expit(centre + half), abs=1e-6) and high < 1
    assert mean_interval([1.0, 1.0, 0.99], UNIT)[2] <= 1  # a value on the bound is moved inside it


def test_loss_intervals_stay_at_or_above_zero():
    mean, low, high = mean_interval([0.05, 0.4, 0.1], NONNEGATIVE)
    assert mean_interval([0.05, 0.4, 0.1])[1] < 0  # the plain t interval goes below 0
    logs = [math.log(value) for value in (0.05, 0.4, 0.1)]
    centre = sum(logs) / 3
    s = math.sqrt(sum((value - centre) ** 2 for value in logs) / 2)
    assert low == pytest.approx(math.exp(centre - 4.302653 * s / math.sqrt(3)), rel=1e-6) and low > 0
    assert high == pytest.approx(math.exp(centre + 4.302653 * s / math.sqrt(3)), rel=1e-6)
    assert mean == pytest.approx(0.55 / 3)
    with pytest.raises(ValueError, match="unknown scale"):
        mean_interval([1.0, 2.0], "percent")


def _decided(p_value: float, sign: int = 1) -> PairedDifference:
    return PairedDifference(5, 0.1 * sign, 0.05, 0.15, 10.0, p_value, sign, "")


def test_benjamini_hochberg_count_by_hand():
    # m = 6 (one undecidable cell enters with p = 1). Sorted p: 0.001, 0.012, 0.029, 0.045, 0.2, 1.
    # BH: the largest k with p_(k) ≤ k·0.05/6: k=1 0.001 ≤ 0.00833 ✓, k=2 0.012 ≤ 0.01667 ✓, k=3 0.029 > 0.025 ✗,
    # k=4 0.045 > 0.0333 ✗, k=5 0.2 > 0.0417 ✗: the two smallest stay decided.
    cells = [_decided(0.029), _decided(0.001), _decided(0.045, -1), _decided(0.012, -1),
             PairedDifference(5, 0.01, -0.1, 0.1, 1.0, 0.2, 0, CONTAINS_ZERO),
             PairedDifference(2, 0.3, -1.0, 1.6, 30.0, math.nan, 0, TOO_FEW)]
    assert adjusted_decided(cells) == [False, True, False, True, False, False]
    counts = count(cells)
    assert counts == Counts(cells=6, above=2, below=2, too_few=1, zero_variance=0, contains_zero=1,
                            above_adjusted=1, below_adjusted=1, adjusted_over=6)
    assert "decided in 4 of 6 cells (above 2, below 2; after Benjamini–Hochberg over the report's 6: above 1, below 1)" in counts.text()


def test_a_headline_needs_half_the_cells_decided_and_a_clear_majority():
    one_of_eight = count([_decided(0.001)] + [PairedDifference(2, 0.1, -1, 1, 1, math.nan, 0, TOO_FEW)] * 7)
    assert one_of_eight.decided == 1 and direction(one_of_eight) == 0
    assert direction(count([_decided(0.001)] * 4 + [None] * 4)) == 1  # 4 of 8 decided, all agreeing
    assert direction(count([_decided(0.001, -1)] * 3 + [_decided(0.001)] + [None] * 4)) == -1  # 3 of 4 agree
    assert direction(count([_decided(0.001, -1)] * 2 + [_decided(0.001)] * 2)) == 0  # split


def test_a_difference_of_two_accuracies_keeps_its_interval_inside_minus_one_one():
    # the toolbox study's worst-10% gain: differences +0.95, +0.75, +0.22 → mean +0.64, t half-width ≈ 0.94
    a, b = [0.05, 0.2, 0.7], [1.0, 0.95, 0.92]
    plain = paired_difference(a, b)
    assert plain.high > 1.0  # what a plain t interval claims: more than the largest possible gain
    bounded = paired_difference(a, b, scale=UNIT)
    assert bounded.mean == pytest.approx(plain.mean) and bounded.low == pytest.approx(plain.low)
    assert bounded.high == 1.0 and bounded.sign == plain.sign and bounded.reason == plain.reason
    below = paired_difference(b, a, scale=UNIT)
    assert below.low == -1.0 and below.high == pytest.approx(-plain.low)


# ----- the smallest change a row detects -----
def test_minimum_detectable_change_tends_to_the_normal_formula_with_many_seeds():
    # By hand: (z_0.975 + z_0.8) sigma / sqrt(n) = (1.959964 + 0.841621) * 2 / 100 = 0.0560317 for sigma 2, n 10000.
    assert minimum_detectable_change(2.0, 10_000) == pytest.approx(0.0560317, rel=2e-3)


def test_minimum_detectable_change_at_three_seeds_is_detected_four_times_in_five():
    """Simulated: 3 seeds with true mean = the detectable change and spread 1, tested as the reports test them."""
    import numpy as np
    from scipy import stats

    change = minimum_detectable_change(1.0, 3)
    assert 3.2 < change < 3.3  # far above the normal formula's 2.80 / sqrt(3) = 1.62: 2 degrees of freedom
    draws = np.random.default_rng(0).normal(change, 1.0, size=(200_000, 3))
    t = draws.mean(1) / (draws.std(1, ddof=1) / math.sqrt(3))
    power = float((np.abs(t) > stats.t.ppf(0.975, 2)).mean())
    assert power == pytest.approx(0.8, abs=0.005)  # binomial sd of 200,000 draws: 0.0009
    assert minimum_detectable_change(2.5, 3) == pytest.approx(2.5 * change)  # in units of the spread


@pytest.mark.parametrize("std, n", [(1.0, 2), (1.0, 1), (0.0, 3), (math.nan, 3), (math.inf, 5), (-1.0, 4)])
def test_minimum_detectable_change_is_nan_without_an_interval(std, n):
    assert math.isnan(minimum_detectable_change(std, n))
