"""The quadratic explainer (issue 22): FedAvg's fixed point on quadratics, against hand-derived closed forms."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from network.quadratic_explainer import (fixed_point, global_optimum, gradient_dissimilarity, iid_control, run_fedavg,
                                         worked_example)
from steps.explain import main
from tests.scripts_in_process import run_script
from utils.errors import TaskHetError


def hand_fixed_point(eta: float, local_steps: int) -> float:
    """The worked example's fixed point, by symmetry every coordinate equal, derived by hand.

    Coordinate j moves with factor (1 − 4η)^E on client j (its stiff direction) and (1 − η)^E on
    the three others, so x_j = ¼ (1 − (1 − 4η)^E) / (1 − ¾ (1 − η)^E − ¼ (1 − 4η)^E).
    """
    stiff, soft = (1 - 4 * eta) ** local_steps, (1 - eta) ** local_steps
    return 0.25 * (1 - stiff) / (1 - 0.75 * soft - 0.25 * stiff)


def test_optimum_and_dissimilarity_of_the_worked_example_match_a_hand_computation():
    federation = worked_example()
    np.testing.assert_allclose(global_optimum(federation), np.full(4, 4 / 7), rtol=0, atol=1e-15)
    # ∇F_k(x*) has -12/7 on coordinate k and 4/7 on the three others: ‖·‖² = (144 + 3·16) / 49.
    assert gradient_dissimilarity(federation) == pytest.approx(192 / 49, rel=1e-14)
    assert gradient_dissimilarity(worked_example(2.0)) == pytest.approx(4 * 192 / 49, rel=1e-14)


@pytest.mark.parametrize("eta, local_steps", [(0.05, 5), (0.1, 5), (0.2, 2), (0.01, 10)])
def test_the_fixed_point_matches_the_closed_form_and_the_simulation(eta, local_steps):
    federation = worked_example()
    closed = fixed_point(federation, eta, local_steps)
    np.testing.assert_allclose(closed, np.full(4, hand_fixed_point(eta, local_steps)), rtol=1e-12)
    simulated = run_fedavg(federation, eta, local_steps, rounds=3000)
    np.testing.assert_allclose(simulated[-1], closed, rtol=0, atol=1e-12)
    # More rounds do not shrink the distance once at the fixed point.
    optimum = global_optimum(federation)
    assert np.linalg.norm(simulated[-1] - optimum) == pytest.approx(np.linalg.norm(simulated[1500] - optimum), rel=1e-9)
    assert np.linalg.norm(closed - optimum) > 1e-3


def test_one_local_step_is_gradient_descent_and_has_no_bias():
    federation = worked_example()
    for eta in (0.01, 0.1, 0.3):
        np.testing.assert_allclose(fixed_point(federation, eta, 1), global_optimum(federation), rtol=0, atol=1e-14)


@pytest.mark.parametrize("local_steps", [1, 2, 5, 10])
def test_the_distance_is_zero_under_iid(local_steps):
    control = iid_control(worked_example())
    assert gradient_dissimilarity(control) == pytest.approx(0.0, abs=1e-28)
    for eta in (0.01, 0.1, 0.3):
        assert np.linalg.norm(fixed_point(control, eta, local_steps) - global_optimum(control)) < 1e-14


def test_the_distance_increases_in_local_steps_and_in_step_size():
    federation = worked_example()
    optimum = global_optimum(federation)

    def distance(eta, local_steps):
        return np.linalg.norm(fixed_point(federation, eta, local_steps) - optimum)

    by_steps = [distance(0.05, steps) for steps in (1, 2, 5, 10)]
    assert by_steps[0] < 1e-14 and all(a < b for a, b in zip(by_steps, by_steps[1:]))
    by_eta = [distance(eta, 5) for eta in (0.01, 0.02, 0.05, 0.1, 0.2)]
    assert all(a < b for a, b in zip(by_eta, by_eta[1:]))
    # The small-η law of the bias term: ‖x_∞ − x*‖² / (η²E²G²) tends to a constant as η → 0.
    g2 = gradient_dissimilarity(federation)
    ratios = [distance(eta, 5) ** 2 / (eta ** 2 * 25 * g2) for eta in (1e-4, 1e-3)]
    assert ratios[0] == pytest.approx(ratios[1], rel=2e-2)


def test_the_command_writes_its_table_curves_and_figure(tmp_path):
    out = tmp_path / "explain"
    table = main(["--out", str(out), "--etas", "0.05", "0.1", "--local_steps", "1", "5", "--scales", "1",
                  "--rounds", "400"])
    for name in ("config.json", "run.log", "metrics.csv", "explainer.csv", "explainer.png"):
        assert (out / name).is_file(), name
    assert not (out / "INCOMPLETE").exists()
    assert (out / "explainer.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = pd.read_csv(out / "explainer.csv")
    assert len(written) == len(table) == 2 * 2 * 2  # cases × E × η
    row = written[(written["case"] == "heterogeneous") & (written["local_steps"] == 5) & (written["eta"] == 0.1)].iloc[0]
    assert row["fixed_point_distance"] == pytest.approx(2 * abs(hand_fixed_point(0.1, 5) - 4 / 7))  # 4 equal coordinates
    assert row["simulated_distance"] == pytest.approx(row["fixed_point_distance"], rel=1e-9)
    assert row["eta2_E2_G2"] == pytest.approx(0.01 * 25 * 192 / 49)
    assert (written.loc[written["case"] == "iid", "fixed_point_distance"] < 1e-14).all()
    curves = pd.read_csv(out / "metrics.csv")
    assert set(curves["round"]) == set(range(401)) and len(curves) == 8 * 401


@pytest.mark.parametrize("flags, message", [
    (["--etas", "0.6"], "--etas [0.6]: local gradient descent diverges"),
    (["--etas", "0.1", "0.1"], "--etas lists a value twice"),
    (["--local_steps", "0"], "--local_steps"),
    (["--scales", "-1"], "--scales"),
    (["--etas", "nan"], "--etas"),
])
def test_bad_flags_are_one_error_line_and_write_nothing(tmp_path, flags, message, capsys, monkeypatch):
    out = tmp_path / "explain"
    result = run_script("explain_heterogeneity.py", ["--out", str(out), *flags], capsys, monkeypatch)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
    assert not out.exists()


def test_a_folder_of_another_step_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"step": "step 4"}')
    with pytest.raises(TaskHetError, match="a folder of step 4"):
        main(["--out", str(tmp_path), "--etas", "0.1"])
