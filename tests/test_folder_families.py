"""A user's own folders: imagefolder and paired_folders through step 1, steps 2-4 and run_pipeline.py, and every
bad input of theirs as one error line naming the file (the generic family checks are in test_families.py)."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from PIL import Image

import run_pipeline
from datasets.family import load_manifest
from datasets.imagefolder import ImageFolderDataset
from datasets.paired_folders import PairedDataset
from datasets.paired_selection import label_numbers
from datasets.paired_targets import make_spec
from datasets.taskonomy_domains import SEGMENT_IGNORE_INDEX
from models import get_task, load_task_model
from pipeline.experiment import load_experiment
from steps import assign, embed, federated, select, train_centralized
from tests.folder_fixtures import paired_sample, save_rgb, write_imagefolder, write_paired_folders
from utils import cli
from utils.cli import run_main
from utils.errors import TaskHetError

SIZE = 8  # the models' input side: small_cnn at 8 px takes a few milliseconds a step
ROOT = Path(__file__).resolve().parents[1]


def one_error_line(capsys, main: Callable, argv: list[str]) -> str:
    """Run ``main`` as a script runs; it must stop with exit code 2 and exactly one ``error:`` line on stderr."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        run_main(main, argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def step1(family: str, root: Path, out: Path, *extra: str) -> Path:
    return select.main(["--family", family, "--data_path", str(root), "--out", str(out), "--no-progress", *extra])


# ----- step 1 -----
def test_imagefolder_step1_labels_by_sorted_folder_and_splits_each_class(tmp_path):
    root = write_imagefolder(tmp_path / "photos", per_class=6, classes=("owl", "cat", "dog"))
    (root / "cat" / "notes.txt").write_text("not an image")
    (root / "README.md").write_text("a file in no class folder")
    (root / "dog" / ".DS_Store").write_bytes(b"hidden: never looked at")
    path = step1("imagefolder", root, tmp_path / "s1", "--test_fraction", "0.25", "--val_fraction", "0.25")
    _, manifest = load_manifest(path)
    # torchvision's numbering: class folders in name order
    assert dict(zip(manifest["class_name"], manifest["label"])) == {"cat": 0, "dog": 1, "owl": 2}
    assert manifest["sample_id"].tolist() == manifest["image_path"].tolist() and len(manifest) == 18
    # 6 images a class: round(0.25 * 6 = 1.5, half up) = 2 test, then round(0.25 * 4) = 1 of the 4 train for validation
    counts = pd.read_csv(tmp_path / "s1" / "class_counts.csv")
    assert counts.to_dict("list") == {"label": [0, 1, 2], "num_train": [3, 3, 3], "num_val": [1, 1, 1], "num_test": [2, 2, 2]}
    log = (tmp_path / "s1" / "run.log").read_text()
    assert "WARNING skipped 2 entries" in log and "README.md, cat/notes.txt" in log and ".DS_Store" not in log
    again = step1("imagefolder", root, tmp_path / "again", "--test_fraction", "0.25", "--val_fraction", "0.25")
    assert pd.read_csv(again).equals(pd.read_csv(path))  # seeded
    other = step1("imagefolder", root, tmp_path / "seed1", "--test_fraction", "0.25", "--seed", "1")
    assert not pd.read_csv(other)["split"].equals(pd.read_csv(path)["split"])


def test_imagefolder_split_csv_fixes_the_split(tmp_path):
    root = write_imagefolder(tmp_path / "photos", per_class=3, classes=("a", "b"))
    (root / "split.csv").write_text("path,split\na/a_0.png,train\n./a/a_1.png,val\na/a_2.JPG,test\nb/b_0.png,train\n"
                                    "b/b_1.png,test\n")
    _, manifest = load_manifest(step1("imagefolder", root, tmp_path / "s1", "--split_csv", "split.csv"))
    assert manifest[["image_path", "split", "val"]].values.tolist() == [
        ["a/a_0.png", "train", 0], ["a/a_1.png", "train", 1], ["a/a_2.JPG", "test", 0], ["b/b_0.png", "train", 0],
        ["b/b_1.png", "test", 0]]
    log = (tmp_path / "s1" / "run.log").read_text()
    assert "leaves out 1 image(s)" in log and "skipped" not in log  # b/b_2.JPG; split.csv is no stray file


