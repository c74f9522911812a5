"""The positive control's table, on hand-made numbers: property- against label-based partitions."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from pipeline.studies.main_job.control import (DETECTED, NOT_DETECTED, control_markdown, control_sentence,
                                               control_table)
from pipeline.studies.main_job.paper import paper_table
from tests.test_paper_answer import T_975_DF2, grid


def with_control(results: pd.DataFrame, changes: dict[tuple[str, str], list[list[float]]]) -> pd.DataFrame:
    """``results`` plus property-based runs at label · (1 + change/100), per seed (outer) and α (inner)."""
    extra = grid(changes)
    extra = extra[extra.grouping == "embedding_based"].assign(grouping="property_based")
    return pd.concat([results, extra], ignore_index=True)


def test_a_clear_penalty_is_detected_and_a_small_noisy_one_is_not():
    answer = grid({("edge_texture", "fedavg"): [[1, 1, 1], [-1, -1, -1], [0.5, 0.5, 0.5]],
                   ("keypoints2d", "fedavg"): [[0, 0, 0]] * 3})
    results = with_control(answer, {("edge_texture", "fedavg"): [[30, 20, 10], [34, 22, 10], [26, 18, 10]],
                                    ("keypoints2d", "fedavg"): [[1, 1, 1], [-1, -1, -1], [0.5, 0.5, 0.5]]})
    table = control_table(results).set_index("task")
    edges, keypoints = table.loc["edge_texture"], table.loc["keypoints2d"]
    # Seed means 20, 22, 18: 20 ± 4.303 · 2 / √3, decided above 0.
    assert edges.change_percent == pytest.approx(20.0)
    assert edges.change_low == pytest.approx(20 - T_975_DF2 * 2 / math.sqrt(3))
    assert (edges.verdict, edges.reason, edges.detected_after_bh) == (DETECTED, "decided above 0", True)
    assert edges.detectable_percent == pytest.approx(2 * 3.2640, abs=2e-4)  # spread 2 at 3 seeds
    assert (keypoints.verdict, keypoints.reason) == (NOT_DETECTED, "the 95% interval contains 0")
    assert not keypoints.detected_after_bh
    assert control_sentence(control_table(results)).startswith(
        "Positive control (clients drawn from quantile bins of each sample's mean target instead of scene labels): a "
        "penalty detected in 1 of 2 rows, 1 after Benjamini–Hochberg over them. The setup can show")


def test_a_control_that_shows_nothing_says_the_setup_cannot_show_a_penalty():
    results = with_control(grid({("edge_texture", "fedavg"): [[0, 0, 0]] * 3}),
                           {("edge_texture", "fedavg"): [[-5, -5, -5], [-6, -6, -6], [-4, -4, -4]]})
    row = control_table(results).iloc[0]
    assert (row.verdict, row.reason) == (NOT_DETECTED, "decided below 0: the label-based partitions give the larger loss")
    sentence = control_sentence(control_table(results))
    assert "a penalty detected in 0 of 1 rows, 0 after" in sentence
    assert f"cannot show a partition penalty of the control's size at these seeds (the control's intervals reach at " \
           f"most {-5 + T_975_DF2 / math.sqrt(3):+.1f}%)" in sentence


def test_two_seeds_detect_nothing_and_give_no_detectable_size():
    results = with_control(grid({("edge_texture", "fedavg"): [[0, 0, 0]] * 2}),
                           {("edge_texture", "fedavg"): [[50, 50, 50], [60, 60, 60]]})
    row = control_table(results).iloc[0]
    assert (row.verdict, row.reason) == (NOT_DETECTED, "2 paired seeds, 3 needed") and math.isnan(row.detectable_percent)
    assert "| edge_texture | fedavg | +55.0% [" in "\n".join(control_markdown(control_table(results)))


def test_without_property_runs_there_is_no_control_and_the_answer_is_unchanged():
    answer = grid({("edge_texture", "fedavg"): [[2, 2, 2], [3, 3, 3], [4, 4, 4]],
                   ("keypoints2d", "fedavg"): [[1, 1, 1], [2, 2, 2], [3, 3, 3]]})
    assert control_table(answer).empty and control_markdown(control_table(answer)) == []
    assert control_sentence(control_table(answer)) == ""
    # The control's rows are their own Benjamini–Hochberg family: adding them moves none of the answer's verdicts.
    with_rows = with_control(answer, {("edge_texture", "fedavg"): [[0.1, 0.1, 0.1], [-0.1, -0.1, -0.1], [0, 0, 0]],
                                      ("keypoints2d", "fedavg"): [[0.1, 0.1, 0.1], [-0.1, -0.1, -0.1], [0, 0, 0]]})
    pd.testing.assert_frame_equal(paper_table(answer, pd.DataFrame()), paper_table(with_rows, pd.DataFrame()))
