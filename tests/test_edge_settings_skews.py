"""Partition settings at their edges, by hand: how a fraction becomes a count (a concept shift's affected clients,
rounded half up as documented; a client's held-out test rows, rounded as Python's ``round``, with the one-row
floors), the noise levels of few clients, the shift ranges of non-default magnitudes, and temporal schedules
whose last phase starts exactly at the last round."""

from __future__ import annotations

import numpy as np
import pytest

from partitioning.allocation import UNUSED
from partitioning.client_tests import client_test_mask
from partitioning.skews import SkewContext, affected_clients, get_skew
from partitioning.temporal import NO_END, TemporalSpec, phase_windows
from utils.errors import TaskHetError
from utils.seeding import numpy_rng


# ----- concept shifts: round_half_up(fraction · N) affected clients -----
@pytest.mark.parametrize("fraction, n_clients, count", [
    (0.5, 5, 3),  # 2.5: half up (Python's round would give 2)
    (0.45, 10, 5),  # 4.5: half up (round: 4)
    (0.25, 2, 1),  # 0.5: half up (round: 0)
    (0.5, 3, 2),  # 1.5
    (0.7, 5, 4),  # 3.5
    (0.2, 5, 1),  # 1.0 exactly
    (0.29, 5, 1),  # 1.45: down
    (0.0, 4, 0),
    (1.0, 4, 4),
])
def test_affected_clients_are_the_fraction_rounded_half_up(fraction, n_clients, count):
    drawn = affected_clients(fraction, n_clients, np.random.default_rng(0))
    assert len(drawn) == count and len(set(drawn)) == count and drawn == sorted(drawn)
    assert all(0 <= client < n_clients for client in drawn)


@pytest.mark.parametrize("name, settings", [
    ("label_swap", {"pairs": [[0, 1]], "fraction": 0.5}),
    ("target_variant", {"task": "depth_euclidean", "variant": "depth_zbuffer", "fraction": 0.5}),
])
def test_each_concept_shift_records_half_up_many_clients_and_leaves_the_rest_alone(name, settings):
    context = SkewContext("taskonomy", 4, ("depth_euclidean", "depth_zbuffer"), 5)
    drawn = get_skew(name).draw(settings, context, seed=7)
    assert len(drawn) == 3  # 0.5 · 5 = 2.5 -> 3
    assert set(drawn) == set(affected_clients(0.5, 5, numpy_rng(7, "skew", name, "clients")))


# ----- feature_noise: σ_i = σ·i/(N − 1), client 0 clean -----
@pytest.mark.parametrize("n_clients, sigmas", [(1, [0.0]), (2, [0.0, 0.6]), (3, [0.0, 0.3, 0.6]),
                                               (5, [0.0, 0.15, 0.3, 0.45, 0.6])])
def test_noise_levels_of_few_clients(n_clients, sigmas):
    drawn = get_skew("feature_noise").draw({"sigma": 0.6}, SkewContext("digits", 10, ("digit_class",), n_clients), 1)
    assert [drawn[client]["sigma"] for client in range(n_clients)] == pytest.approx(sigmas, rel=0, abs=1e-15)


# ----- feature_shift: each magnitude m draws from its documented interval -----
def test_shift_values_are_uniform_draws_over_each_transforms_interval():
    limits = {"brightness": 0.4, "contrast": 0.2, "saturation": 0.6, "hue": 0.1, "blur": 2.0, "rotation": 30.0}
    drawn = get_skew("feature_shift").draw({"limits": limits}, SkewContext("digits", 10, ("digit_class",), 3), 5)
    intervals = {"brightness": (0.6, 1.4), "contrast": (0.8, 1.2), "saturation": (0.4, 1.6), "hue": (-0.1, 0.1),
                 "blur": (0.0, 2.0), "rotation": (-30.0, 30.0)}
    for client in range(3):
        rng = numpy_rng(5, "skew", "feature_shift", client)  # one uniform per transform, in this order
        for name, (low, high) in intervals.items():
            assert drawn[client][name] == pytest.approx(low + (high - low) * rng.random(), rel=0, abs=1e-12), name
    still = get_skew("feature_shift").draw({"limits": {name: 0.0 for name in limits}},
                                           SkewContext("digits", 10, ("digit_class",), 2), 5)
    assert still[1] == {"brightness": 1.0, "contrast": 1.0, "saturation": 1.0, "hue": 0.0, "blur": 0.0,
                        "rotation": 0.0}  # magnitude 0: the identity


# ----- held-out client tests: round(fraction · size) rows, at least one each side -----
@pytest.mark.parametrize("fraction, size, n_test", [
    (0.5, 5, 2),  # 2.5: Python's round, to even (the docstring's round; half up would give 3)
    (0.5, 7, 4),  # 3.5: to even
    (0.5, 3, 2),  # 1.5
    (0.3, 5, 2),  # 1.5
    (0.25, 6, 2),  # 1.5
    (0.45, 10, 4),  # 4.5: to even
    (0.1, 2, 1),  # 0.2 rounds to 0: a 2-row client still gets one test row
    (0.1, 1, 0),  # a 1-row client keeps its row for training
    (0.9, 2, 1),  # 1.8 rounds to 2: one train row must stay
    (0.0, 6, 0),  # no fraction: no test row, even for a client that could spare one
])
def test_held_out_test_rows_are_the_fraction_rounded_with_one_row_floors(fraction, size, n_test):
    client_of = np.array([0] * size + [UNUSED, 1, 1, 1, 1])  # client 1 (4 rows) rides along; unused rows stay out
    mask = client_test_mask(client_of, fraction, np.random.default_rng(3))
    assert int(mask[:size].sum()) == n_test
    assert int(mask[size + 1:].sum()) == (min(max(round(fraction * 4), 1), 3) if fraction else 0)
    assert not mask[size]


# ----- temporal schedules: the last phase may start on the last round, not after it -----
def test_a_rotation_whose_last_phase_starts_on_the_last_round_is_kept_and_one_round_less_refused():
    spec = TemporalSpec("rotate", 3, phase_rounds=2)  # phases start in rounds 1, 3, 5
    assert phase_windows(spec, 5) == [[(1, 2)], [(3, 4)], [(5, 5)]]
    assert phase_windows(spec, 7) == [[(1, 2), (7, 7)], [(3, 4)], [(5, 6)]]  # the cycle of 6 rounds repeats
    with pytest.raises(TaskHetError, match=r"phase 2 would start at round 5, after --n_rounds 4"):
        phase_windows(spec, 4)
    abrupt = TemporalSpec("abrupt", 2, change_round=4)
    assert phase_windows(abrupt, 4) == [[(1, 3)], [(4, 4)]]
    assert phase_windows(abrupt, None) == [[(1, 3)], [(4, NO_END)]]
    with pytest.raises(TaskHetError, match=r"phase 1 would start at round 4, after --n_rounds 3"):
        phase_windows(abrupt, 3)