def test_a_link_to_a_parent_folder_is_listed_once(tmp_path):
    root = write_imagefolder(tmp_path / "photos", per_class=2, classes=("a", "b"))
    (root / "a" / "again").symlink_to(root, target_is_directory=True)  # a loop a walk that follows links would not leave
    _, manifest = load_manifest(step1("imagefolder", root, tmp_path / "s1", "--test_fraction", "0.5"))
    assert manifest["image_path"].tolist() == ["a/a_0.png", "a/a_1.JPG", "b/b_0.png", "b/b_1.JPG"]


def test_paired_step1_records_targets_groups_and_a_split_stratified_by_label(tmp_path):
    root = write_paired_folders(tmp_path / "data", n_images=12)
    _, manifest = load_manifest(step1("paired_folders", root, tmp_path / "s1", "--test_fraction", "0.25",
                                      "--val_fraction", "0.25"))
    assert manifest["sample_id"].tolist() == [f"img_{index:02d}.png" for index in range(12)]
    assert manifest["label"].tolist() == [0, 1] * 6 and manifest["label_name"].tolist() == ["a", "b"] * 6
    assert manifest["source"].tolist() == [f"s{index % 4}" for index in range(12)]
    # per label (6 images): round(1.5) = 2 test, round(0.25 * 4) = 1 validation
    for label in (0, 1):
        rows = manifest[manifest["label"] == label]
        assert ((rows["split"] == "test").sum(), rows["val"].sum()) == (2, 1)
    first = manifest.iloc[0]
    assert (first["regression_path"], first["regression_target"], first["regression_channels"], first["regression_scale"],
            first["regression_ignore"]) == ("depth/img_00.png", "depth", "1", "1000.0", "0")
    assert (first["segmentation_path"], first["segmentation_channels"], first["segmentation_ignore"]) == (
        "semantic/img_00.npy", "3", "255")
    assert (first["edges_path"], first["edges_ignore"]) == ("boundaries/img_00.png", "")


def test_paired_targets_flag_keeps_some_targets(tmp_path):
    root = write_paired_folders(tmp_path / "data", n_images=8)
    _, manifest = load_manifest(step1("paired_folders", root, tmp_path / "s1", "--targets", "semantic"))
    assert [column for column in manifest.columns if column.endswith("_path")] == ["image_path", "segmentation_path"]


def test_labels_are_numbered_in_sorted_order_numerically_when_whole_numbers():
    assert label_numbers(pd.Series(["10", "9", "10", "2"])).tolist() == [2, 1, 2, 0]
    assert label_numbers(pd.Series(["kitchen", "bath", "kitchen"])).tolist() == [1, 0, 1]
    assert label_numbers(pd.Series(["", ""])).tolist() == [0, 0]


# ----- what the datasets hold -----
def square_paired_root(tmp_path: Path) -> Path:
    """Paired folders of 8x8 images (the model size: no resize), so items can be checked pixel by pixel."""
    root = write_paired_folders(tmp_path / "square", n_images=8)
    for index in range(8):
        sample = paired_sample(index, (SIZE, SIZE))
        stem = f"img_{index:02d}"
        save_rgb(root / "images" / f"{stem}.png", sample["image"])
        Image.fromarray(sample["depth"]).save(root / "depth" / f"{stem}.png")
        np.save(root / "semantic" / f"{stem}.npy", sample["semantic"])
        Image.fromarray(sample["boundaries"], mode="L").save(root / "boundaries" / f"{stem}.png")
    return root


