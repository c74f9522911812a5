"""Did a task learn (pipeline/studies/main_job/learned.py): its losses at least 5% below the better trivial
predictor's, on hand-made numbers at the edges."""

import math

import pytest

from pipeline.studies.main_job.learned import LEARN_MARGIN, did_not_learn

# The demo's keypoints2d: all zeros and the training median (0 too) score the same on the test split.
KEYPOINTS = {"zero": 0.005629, "median": 0.005629}


def test_the_demos_keypoints_did_not_learn_and_the_reason_names_the_better_trivial_predictor():
    assert LEARN_MARGIN == 5.0
    # 0.0153 / 0.005629 - 1 = 1.718067: +171.8%; on a tie the first predictor, all zeros, is named
    assert did_not_learn(0.0153, None, KEYPOINTS) == (
        "centralized 0.0153 (+171.8%) is not 5% below the better trivial predictor (all zeros 0.005629)")


@pytest.mark.parametrize("centralized, trivial, learned", [
    (0.95, 1.0, True),  # exactly 5% below: learned
    (0.0057, 0.006, True),  # exactly 5% below, though 0.0057 / 0.006 - 1 computes as -4.999999999999993%
    (0.9500001, 1.0, False),  # just short of 5% below (-4.99999%)
    (0.5, 1.0, True),
    (1.0, 1.0, False),  # as good as the trivial predictor
    (1.2, 1.0, False),
])
def test_the_centralized_loss_must_end_at_least_5_percent_below(centralized, trivial, learned):
    assert (did_not_learn(centralized, None, {"zero": trivial}) is None) == learned


def test_the_better_trivial_predictor_sets_the_bar_not_the_worse():
    # all zeros 2.0, the median 1.0: 0.96 is 52% below zeros but only 4% below the median
    reason = did_not_learn(0.96, None, {"zero": 2.0, "median": 1.0})
    assert reason == "centralized 0.96 (-4.0%) is not 5% below the better trivial predictor (training median 1)"
    assert did_not_learn(0.95, None, {"zero": 2.0, "median": 1.0}) is None
    assert did_not_learn(0.95, None, {"median": 1.0, "prior": 3.0}) is None


def test_the_iid_mean_must_end_5_percent_below_too():
    trivial = {"zero": 1.0, "prior": 2.0}
    # centralized 0.5 learned; the iid runs 0.9, 1.0, 0.95: mean 0.95, exactly 5% below: learned
    assert did_not_learn(0.5, [0.9, 1.0, 0.95], trivial) is None
    # 0.9, 1.0, 1.0: mean 0.966667, 3.3% below: not
    assert did_not_learn(0.5, [0.9, 1.0, 1.0], trivial) == (
        "the iid federated mean over 3 runs 0.9667 (-3.3%) is not 5% below the better trivial predictor (all zeros 1)")
    # both fail: both said, the centralized loss first
    assert did_not_learn(1.5, [1.2], trivial) == (
        "centralized 1.5 (+50.0%) is not 5% below the better trivial predictor (all zeros 1); "
        "the iid federated mean over 1 run 1.2 (+20.0%) is not 5% below the better trivial predictor (all zeros 1)")


def test_without_iid_runs_the_centralized_loss_alone_decides():
    assert did_not_learn(0.5, None, {"zero": 1.0}) is None
    assert did_not_learn(0.5, [], {"zero": 1.0}) is None
    assert did_not_learn(0.99, [], {"zero": 1.0}).startswith("centralized 0.99 (-1.0%)")


def test_without_trivial_rows_or_finite_losses_no_claim_is_made():
    assert did_not_learn(5.0, [5.0], {}) is None  # a step-2 folder from before the trivial rows
    assert did_not_learn(5.0, None, {"zero": math.nan}) is None
    assert did_not_learn(math.nan, None, {"zero": 1.0}) is None
    # a NaN trivial loss is left out; the finite one decides
    assert did_not_learn(0.99, None, {"zero": math.nan, "median": 1.0}).endswith("(training median 1)")


def test_a_perfect_trivial_predictor_leaves_nothing_to_learn():
    # every test target 0: all zeros scores 0, and nothing can end 5% below it
    assert did_not_learn(0.0, None, {"zero": 0.0}) == (
        "centralized 0 (the trivial loss is 0) is not 5% below the better trivial predictor (all zeros 0)")


def test_the_margin_is_a_parameter():
    assert did_not_learn(0.85, None, {"zero": 1.0}, margin=15.0) is None
    assert did_not_learn(0.86, None, {"zero": 1.0}, margin=15.0).endswith("is not 15% below the better trivial "
                                                                          "predictor (all zeros 1)")
