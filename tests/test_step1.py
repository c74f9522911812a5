"""Step 1 (steps/select_scenes.py, extract_datapoints_for_experiments.py, and datasets.selection) on tiny rendered data."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from datasets.selection import (SelectionConfig, read_scene_names, read_split_csv, select_datapoints, split_samples,
                                summary_line, write_selection)
from datasets.synthetic import PLACES_FILE, SPLIT_FILE
from datasets.taskonomy import MANIFEST_COLUMNS, domain_dir, read_manifest
from datasets.taskonomy_domains import DOMAINS
from steps import select_scenes as step1
from tests.fixtures import render_tiny_dataset, tiny_data_root  # noqa: F401
from utils.cli import run_main
from utils.errors import TaskHetError


@pytest.fixture
def data_copy(tiny_data_root, tmp_path) -> Path:
    """A writable copy of the tiny data root (for tests that damage it)."""
    return Path(shutil.copytree(tiny_data_root, tmp_path / "data"))


def config_for(root: Path, **changes) -> SelectionConfig:
    return replace(SelectionConfig(data_path=root, top_k_classes=16, test_fraction=0.25), **changes)


def test_manifest_has_one_row_per_complete_sample(tiny_data_root):
    selection = select_datapoints(config_for(tiny_data_root), progress=False)
    manifest = selection.manifest
    assert list(manifest.columns) == [*MANIFEST_COLUMNS, "val"]
    assert len(manifest) == 4 * 6 and manifest["sample_id"].is_unique
    expected_ids = {f"synth00{b}_point_{p}_view_{v}" for b in range(4) for p in range(2) for v in range(3)}
    assert set(manifest["sample_id"]) == expected_ids
    for row in manifest.itertuples():
        assert row.sample_id == f"{row.building}_point_{row.point}_view_{row.view}"
        assert not Path(row.rgb_path).is_absolute() and (tiny_data_root / row.rgb_path).is_file()
    assert set(manifest["split"]) == {"train", "test"}
    assert (manifest["split"] == "test").sum() == 6


def test_incomplete_samples_are_left_out(data_copy):
    (domain_dir(data_copy, "keypoints3d", "synth002") / "point_1_view_0_domain_keypoints3d.png").unlink()
    manifest = select_datapoints(config_for(data_copy, domains=("keypoints3d",)), progress=False).manifest
    assert len(manifest) == 23 and "synth002_point_1_view_0" not in set(manifest["sample_id"])
    assert len(select_datapoints(config_for(data_copy), progress=False).manifest) == 24  # keypoints3d not asked for
    only_depth = select_datapoints(config_for(data_copy, domains=("depth_euclidean",)), progress=False).manifest
    assert len(only_depth) == 24


def test_scene_label_is_argmax_of_class_scene_remapped_by_frequency(data_copy):
    # Relabel one view of synth001 as synth000's class, so that class is the most frequent.
    first_class = int(np.argmax(np.load(domain_dir(data_copy, "class_scene", "synth000") / "point_0_view_0_domain_class_places.npy")))
    moved = domain_dir(data_copy, "class_scene", "synth001") / "point_1_view_2_domain_class_places.npy"
    scores = np.zeros(365, np.float32)
    scores[first_class] = 1.0
    np.save(moved, scores)
    selection = select_datapoints(config_for(data_copy, top_k_classes=2), progress=False)
    names = read_scene_names(data_copy / PLACES_FILE)
    counts = selection.class_counts
    assert list(counts["scene_class"]) == [0, 1]
    assert counts.at[0, "places_index"] == first_class and counts.at[0, "num_samples"] == 7
    assert list(counts["scene_name"]) == [names[index] for index in counts["places_index"]]
    manifest = selection.manifest
    assert set(manifest["scene_class"]) == {0, 1}
    assert manifest.loc[manifest["sample_id"] == "synth001_point_1_view_2", "scene_class"].item() == 0
    assert selection.num_labels_found == 4 and len(manifest) == int(counts["num_samples"].sum())


def test_split_by_building_keeps_buildings_whole(tiny_data_root):
    manifest = select_datapoints(config_for(tiny_data_root, split_by="building", test_fraction=0.5), progress=False).manifest
    splits_per_building = manifest.groupby("building")["split"].nunique()
    assert (splits_per_building == 1).all()
    assert manifest.groupby("split")["building"].nunique().to_dict() == {"test": 2, "train": 2}


def test_split_is_seeded(tiny_data_root):
    first = select_datapoints(config_for(tiny_data_root, seed=3), progress=False).manifest
    again = select_datapoints(config_for(tiny_data_root, seed=3), progress=False).manifest
    other = select_datapoints(config_for(tiny_data_root, seed=4), progress=False).manifest
    assert first.equals(again)
    assert not first["split"].equals(other["split"])


def test_clients_to_include_takes_first_buildings_or_named_ones(tiny_data_root):
    order = pd.read_csv(tiny_data_root / SPLIT_FILE)["id"].tolist()
    first_two = select_datapoints(config_for(tiny_data_root, taskonomy_clients_to_include=2), progress=False).manifest
    assert set(first_two["building"]) == set(order[:2])
    named = select_datapoints(config_for(tiny_data_root, taskonomy_clients_to_include=("synth003", "synth001")), progress=False)
    assert set(named.manifest["building"]) == {"synth001", "synth003"} and named.buildings == ["synth003", "synth001"]
    with pytest.raises(TaskHetError, match="synth009 not in split CSV"):
        select_datapoints(config_for(tiny_data_root, taskonomy_clients_to_include=("synth009",)), progress=False)


def test_missing_data_root_or_domain_folder(data_copy):
    with pytest.raises(TaskHetError, match="data root .*absent does not exist"):
        select_datapoints(config_for(data_copy / "absent"), progress=False)
    shutil.rmtree(data_copy / "edge_texture")
    with pytest.raises(TaskHetError, match="domain folder .*edge_texture/taskonomy is missing"):
        select_datapoints(config_for(data_copy, domains=("edge_texture",)), progress=False)


def write_cr_split_csv(path: Path, buildings: list[str]) -> None:
    """A split CSV as the official ones are written: CR-only line endings."""
    path.write_bytes("\r".join(["id,train,val,test", *(f"{building},1,0,0" for building in buildings)]).encode() + b"\r")


def test_split_csv_with_cr_only_line_endings_is_read(tmp_path):
    write_cr_split_csv(tmp_path / "splits.csv", ["allensville", "beechwood", "coffeen"])
    assert b"\n" not in (tmp_path / "splits.csv").read_bytes()
    assert read_split_csv(tmp_path / "splits.csv") == ["allensville", "beechwood", "coffeen"]


def test_buildings_of_split_csv_not_on_disk_are_skipped_with_one_warning(data_copy, tmp_path):
    # As the official tiny CSV, which lists 35 buildings of which omnitools.download fetches 34.
    write_cr_split_csv(data_copy / "official.csv", ["ghosttown", "synth000", "synth001", "nowhere", "synth002", "synth003"])
    shutil.rmtree(domain_dir(data_copy, "depth_euclidean", "synth003"))  # half-downloaded: no depth folder
    config = config_for(data_copy, client_file_name="official.csv", domains=("depth_euclidean",))
    selection = select_datapoints(config, progress=False)
    assert selection.buildings == ["synth000", "synth001", "synth002"]
    assert selection.missing_buildings == ["ghosttown (no rgb folder)", "nowhere (no rgb folder)",
                                           "synth003 (no depth_euclidean folder)"]
    assert set(selection.manifest["building"]) == {"synth000", "synth001", "synth002"}
    first_two = select_datapoints(replace(config, taskonomy_clients_to_include=2), progress=False)
    assert first_two.buildings == ["synth000", "synth001"] and first_two.missing_buildings == ["ghosttown (no rgb folder)"]
    out = tmp_path / "step1"
    step1.main(["--data_path", str(data_copy), "--client_file_name", "official.csv", "--tasks", "depth_euclidean",
                "--out", str(out), "--no-progress"])
    warnings = [line for line in (out / "run.log").read_text().splitlines() if "WARNING" in line]
    assert len(warnings) == 1
    for name in ("ghosttown", "nowhere", "synth003", "official.csv"):
        assert name in warnings[0]


def test_no_building_of_split_csv_on_disk_is_an_error(data_copy):
    write_cr_split_csv(data_copy / "official.csv", ["ghosttown", "nowhere"])
    with pytest.raises(TaskHetError, match="no building of split CSV .*official.csv is on disk .*ghosttown .*nowhere"):
        select_datapoints(config_for(data_copy, client_file_name="official.csv"), progress=False)


def test_corrupt_class_scene_file_is_named(data_copy):
    path = domain_dir(data_copy, "class_scene", "synth003") / "point_0_view_1_domain_class_places.npy"
    path.write_bytes(b"not numpy")
    with pytest.raises(TaskHetError, match=str(path)):
        select_datapoints(config_for(data_copy), progress=False)


def test_bad_arguments_are_refused(tiny_data_root):
    for changes, message in (
        ({"top_k_classes": 0}, "--top_k_classes must be >= 1, got 0"),
        ({"val_fraction": 0.8}, "--val_fraction must be in \\[0, 1\\) and leave training rows"),
        ({"test_fraction": 1.0}, "--test_fraction must be in"),
        ({"split_by": "room"}, "--split_by must be one of"),
        ({"domains": ("depth",)}, "unknown domain 'depth'"),
        ({"scene_class_file_name": "nope.txt"}, "scene class file .*nope.txt does not exist"),
        ({"client_file_name": "nope.csv"}, "split CSV .*nope.csv does not exist"),
    ):
        with pytest.raises(TaskHetError, match=message):
            select_datapoints(config_for(tiny_data_root, **changes), progress=False)


def test_empty_selection_is_an_error(tmp_path):
    root = render_tiny_dataset(tmp_path / "data", n_buildings=2, n_views=2)
    for path in domain_dir(root, "normal", "synth000").iterdir():
        path.unlink()
    with pytest.raises(TaskHetError, match="empty selection"):
        select_datapoints(config_for(root, domains=("normal",), taskonomy_clients_to_include=("synth000",)), progress=False)


def test_a_building_split_that_leaves_a_split_empty_is_refused_naming_the_split_and_the_counts(tiny_data_root):
    with pytest.raises(TaskHetError, match=r"split 'train' would hold 0 of the 1 buildings with kept samples \(train 0, "
                                           r"test 1\)"):
        select_datapoints(config_for(tiny_data_root, split_by="building", top_k_classes=1), progress=False)
    # 4 buildings: one to test and one to validation (at least one each), two to train; 3 parts need 3 buildings
    with pytest.raises(TaskHetError, match=r"split 'train' would hold 0 of the 2 buildings .*\(train 0, test 1, val 1\)"):
        select_datapoints(config_for(tiny_data_root, split_by="building", top_k_classes=2, val_fraction=0.1),
                          progress=False)


def test_a_three_way_building_split_keeps_buildings_whole_and_spreads_over_scene_classes(tmp_path):
    root = render_tiny_dataset(tmp_path / "data", n_buildings=12, n_views=3, image_size=16)
    manifest = select_datapoints(config_for(root, split_by="building", top_k_classes=12, test_fraction=0.25,
                                            val_fraction=0.25), progress=False).manifest
    part = manifest["split"].where(manifest["val"] == 0, "val")
    per_building = manifest.assign(part=part).groupby("building")["part"].unique()
    assert all(len(parts) == 1 for parts in per_building)  # no building on two sides
    counts = per_building.str[0].value_counts()
    assert (counts["test"], counts["val"], counts["train"]) == (3, 3, 6)  # round(0.25 × 12) each, the rest trains
    assert set(manifest.loc[manifest["val"] == 1, "split"]) == {"train"}  # validation rows are training rows set aside
    # every building has its own scene class here: a stratified draw gives the 3 test buildings 3 different classes
    assert manifest.loc[part == "test", "scene_class"].nunique() == 3


def test_the_split_csv_split_follows_the_csv_columns(tmp_path):
    root = render_tiny_dataset(tmp_path / "data", n_buildings=8, n_views=3, image_size=16)
    table = pd.read_csv(root / SPLIT_FILE, dtype={"id": str})
    manifest = select_datapoints(config_for(root, split_by="csv", top_k_classes=8), progress=False).manifest
    expected = {row.id: "val" if row.val else "test" if row.test else "train" for row in table.itertuples()}
    found = manifest.assign(part=manifest["split"].where(manifest["val"] == 0, "val")).groupby("building")["part"].first()
    assert found.to_dict() == expected


def test_write_selection_outputs(tiny_data_root, tmp_path):
    selection = select_datapoints(config_for(tiny_data_root, top_k_classes=3), progress=False)
    paths = write_selection(selection, tmp_path / "out")
    assert read_manifest(paths["manifest"]).equals(selection.manifest)
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert pd.read_csv(paths["class_counts"])["num_samples"].sum() == len(selection.manifest) == 18
    line = summary_line(selection)
    assert "kept 18 of 24 complete samples" in line and "3 scene classes (top 3 of 4 found)" in line


def test_cli_end_to_end(tiny_data_root, tmp_path, capsys):
    out = tmp_path / "step1"
    argv = ["--data_path", str(tiny_data_root), "--out", str(out), "--tasks", "depth_euclidean,normal", "class_scene",
            "--top_k_classes", "4", "--split_by", "building", "--test_fraction", "0.25", "--no-progress"]
    manifest_path = step1.main(argv)
    assert manifest_path == out / "manifest.csv"
    manifest = read_manifest(manifest_path)
    assert len(manifest) == 24 and manifest.groupby("building")["split"].nunique().max() == 1
    for name in ("class_counts.csv", "class_distribution.png", "config.json", "run.log"):
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    assert config["args"]["top_k_classes"] == 4 and config["args"]["split_by"] == "building"
    assert "step 1: kept 24 of 24 complete samples" in capsys.readouterr().err + (out / "run.log").read_text()


def test_cli_rejects_top_k_zero_with_one_line(tiny_data_root, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_main(step1.main, ["--data_path", str(tiny_data_root), "--out", str(tmp_path), "--top_k_classes", "0"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().startswith("error: argument --top_k_classes: must be an integer in [1, 365], got '0'")
    assert not (tmp_path / "manifest.csv").exists()


def test_tasks_require_only_the_domains_they_need(data_copy, tmp_path):
    assert step1.build_parser().parse_args([]).tasks == []
    assert step1.required_domains(["class_scene", "normal", "segment_semantic"]) == ("normal", "segment_semantic")
    with pytest.raises(TaskHetError, match="'depth' is neither a Taskonomy task nor a domain"):
        step1.required_domains(["depth"])
    for domain in set(DOMAINS) - {"rgb", "class_scene", "normal"}:  # a download of only what the tasks need
        shutil.rmtree(data_copy / domain)
    manifest = read_manifest(step1.main(["--data_path", str(data_copy), "--out", str(tmp_path / "a"), "--no-progress"]))
    assert len(manifest) == 24
    manifest = read_manifest(step1.main(["--data_path", str(data_copy), "--tasks", "class_scene,normal", "--out",
                                         str(tmp_path / "b"), "--no-progress"]))
    assert len(manifest) == 24
    with pytest.raises(TaskHetError, match="domain folder .*depth_zbuffer/taskonomy is missing"):
        step1.main(["--data_path", str(data_copy), "--tasks", "depth_zbuffer", "--out", str(tmp_path / "c"), "--no-progress"])


def test_the_official_tiny_split_csv_is_read():
    from omnidata_tools.dataset.starter_dataset.component_datasets import taskonomy as omnidata_taskonomy

    path = Path(omnidata_taskonomy.taskonomy_split_files["tiny"])
    assert b"\r" in path.read_bytes() and b"\n" not in path.read_bytes()  # CR-only, as shipped
    assert len(read_split_csv(path)) == 35


def building_samples(classes: dict[str, int], views: int = 2) -> pd.DataFrame:
    """Samples (columns building, scene_class): ``views`` views of each building, all of its scene class."""
    return pd.DataFrame([(building, label) for building, label in classes.items() for _ in range(views)],
                        columns=["building", "scene_class"])


@pytest.mark.parametrize("seed", range(5))
def test_a_building_split_is_stratified_by_each_buildings_majority_scene_class(tmp_path, seed):
    # 12 buildings of unequal classes: 6 of class 0, 3 of class 1, 3 of class 2; a0 has a third view of class 2, but
    # two of class 0 make its majority
    classes = {**{f"a{i}": 0 for i in range(6)}, **{f"b{i}": 1 for i in range(3)}, **{f"c{i}": 2 for i in range(3)}}
    samples = pd.concat([building_samples(classes), pd.DataFrame({"building": ["a0"], "scene_class": [2]})],
                        ignore_index=True)
    config = SelectionConfig(data_path=tmp_path, split_by="building", test_fraction=1 / 3, val_fraction=1 / 3, seed=seed)
    split = split_samples(samples, config)
    parts = split.groupby(samples["building"]).unique()
    assert all(len(part) == 1 for part in parts)  # every building whole
    counts = pd.crosstab(parts.str[0], parts.index.map(classes)).reindex(["train", "val", "test"])
    # test: round(12 / 3) = 4 buildings, one from each quarter of the class-sorted order (0 0 0 | 0 0 0 | 1 1 1 | 2 2 2):
    # 2, 1, 1. val: round(12 / 3) = 4 of the 8 left (0 0 | 0 0 | 1 1 | 2 2): 2, 1, 1 again; train keeps the rest.
    # The same draw over an order blind to the classes gives these counts for 12 of the seeds 0..199 (none of 0..4).
    assert counts.values.tolist() == [[2, 1, 1], [2, 1, 1], [2, 1, 1]]


def write_split_flags(path: Path, flags: dict[str, str]) -> Path:
    """A split CSV (id,train,val,test) from building -> "train" | "val" | "test"."""
    rows = [f"{building},{int(part == 'train')},{int(part == 'val')},{int(part == 'test')}" for building, part in flags.items()]
    path.write_text("id,train,val,test\n" + "\n".join(rows) + "\n")
    return path


@pytest.mark.parametrize("parts, empty, shown", [
    (("train", "train", "train", "test"), "val", "train 3, test 1, val 0"),
    (("val", "val", "test", "val"), "train", "train 0, test 1, val 3"),
    (("train", "val", "train", "train"), "test", "train 3, test 0, val 1"),
])
def test_a_split_csv_that_leaves_a_part_empty_is_one_error_line(tiny_data_root, tmp_path, capsys, parts, empty, shown):
    csv = write_split_flags(tmp_path / "split.csv", {f"synth00{index}": part for index, part in enumerate(parts)})
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        run_main(step1.main, ["--data_path", str(tiny_data_root), "--client_file_name", str(csv), "--split_by", "csv",
                              "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and err == [
        f"error: split CSV {csv}: split {empty!r} would hold 0 of the 4 buildings with kept samples ({shown}); mark one of "
        f"them {empty} in the split CSV (split by csv)"]
    assert not (tmp_path / "out" / "manifest.csv").exists()


def test_a_split_csv_part_counts_only_buildings_with_kept_samples(tmp_path):
    csv = write_split_flags(tmp_path / "split.csv", {"s0": "train", "s1": "val", "s2": "test"})
    samples = building_samples({"s1": 0, "s2": 1})  # s0's views were all left out (a scene class not in the top K)
    with pytest.raises(TaskHetError) as refused:
        split_samples(samples, SelectionConfig(data_path=tmp_path, split_by="csv"), csv)
    assert str(refused.value) == (f"split CSV {csv}: split 'train' would hold 0 of the 2 buildings with kept samples "
                                  "(train 0, test 1, val 1); mark one of them train in the split CSV (split by csv)")


def test_a_building_split_without_val_fraction_has_no_validation_part_and_is_not_refused(tmp_path):
    samples = building_samples({"s0": 0, "s1": 0})
    split = split_samples(samples, SelectionConfig(data_path=tmp_path, split_by="building", test_fraction=0.5))
    assert sorted(split.groupby(samples["building"]).first()) == ["test", "train"]  # two buildings: one each


def test_a_building_split_of_two_buildings_with_validation_leaves_train_empty(tmp_path):
    samples = building_samples({"s0": 0, "s1": 1})
    config = SelectionConfig(data_path=tmp_path, split_by="building", test_fraction=0.1, val_fraction=0.1)
    with pytest.raises(TaskHetError) as refused:  # at least one building to test and one to val: none left to train
        split_samples(samples, config)
    assert str(refused.value) == ("--split_by: split 'train' would hold 0 of the 2 buildings with kept samples (train 0, "
                                  "test 1, val 1); use more buildings or other --test_fraction/--val_fraction (split by "
                                  "building)")