@pytest.mark.parametrize("cached", [False, True])
def test_paired_items_are_the_files_decoded_by_hand(tmp_path, cached):
    root = square_paired_root(tmp_path)
    _, manifest = load_manifest(step1("paired_folders", root, tmp_path / "s1"))
    row = int(np.flatnonzero(manifest["sample_id"] == "img_03.png")[0])
    sample = paired_sample(3, (SIZE, SIZE))
    cache = tmp_path / "cache" if cached else None
    for task, check in (("folder_regression", "depth"), ("folder_segmentation", "semantic"), ("folder_edges", "edges")):
        dataset = PairedDataset(root, manifest, get_task(task), SIZE, cache)
        for item in (dataset[row], dataset[row]):  # the second from the cache it filled
            assert torch.equal(item["image"], torch.from_numpy(sample["image"]).permute(2, 0, 1).float() / 255)
            assert item["label"] == 1 and item["sample_id"] == "img_03.png"
            target, mask = item[task], item["mask"][0]
            if check == "depth":  # mm / scale 1000 = metres; stored 0 is no depth
                assert target.shape == (1, SIZE, SIZE) and target.dtype == torch.float32
                assert target[0, 2, 5] == pytest.approx(float(sample["depth"][2, 5]) / 1000) == pytest.approx(0.85)
                assert not mask[0, 0] and mask.sum() == SIZE * SIZE - 1
            elif check == "semantic":  # column // 4 % 3; the last row is 255, unlabelled
                assert target.dtype == torch.int64 and target[0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
                assert (target[-1] == SEGMENT_IGNORE_INDEX).all() and not mask[-1].any() and mask[:-1].all()
            else:  # a vertical edge at column 3 (index 3 % width)
                assert target[0, :, 3].eq(1).all() and target.sum() == SIZE and mask.all()


def test_imagefolder_items_and_an_empty_batch(tmp_path):
    root = write_imagefolder(tmp_path / "photos", per_class=2, classes=("a", "b"))
    Image.fromarray(np.full((SIZE, SIZE, 3), 51, np.uint8)).save(root / "b" / "b_0.png")
    _, manifest = load_manifest(step1("imagefolder", root, tmp_path / "s1", "--test_fraction", "0.5"))
    dataset = ImageFolderDataset(root, manifest, SIZE)
    item = dataset[int(np.flatnonzero(manifest["image_path"] == "b/b_0.png")[0])]
    assert torch.equal(item["image"], torch.full((3, SIZE, SIZE), 0.2)) and item["folder_class"] == item["label"] == 1
    empty = dataset.read_batch([])
    assert empty["image"].shape == (0, 3, SIZE, SIZE) and empty["label"].dtype == torch.int64 and empty["sample_id"] == []


def test_a_task_without_its_target_names_the_targets_it_has(tmp_path):
    root = write_paired_folders(tmp_path / "data", n_images=8)
    _, manifest = load_manifest(step1("paired_folders", root, tmp_path / "s1", "--targets", "depth"))
    with pytest.raises(Exception, match="task folder_edges: the paired_folders manifest has no edges target "
                                        r"\(its targets: depth \(regression: folder_regression\)\)"):
        PairedDataset(root, manifest, get_task("folder_edges"), SIZE)


# ----- steps 1 to 4 -----
def chain(tmp_path: Path, family: str, root: Path, task: str, step1_flags: tuple[str, ...] = ()) -> dict[str, Path]:
    """Steps 1, 2, 3, 3b (embedding-based) and 4 at 8 px, one epoch, one round."""
    out = {name: tmp_path / name for name in ("s1", "s2", "s3", "s3b", "s4")}
    manifest = step1(family, root, out["s1"], *step1_flags)
    shared = ["--data_path", str(root), "--manifest", str(manifest), "--no-use_accelerator", "--no-progress"]
    train_centralized.main(["--task", task, "--encoder", "small_cnn", "--weights", "none", "--image_size", str(SIZE),
                            "--batch_size", "4", "--n_epochs", "1", "--cache_dir", str(tmp_path / "cache"), *shared,
                            "--no-plots", "--out", str(out["s2"])])
    embed.main(["--checkpoint", str(out["s2"] / "best.pt"), "--n_clusters", "2", "--n_init", "1", *shared,
                "--out", str(out["s3"])])
    assign.main(["--manifest", str(manifest), "--groups", str(out["s3"] / "clusters.csv"), "--n_clients", "2",
                 "--alpha", "1.0", "--no-progress", "--out", str(out["s3b"])])
    federated.main(["--task", task, "--encoder", "small_cnn", "--image_size", str(SIZE), "--n_rounds", "1",
                    "--local_steps", "1", "--batch_size", "4", "--assignments", str(out["s3b"] / "assignments.csv"),
                    "--rand_seed", "0", *shared, "--no-plots", "--out", str(out["s4"])])
    return {**out, "manifest": manifest}


def test_imagefolder_through_steps_1_to_4(tmp_path):
    root = write_imagefolder(tmp_path / "photos", per_class=6)
    made = chain(tmp_path, "imagefolder", root, "folder_class", ("--val_fraction", "0.25"))
    model = load_task_model(made["s4"] / "best.pt")
    assert model.head.out_features == 3  # the three class folders
    metrics = pd.read_csv(made["s4"] / "metrics.csv")
    assert {"top1", "loss"} <= set(metrics.loc[metrics["split"] == "test", "metric"])
    assign.main(["--manifest", str(made["manifest"]), "--n_clients", "2", "--alpha", "1.0", "--no-progress",
                 "--out", str(tmp_path / "labels")])  # label-based: the class folders
    assert set(pd.read_csv(tmp_path / "labels" / "assignments.csv")["group"]) == {0, 1, 2}


@pytest.mark.parametrize("task, outputs", [("folder_segmentation", 3), ("folder_regression", 1)])
def test_paired_folders_through_steps_1_to_4(tmp_path, task, outputs):
    root = write_paired_folders(tmp_path / "data", n_images=12)
    made = chain(tmp_path, "paired_folders", root, task, ("--val_fraction", "0.25"))
    assert load_task_model(made["s2"] / "best.pt").head.out_channels == outputs  # targets.yaml's classes / channels
    assert load_task_model(made["s4"] / "best.pt").head.out_channels == outputs
    primary = get_task(task).primary_metric
    metrics = pd.read_csv(made["s4"] / "metrics.csv")
    assert metrics.loc[(metrics["split"] == "test") & (metrics["metric"] == primary), "value"].notna().all()
    assign.main(["--manifest", str(made["manifest"]), "--scheme", "natural", "--n_clients", "2", "--no-progress",
                 "--out", str(tmp_path / "natural")])  # groups.csv's sources: a client holds all of one source's rows
    table = pd.read_csv(tmp_path / "natural" / "assignments.csv").merge(
        pd.read_csv(made["manifest"])[["sample_id", "source"]], on="sample_id")
    assert table["client_id"].nunique() == 2 and table.groupby("client_id")["source"].nunique().eq(1).all()


def test_without_labels_a_label_based_partition_is_one_error_line(tmp_path, capsys):
    root = write_paired_folders(tmp_path / "data", n_images=8, labels=False, sources=False)
    manifest = step1("paired_folders", root, tmp_path / "s1")
    line = one_error_line(capsys, assign.main, ["--manifest", str(manifest), "--n_clients", "2", "--out", str(tmp_path / "a")])
    assert "--groups label" in line and "has no label" in line and "groups.csv" in line and "clusters.csv" in line
    line = one_error_line(capsys, assign.main, ["--manifest", str(manifest), "--scheme", "natural", "--n_clients", "2",
                                                "--out", str(tmp_path / "b")])
    assert "--scheme natural" in line and "has no source" in line
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    iid = assign.main(["--manifest", str(manifest), "--scheme", "iid", "--n_clients", "2", "--no-progress",
                       "--out", str(tmp_path / "iid")])  # needs no labels
    assert pd.read_csv(iid)["client_id"].nunique() == 2
    line = one_error_line(capsys, select.main, ["--family", "paired_folders", "--data_path", str(root), "--require_labels",
                                                "--out", str(tmp_path / "c")])
    assert "groups.csv gives no label" in line


# ----- run_pipeline.py -----
def folder_experiment(tmp_path: Path, root: Path, source: str, task: str) -> Path:
    config = {
        "name": "own", "data": {"source": source, "root": str(root), "test_fraction": 0.25, "val_fraction": 0.25},
        "tasks": [task], "model": {"encoder": "small_cnn", "weights": "none", "image_size": SIZE},
        "centralized": {"n_epochs": 1, "batch_size": 4}, "embeddings": {"n_clusters": 2},
        "partition": {"alphas": [1.0], "n_clients": 2},
        "federated": {"algorithms": {"fedavg": {}}, "n_rounds": 1, "local_steps": 1, "batch_size": 4},
        "seeds": [0], "use_accelerator": False,
    }
    path = tmp_path / "own.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_run_pipeline_main_job_on_paired_folders(tmp_path):
    root = write_paired_folders(tmp_path / "data", n_images=12)
    experiment = folder_experiment(tmp_path, root, "paired_folders", "folder_segmentation")
    run_pipeline.main([str(experiment), "--results", str(tmp_path / "results"), "--no-progress", "--no-run_plots"])
    out = tmp_path / "results" / "own"
    report = pd.read_csv(out / "report.csv")
    assert list(report.task) == ["folder_segmentation"] and list(report.algorithm) == ["fedavg"]
    assert report.filter(like="loss_mean").notna().all(axis=None)
    groupings = {path.parent.name for path in out.glob("federated/folder_segmentation/*/*")}
    assert groupings == {"label_based", "embedding_based"}
    embedded = pd.read_csv(next(out.glob("embeddings/folder_segmentation-*/clusters.csv")))
    assert len(embedded) == 12  # the embedding-based partition's clusters cover every image
    step1_config = json.loads(next(out.glob("step1-*/config.json")).read_text())["args"]
    assert (step1_config["data_path"], step1_config["require_labels"]) == (str(root), True)


def test_run_pipeline_on_a_folder_without_labels_is_one_error_line(tmp_path, capsys):
    root = write_paired_folders(tmp_path / "data", n_images=8, labels=False)
    experiment = folder_experiment(tmp_path, root, "paired_folders", "folder_edges")
    line = one_error_line(capsys, run_pipeline.main, [str(experiment), "--results", str(tmp_path / "results"),
                                                     "--no-progress"])
    assert "groups.csv gives no label" in line and "label-based partition" in line


def yaml_blocks(document: str) -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", (ROOT / document).read_text(), re.S)


def test_the_documented_experiment_file_and_targets_files_are_valid(tmp_path):
    experiment = next(block for block in yaml_blocks("docs/howto/own-data.md") if "run" not in block and "name:" in block)
    (tmp_path / "mine.yaml").write_text(experiment)
    config = load_experiment(tmp_path / "mine.yaml")
    assert (config["data"]["source"], config["tasks"]) == ("paired_folders", ["folder_segmentation"])
    for document in ("docs/howto/own-data.md", "docs/DATA.md"):
        targets = yaml.safe_load(next(block for block in yaml_blocks(document) if "kind:" in block))
        kinds = [make_spec(name, fields, document).kind for name, fields in targets.items()]
        assert kinds == ["regression", "segmentation", "edges"][:len(kinds)]


@pytest.mark.parametrize("split_csv, refused", [("split.csv", None), (None, None), ("", "data.split_csv must be"),
                                               (7, "data.split_csv must be")])
def test_a_folder_experiment_may_name_a_split_csv(tmp_path, split_csv, refused):
    path = folder_experiment(tmp_path, tmp_path / "mine", "imagefolder", "folder_class")
    config = yaml.safe_load(path.read_text())
    config["data"]["split_csv"] = split_csv
    path.write_text(yaml.safe_dump(config))
    if refused is None:
        assert load_experiment(path)["data"]["split_csv"] == split_csv
    else:
        with pytest.raises(TaskHetError, match=f"own.yaml: {refused}"):
            load_experiment(path)


def test_a_folder_experiment_names_only_folder_tasks(tmp_path):
    path = folder_experiment(tmp_path, tmp_path / "mine", "paired_folders", "depth_euclidean")
    with pytest.raises(TaskHetError, match="task 'depth_euclidean' is not a task of data family 'paired_folders'; its "
                                           "tasks: folder_regression, folder_segmentation, folder_edges"):
        load_experiment(path)


# ----- bad inputs: one line naming the file -----
BROKEN_PNG = b"\x89PNG\r\n\x1a\n not really a PNG"  # a PNG's signature, then nothing a decoder can read


def truncated(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def edit_targets(root: Path, name: str, fields: dict) -> None:
    targets = yaml.safe_load((root / "targets.yaml").read_text())
    targets[name] = fields
    (root / "targets.yaml").write_text(yaml.safe_dump(targets))


def split_csv(root: Path, text: str) -> list[str]:
    """Write ``root/split.csv``; returns the flag that names it."""
    write_text(root / "split.csv", text)
    return ["--split_csv", "split.csv"]


def grey16(root: Path, file: str, shape: tuple[int, int]) -> None:
    Image.fromarray(np.ones(shape, np.uint16)).save(root / file)


def groups(rows: range, extra: str = "") -> str:
    return "stem,label\n" + "".join(f"img_{index:02d},a\n" for index in rows) + extra


# case -> (family, edit of a fresh tiny folder returning step 1's extra flags (None: none), what the line names).
# imagefolder's folder: cat, dog, owl with 4 images each; paired_folders': 8 images of 12x10 px (folder_fixtures.py).
BAD_INPUTS: dict[str, tuple[str, Callable[[Path], list[str] | None], tuple[str, ...]]] = {
    "corrupt image": ("imagefolder", lambda root: (root / "dog" / "dog_1.png").write_bytes(BROKEN_PNG) and None,
                      ("dog/dog_1.png", "not a readable image")),
    "truncated image": ("imagefolder", lambda root: truncated(root / "owl" / "owl_2.png"), ("owl/owl_2.png",)),
    "empty class folder": ("imagefolder", lambda root: (root / "yak").mkdir(), ("yak", "holds no image")),
    "one class": ("imagefolder", lambda root: split_csv(root, "path,split\ncat/cat_0.png,train\ncat/cat_1.png,test\n"),
                  ("1 class folder(s) with images (cat)",)),
    "split csv leaves the root": ("imagefolder", lambda root: split_csv(root, "path,split\n../outside.png,train\n"),
                                  ("split.csv", "row 2", "'../outside.png'", "without '..'")),
    "split csv absolute path": ("imagefolder", lambda root: split_csv(root, f"path,split\n{root / 'cat' / 'cat_0.png'},train\n"),
                                ("split.csv", "row 2", "must be a path relative to")),
    "split csv names a non-image": ("imagefolder", lambda root: (write_text(root / "cat" / "notes.txt", "x"),
                                                                 split_csv(root, "path,split\ncat/notes.txt,train\n"))[1],
                                    ("split.csv", "row 2", "'cat/notes.txt'", "is not an image")),
    "split csv names a missing file": ("imagefolder",
                                       lambda root: split_csv(root, "path,split\ncat/cat_0.png,train\ncat/gone.png,test\n"),
                                       ("split.csv", "row 3", "'cat/gone.png'", "does not exist")),
    "split csv image outside a class folder": ("imagefolder", lambda root: (
        save_rgb(root / "loose.png", np.zeros((4, 4, 3), np.uint8)), split_csv(root, "path,split\nloose.png,train\n"))[1],
        ("split.csv", "'loose.png'", "not inside a class folder")),
    "split csv bad split": ("imagefolder", lambda root: split_csv(root, "path,split\ncat/cat_0.png,holdout\n"),
                            ("split.csv", "row 2", "'holdout'")),
    "split csv repeats an image": ("imagefolder",
                                   lambda root: split_csv(root, "path,split\ncat/cat_0.png,train\n./cat//cat_0.png,test\n"),
                                   ("split.csv", "rows 2 and 3", "'cat/cat_0.png'")),
    "missing target": ("paired_folders", lambda root: (root / "depth" / "img_03.png").unlink(),
                       ("images/img_03.png", "has no depth target")),
    "target without image": ("paired_folders", lambda root: grey16(root, "depth/extra.png", (10, 12)),
                             ("depth/extra.png", "has no image images/extra")),
    "size mismatch": ("paired_folders", lambda root: grey16(root, "depth/img_02.png", (5, 7)),
                      ("depth/img_02.png", "7x5 pixels", "img_02.png is 12x10")),
    "corrupt image (paired)": ("paired_folders", lambda root: (root / "images" / "img_01.png").write_bytes(b"junk") and None,
                               ("images/img_01.png", "not a readable image")),
    "corrupt npy target": ("paired_folders", lambda root: (root / "semantic" / "img_04.npy").write_bytes(b"junk") and None,
                           ("semantic/img_04.npy", "not a readable .npy")),
    "non-finite npy target": ("paired_folders", lambda root: np.save(root / "semantic" / "img_04.npy", np.full((10, 12), np.nan)),
                              ("semantic/img_04.npy", "non-finite")),
    "class id out of range": ("paired_folders", lambda root: np.save(root / "semantic" / "img_05.npy", np.full((10, 12), 7)),
                              ("semantic/img_05.npy", "holds 7", "not a class id 0..2")),
    "wrong channels": ("paired_folders", lambda root: save_rgb(root / "depth" / "img_06.png", np.zeros((10, 12, 3), np.uint8))
                       and None, ("depth/img_06.png", "3 channel(s), expected 1")),
    "two images of one stem": ("paired_folders", lambda root: save_rgb(root / "images" / "img_00.jpg",
                                                                       np.zeros((10, 12, 3), np.uint8)) and None,
                               ("images/img_00.jpg", "images/img_00.png", "same stem")),
    "no targets.yaml": ("paired_folders", lambda root: (root / "targets.yaml").unlink(), ("targets.yaml", "does not exist")),
    "target name leaves the root": ("paired_folders", lambda root: edit_targets(root, "../depth", {"kind": "edges"}),
                                    ("targets.yaml", "'../depth'")),
    "unknown targets.yaml key": ("paired_folders",
                                 lambda root: edit_targets(root, "depth", {"kind": "regression", "channels": 1, "scal": 1}),
                                 ("targets.yaml", "'depth'", "unknown key 'scal'")),
    "unknown kind": ("paired_folders", lambda root: edit_targets(root, "depth", {"kind": "depthmap"}),
                     ("targets.yaml", "kind must be one of")),
    "ignore is a class": ("paired_folders",
                          lambda root: edit_targets(root, "semantic", {"kind": "segmentation", "classes": 3, "ignore": 1}),
                          ("targets.yaml", "'semantic'", "outside the class ids 0..2")),
    "target folder missing": ("paired_folders", lambda root: (edit_targets(root, "normals", {"kind": "regression",
                                                                                             "channels": 3}),
                                                              ["--targets", "normals"])[1],
                              ("normals", "does not exist")),
    "two targets of one kind": ("paired_folders",
                                lambda root: edit_targets(root, "height", {"kind": "regression", "channels": 1}),
                                ("targets.yaml", "depth and height", "--targets")),
    "groups.csv unknown stem": ("paired_folders",
                                lambda root: write_text(root / "groups.csv", groups(range(8), "../images/img_00,b\n")),
                                ("groups.csv", "row 10", "'../images/img_00'")),
    "groups.csv misses an image": ("paired_folders", lambda root: write_text(root / "groups.csv", groups(range(7))),
                                   ("groups.csv", "images/img_07.png")),
    "groups.csv unknown column": ("paired_folders", lambda root: write_text(root / "groups.csv", "stem,lable\nimg_00,a\n"),
                                  ("groups.csv", "got stem, lable")),
    "split csv unknown stem": ("paired_folders", lambda root: split_csv(root, "stem,split\nimg_00,train\nimg_99,test\n"),
                               ("split.csv", "row 3", "'img_99'")),
}
BUILD_FOLDER = {"imagefolder": lambda root: write_imagefolder(root, per_class=4),
                "paired_folders": lambda root: write_paired_folders(root, n_images=8)}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_a_bad_input_is_one_error_line_naming_it(case, tmp_path, capsys):
    family, edit, names = BAD_INPUTS[case]
    root = BUILD_FOLDER[family](tmp_path / "data")
    extra = edit(root) or []
    line = one_error_line(capsys, select.main, ["--family", family, "--data_path", str(root), *extra,
                                                "--out", str(tmp_path / "out"), "--no-progress"])
    for name in names:
        assert name in line, (name, line)
    assert not (tmp_path / "out").exists()  # a refused step 1 leaves nothing


@pytest.mark.parametrize("column, value, names", [
    ("image_path", "../../etc/passwd.png", ("row 3", "image_path", "without '..'")),
    ("regression_path", "/etc/passwd", ("row 3", "regression_path", "must be a path relative to")),
    ("regression_channels", "2", ("row 3", "regression_channels", "'1' as on row 2")),
    ("label", "7", ("row 3", "label_name 'b' goes with more than one label")),
])
def test_an_edited_manifest_is_one_error_line_naming_the_row(tmp_path, capsys, column, value, names):
    root = write_paired_folders(tmp_path / "data", n_images=8)
    manifest = pd.read_csv(step1("paired_folders", root, tmp_path / "s1"), dtype=str, keep_default_na=False)
    manifest.loc[1, column] = value
    manifest.to_csv(tmp_path / "edited.csv", index=False)
    line = one_error_line(capsys, assign.main, ["--manifest", str(tmp_path / "edited.csv"), "--n_clients", "2",
                                                "--out", str(tmp_path / "out")])
    assert "edited.csv" in line and all(name in line for name in names), line


# ----- the step-1 command lines -----
@pytest.mark.parametrize("module", ["select_imagefolder", "select_paired"])
def test_the_step1_parsers_bound_every_number_and_take_the_runtime_flags(module):
    parser = importlib.import_module(f"steps.{module}").build_parser()
    options = {option for action in parser._actions for option in action.option_strings}
    assert {"--progress", "--no-progress", "--threads", "--data_path", "--split_csv"} <= options
    for action in parser._actions:
        if isinstance(action.type, cli.Range):
            assert action.default is None or action.type.contains(action.default)
            with pytest.raises(Exception, match=action.option_strings[0]):
                parser.parse_args(["--data_path", "d", action.option_strings[0], "1e300"])
    assert "(default: 0.2) (default" not in " ".join(parser.format_help().split())
