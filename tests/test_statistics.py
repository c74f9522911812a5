"""Paired confidence intervals of the label-vs-embedding gap (pipeline/statistics.py), by hand."""

from __future__ import annotations

import math

import pytest

from pipeline.statistics import EMBEDDING_WORSE, LABEL_WORSE, NO_DIFFERENCE, TOO_FEW, paired_difference


def test_hand_computed_three_seeds():
    # d = (0.2, 0.4, 0.3): d̄ = 0.3, s = 0.1, t_{0.975,2} = 4.302653; half = 4.302653·0.1/√3 = 0.248414
    result = paired_difference([1.0, 2.0, 3.0], [1.2, 2.4, 3.3])
    assert result.n == 3 and result.mean == pytest.approx(0.3)
    assert result.low == pytest.approx(0.3 - 0.2484138, abs=1e-6) and result.high == pytest.approx(0.3 + 0.2484138, abs=1e-6)
    assert result.relative == pytest.approx(15.0)  # 0.3 over the label mean 2.0
    assert result.verdict == EMBEDDING_WORSE


def test_pairing_removes_the_shared_seed_noise():
    # Seeds differ a lot, the paired differences barely: significant although the groups overlap.
    label, embedding = [1.0, 5.0, 9.0, 13.0], [1.1, 5.12, 9.09, 13.11]
    assert paired_difference(label, embedding).verdict == EMBEDDING_WORSE
    assert paired_difference(embedding, label).verdict == LABEL_WORSE


def test_an_interval_containing_zero_and_too_few_seeds():
    assert paired_difference([1.0, 2.0, 3.0], [1.1, 1.9, 3.05]).verdict == NO_DIFFERENCE
    single = paired_difference([1.0], [1.5])
    assert single.verdict == TOO_FEW and math.isnan(single.low) and single.mean == 0.5
    with pytest.raises(ValueError, match="same non-zero number"):
        paired_difference([1.0, 2.0], [1.0])
