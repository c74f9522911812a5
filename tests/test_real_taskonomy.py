"""The real-Taskonomy path end to end, on a fixture built by hand in the real on-disk format (not by the renderer).

What makes it real: the spellings of real files (``segment_semantic/…_domain_segmentsemantic.png``,
``class_scene/…_domain_class_places.npy``), raw segmentation ids with 0 = unlabelled and 1..17 =
the 17 classes, 16-bit depth in 1/512 m with 65535 = no surface, and a split CSV with CR-only line
endings that lists a building omnitools.download did not fetch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from PIL import Image

import run_pipeline
from datasets.taskonomy import TaskonomyDataset, read_manifest
from datasets.taskonomy_domains import SEGMENT_IGNORE_INDEX
from pipeline.experiment import load_experiment
from utils.errors import TaskHetError

BUILDINGS = {"allensville": 52, "beechwood": 52, "coffeen": 203}  # on disk, with their Places365 scene
SPLIT_IDS = ["allensville", "benevolence", "beechwood", "coffeen"]  # benevolence is listed, never downloaded
SPLIT_CSV = "train_val_test_tiny.csv"
SIZE = 40  # not the model's 32 px, so every label is resized on the way in
VIEWS = [(point, view) for point in range(4) for view in range(2)]


def write_png(path: Path, pixels: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)


def build_real_format_root(root: Path) -> Path:
    """Three buildings × 8 views of rgb, segment_semantic, depth_euclidean and class_scene, plus the side files."""
    rng = np.random.default_rng(0)
    for building, places_index in BUILDINGS.items():
        for point, view in VIEWS:
            stem = f"point_{point}_view_{view}_domain_"
            write_png(root / "rgb" / "taskonomy" / building / f"{stem}rgb.png", rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8))
            raw = rng.integers(0, 18, (SIZE, SIZE), dtype=np.uint8)  # 0 unlabelled, 1 background, ..., 17 vase
            write_png(root / "segment_semantic" / "taskonomy" / building / f"{stem}segmentsemantic.png", raw)
            depth = rng.integers(512, 8 * 512, (SIZE, SIZE), dtype=np.uint16)  # 1..8 m in 1/512 m
            depth[:4] = 65535  # a band with no surface
            write_png(root / "depth_euclidean" / "taskonomy" / building / f"{stem}depth_euclidean.png", depth)
            scores = rng.random(365).astype(np.float32) * 0.1
            scores[places_index] = 1.0
            scene = root / "class_scene" / "taskonomy" / building / f"{stem}class_places.npy"
            scene.parent.mkdir(parents=True, exist_ok=True)
            np.save(scene, scores)
    rows = ["id,train,val,test", *(f"{building},1,0,0" for building in SPLIT_IDS)]
    (root / SPLIT_CSV).write_bytes("\r".join(rows).encode() + b"\r")  # CR-only, as the official CSVs
    (root / "places_class_names.txt").write_text("".join(f"scene_{index:03d}\n" for index in range(365)))
    return root


def experiment(tmp_path: Path, root: Path, **data) -> Path:
    config = {
        "name": "real",
        "data": {"source": "taskonomy", "root": str(root), "split_csv": SPLIT_CSV, "top_k_classes": 2,
                 "test_fraction": 0.25, "split_by": "sample", **data},
        "tasks": ["segment_semantic", "depth_euclidean"],
        "model": {"encoder": "small_cnn", "weights": "none", "image_size": 32},
        "centralized": {"n_epochs": 1, "batch_size": 8},
        "embeddings": {"n_clusters": 2},
        "partition": {"alphas": [1.0], "n_clients": 2},
        "federated": {"algorithms": {"fedavg": {}}, "n_rounds": 2, "local_steps": 1, "batch_size": 4},
        "seeds": [0],
        "use_accelerator": False,
    }
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow
def test_steps_1_to_4_run_on_real_format_data(tmp_path):
    root = build_real_format_root(tmp_path / "taskonomy")
    run_pipeline.main([str(experiment(tmp_path, root)), "--results", str(tmp_path / "results"), "--no-run_plots"])
    out = tmp_path / "results" / "real"
    (step1,) = out.glob("step1-*")
    manifest = read_manifest(step1 / "manifest.csv")
    assert set(manifest["building"]) == set(BUILDINGS) and len(manifest) == len(BUILDINGS) * len(VIEWS)
    assert set(manifest["scene_name"]) == {"scene_052", "scene_203"}
    warnings = [line for line in (step1 / "run.log").read_text().splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and "benevolence" in warnings[0]
    # What training saw: class = raw - 1, unlabelled ignored, depth in metres with the no-surface band masked.
    sample = TaskonomyDataset(root, manifest.iloc[:1], ["segment_semantic", "depth_euclidean"], SIZE)[0]
    stem = f"point_{manifest.at[0, 'point']}_view_{manifest.at[0, 'view']}_domain_"
    building = manifest.at[0, "building"]
    raw = np.array(Image.open(root / "segment_semantic" / "taskonomy" / building / f"{stem}segmentsemantic.png")).astype(np.int64)
    np.testing.assert_array_equal(sample["segment_semantic"].numpy(), np.where(raw == 0, SEGMENT_IGNORE_INDEX, raw - 1))
    depth = np.array(Image.open(root / "depth_euclidean" / "taskonomy" / building / f"{stem}depth_euclidean.png"))
    np.testing.assert_allclose(sample["depth_euclidean"][0].numpy()[4:], depth[4:] / 512.0)
    assert not sample["mask"][0, :4].any() and sample["mask"][0, 4:].all()
    for task, metric in (("segment_semantic", "miou"), ("depth_euclidean", "abs_rel")):
        for run in (out / "federated" / task).rglob("metrics.csv"):
            metrics = pd.read_csv(run)
            assert metrics["round"].max() == 2 and metric in set(metrics["metric"]), run
            assert np.isfinite(metrics[metrics.metric == "loss"].value).all()
    report = pd.read_csv(out / "report.csv")
    assert set(report.task) == {"segment_semantic", "depth_euclidean"}


def test_taskonomy_experiment_must_name_its_split_csv(tmp_path):
    root = build_real_format_root(tmp_path / "taskonomy")
    path = experiment(tmp_path, root, split_csv=None)
    with pytest.raises(TaskHetError, match="data.split_csv is required for data.source taskonomy"):
        load_experiment(path)
    with pytest.raises(TaskHetError, match="data.split_csv"):
        run_pipeline.main([str(path), "--results", str(tmp_path / "results")])
    assert not (tmp_path / "results").exists()
    path = experiment(tmp_path, root, split_csv="train_val_test_medium.csv")
    with pytest.raises(TaskHetError, match="data.split_csv: .*train_val_test_medium.csv does not exist"):
        run_pipeline.main([str(path), "--results", str(tmp_path / "results")])
    assert not any((tmp_path / "results").rglob("stage.json"))


def test_split_csv_is_refused_for_other_sources(tmp_path):
    path = tmp_path / "synthetic.yaml"
    path.write_text(yaml.safe_dump({"data": {"source": "synthetic", "split_csv": "x.csv"}}))
    with pytest.raises(TaskHetError, match="data.split_csv is only for data.source taskonomy"):
        load_experiment(path)
