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


# ----- a constructed case: the property fully determines the target's scale -----
def write_scale_folders(root, n_images: int = 96):
    """paired_folders whose depth target is a constant map, 1 m on three images of four and 5 m on the fourth; the
    image tells which (dark or bright seeded noise), and the scene label (a/b) is drawn across both scales. The mean
    target is the property: its bins are the two scales, so a property-based client mostly sees one scale and
    learns to answer it whatever the image, while label-based clients each hold both and learn to tell them apart."""
    import numpy as np
    import yaml
    from PIL import Image

    from tests.folder_fixtures import save_rgb

    (root / "depth").mkdir(parents=True)
    rows = ["stem,label"]
    for index in range(n_images):
        stem = f"img_{index:02d}"
        rng = np.random.default_rng(index)
        high = index % 4 == 3
        save_rgb(root / "images" / f"{stem}.png", rng.integers(155 if high else 0, 256 if high else 101, (8, 8, 3)).astype(np.uint8))
        depth_mm = 5000 if high else 1000
        Image.fromarray(np.full((8, 8), depth_mm, dtype=np.uint16)).save(root / "depth" / f"{stem}.png")
        rows.append(f"{stem},{'ab'[(index // 4) % 2]}")
    (root / "targets.yaml").write_text(yaml.safe_dump({"depth": {"kind": "regression", "channels": 1, "scale": 1000}}))
    (root / "groups.csv").write_text("\n".join(rows) + "\n")
    return root


@pytest.mark.slow
def test_the_control_shows_a_penalty_where_the_property_fixes_the_targets_scale(tmp_path):
    """The image tells the scale, so a model can learn it, and label-based clients, each holding both scales, do;
    property-based clients each see mostly one scale and pull the global model toward answering it whatever the
    image: the control's final loss must come out larger than the label-based one in every seed (measured: 1.6 and
    1.9 times it), and so its change. How much larger varies from seed to seed (3 seeds did not decide it), so the
    test asks for the direction in each of 2 seeds, not for a decided row."""
    import yaml

    import run_pipeline

    root = write_scale_folders(tmp_path / "data")
    config = {"name": "scale", "data": {"source": "paired_folders", "root": str(root), "test_fraction": 0.25,
                                        "val_fraction": 0.25},
              "tasks": ["folder_regression"], "model": {"encoder": "small_cnn", "weights": "none", "image_size": 8},
              "centralized": {"n_epochs": 1, "batch_size": 8}, "embeddings": {"n_clusters": 2},
              "partition": {"groupings": ["label_based", "embedding_based", "property_based"], "alphas": [0.1],
                            "property_alphas": [0.1], "n_clients": 4},
              "federated": {"algorithms": {"fedavg": {}}, "n_rounds": 20, "local_steps": 10, "batch_size": 4,
                            "init_lr": 0.02, "client_fraction": 1.0, "eval_every": 20, "checkpoint_every": 20},
              "seeds": [0, 1], "use_accelerator": False, "heterogeneity_meter": False, "run_plots": False}
    experiment = tmp_path / "scale.yaml"
    experiment.write_text(yaml.safe_dump(config))
    run_pipeline.main([str(experiment), "--results", str(tmp_path / "results"), "--no-progress", "--threads", "1"])
    out = tmp_path / "results" / "scale"
    groups = pd.read_csv(next(out.glob("property/folder_regression-*/groups.csv")))
    assert sorted(groups["cluster"].value_counts().tolist()) == [24, 72]  # the bins are the two scales exactly
    finals = {}
    for grouping in ("label_based", "property_based"):
        for seed in (0, 1):
            metrics = pd.read_csv(next(out.glob(f"federated/folder_regression/{grouping}/a0.1/fedavg/s{seed}-*/metrics.csv")))
            finals[grouping, seed] = metrics.query("round == 20 and split == 'test' and client == 'global' and metric == 'loss'")["value"].item()
    assert all(finals["property_based", seed] > 1.2 * finals["label_based", seed] for seed in (0, 1)), finals
    control = pd.read_csv(out / "report_control.csv").iloc[0]
    assert control.change_percent > 20 and control.n_seeds == 2  # the report's control row: the mean change over seeds
