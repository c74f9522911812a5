"""The folder families' boundaries, each against a hand-computed value: names that are not UTF-8, .npy headers that
claim more than their file holds, how classes and labels are numbered when a split CSV picks the images, what the
ignore value of a target with several channels masks, and every empty part a split can leave."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from datasets.family import load_manifest
from datasets.paired_targets import TargetSpec, decode_target, read_target
from steps import select
from tests.folder_fixtures import write_imagefolder, write_paired_folders
from utils.cli import run_main
from utils.errors import TaskHetError

NOT_UTF8 = "its name is not UTF-8 text (the bytes shown as \\xNN); the manifest names every file in UTF-8, so rename it " \
           "(e.g. with convmv)"


def step1_error(capsys, family: str, root: Path, out: Path, *extra: str) -> str:
    """Step 1 run as the script runs: it must exit with code 2, print exactly one ``error:`` line and leave no ``out``."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        run_main(select.main, ["--family", family, "--data_path", str(root), "--out", str(out), "--no-progress", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(err) == 1, err
    assert not out.exists()  # no manifest, nothing that could look like a finished step 1
    return err[0]


def step1(family: str, root: Path, out: Path, *extra: str) -> pd.DataFrame:
    return load_manifest(select.main(["--family", family, "--data_path", str(root), "--out", str(out), "--no-progress",
                                      *extra]))[1]


def rename_bytes(path: Path, new_name: bytes) -> None:
    """Rename ``path`` to a name given as raw bytes (a file written on a Latin-1 system); skip where the file system
    refuses such names (macOS, some network shares)."""
    try:
        os.rename(os.fsencode(path), os.path.join(os.fsencode(path.parent), new_name))
    except OSError as error:
        pytest.skip(f"this file system refuses a name that is not UTF-8 ({error})")


# ----- names that are not UTF-8 -----
def test_a_non_utf8_image_name_is_one_error_line_naming_it(tmp_path, capsys):
    root = write_imagefolder(tmp_path / "photos", per_class=3)
    rename_bytes(root / "cat" / "cat_0.png", b"caf\xe9.png")
    line = step1_error(capsys, "imagefolder", root, tmp_path / "out")
    assert line == f"error: file {root}/cat/caf\\xe9.png: {NOT_UTF8}"


def test_a_non_utf8_class_folder_is_one_error_line_naming_it(tmp_path, capsys):
    root = write_imagefolder(tmp_path / "photos", per_class=3)
    rename_bytes(root / "dog", b"d\xf6g")
    line = step1_error(capsys, "imagefolder", root, tmp_path / "out")
    assert line == f"error: folder {root}/d\\xf6g: {NOT_UTF8}"


def test_a_non_utf8_folder_deeper_in_a_class_folder_is_named(tmp_path, capsys):
    root = write_imagefolder(tmp_path / "photos", per_class=3)
    (root / "owl" / "night").mkdir()
    os.replace(root / "owl" / "owl_0.png", root / "owl" / "night" / "owl_0.png")
    rename_bytes(root / "owl" / "night", b"n\xe4cht")
    line = step1_error(capsys, "imagefolder", root, tmp_path / "out")
    assert line == f"error: folder {root}/owl/n\\xe4cht: {NOT_UTF8}"


def test_a_non_utf8_stem_is_one_error_line_naming_the_image(tmp_path, capsys):
    root = write_paired_folders(tmp_path / "data", n_images=6)
    for file in ("images/img_00.png", "depth/img_00.png", "semantic/img_00.npy", "boundaries/img_00.png"):
        rename_bytes(root / file, b"caf\xe9" + os.fsencode(Path(file).suffix))
    line = step1_error(capsys, "paired_folders", root, tmp_path / "out")
    assert line == f"error: file {root}/images/caf\\xe9.png: {NOT_UTF8}"


def test_a_non_utf8_target_file_is_named_before_its_missing_image(tmp_path, capsys):
    root = write_paired_folders(tmp_path / "data", n_images=6)
    rename_bytes(root / "semantic" / "img_02.npy", b"img_\xb2.npy")  # Latin-1 superscript two
    line = step1_error(capsys, "paired_folders", root, tmp_path / "out")
    assert line == f"error: file {root}/semantic/img_\\xb2.npy: {NOT_UTF8}"


def test_a_skipped_non_utf8_file_is_named_escaped_in_the_warning(tmp_path):
    root = write_imagefolder(tmp_path / "photos", per_class=3)
    (root / "cat" / "notes.txt").write_text("not an image")
    rename_bytes(root / "cat" / "notes.txt", b"not\xe9s.txt")
    manifest = step1("imagefolder", root, tmp_path / "out")
    assert len(manifest) == 9  # a file step 1 skips never reaches the manifest: its name may be anything
    warnings = [line for line in (tmp_path / "out" / "run.log").read_text().splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and warnings[0].endswith(
        f"WARNING skipped 1 entry under {root} that are not images inside a class folder: cat/not\\xe9s.txt")


# ----- .npy headers -----
SEGMENTATION = TargetSpec("semantic", "segmentation", 3, 1.0, 255)


def hand_made_npy(path: Path, shape: tuple[int, ...], descr: str, data: bytes, version: tuple[int, int] = (1, 0)) -> Path:
    """A .npy file of a header claiming ``shape`` of ``descr``, then exactly ``data``."""
    with open(path, "wb") as file:
        header = {"descr": descr, "fortran_order": False, "shape": shape}
        if version == (1, 0):
            np.lib.format.write_array_header_1_0(file, header)
        else:
            np.lib.format.write_array_header_2_0(file, header)
        file.write(data)
    return path


def test_a_npy_header_claiming_a_huge_shape_is_refused_before_numpy_allocates_it(tmp_path, capsys):
    root = write_paired_folders(tmp_path / "data", n_images=6)
    target = hand_made_npy(root / "semantic" / "img_04.npy", (100000, 100000), "<f8", bytes(16))
    line = step1_error(capsys, "paired_folders", root, tmp_path / "out")
    # 100000 x 100000 x 8 bytes = 80000000000 (74.5 GiB) claimed; 16 bytes held
    assert line == (f"error: semantic target {target}: its header claims shape (100000, 100000) of float64 (80000000000 "
                    "bytes of data) but the file holds 16 bytes after its header; the file is damaged or not what it says")


@pytest.mark.parametrize("version", [(1, 0), (2, 0)])
@pytest.mark.parametrize("data, read", [(bytes(12), True), (bytes(11), False), (bytes(13), False)])
def test_a_npy_target_must_hold_exactly_shape_times_item_size_bytes(tmp_path, version, data, read):
    path = hand_made_npy(tmp_path / "t.npy", (2, 3), "<u2", data, version)  # 2 x 3 x 2 bytes = 12
    if read:
        assert read_target(path, SEGMENTATION).tolist() == [[[0, 0, 0], [0, 0, 0]]]
        return
    with pytest.raises(TaskHetError) as refused:
        read_target(path, SEGMENTATION)
    assert str(refused.value) == (f"semantic target {path}: its header claims shape (2, 3) of uint16 (12 bytes of data) "
                                  f"but the file holds {len(data)} bytes after its header; the file is damaged or not what "
                                  "it says")


def test_an_empty_npy_array_with_no_data_bytes_is_not_refused_by_the_size_check(tmp_path):
    path = hand_made_npy(tmp_path / "t.npy", (0, 3), "<u1", b"")  # 0 x 3 x 1 = 0 bytes: the size is right
    assert read_target(path, SEGMENTATION).shape == (1, 0, 3)


def test_a_pickled_npy_target_is_refused_without_unpickling_it(tmp_path):
    path = tmp_path / "t.npy"
    np.save(path, np.array([[1, None]], dtype=object), allow_pickle=True)
    with pytest.raises(TaskHetError) as refused:
        read_target(path, SEGMENTATION)
    assert str(refused.value) == (f"semantic target {path} holds Python objects (dtype object), which are never unpickled; "
                                  "save an array of numbers")


def test_a_npy_file_of_another_format_version_is_named(tmp_path):
    path = tmp_path / "t.npy"
    path.write_bytes(b"\x93NUMPY\x03\x00" + bytes(8))
    with pytest.raises(TaskHetError) as refused:
        read_target(path, SEGMENTATION)
    assert str(refused.value) == (f"semantic target {path} is not a readable .npy array (format version 3.0, expected "
                                  "1.0 or 2.0 (numpy.save of numbers))")


# ----- class and label numbers when a split CSV picks the images -----
def test_imagefolder_classes_are_the_listed_folders_in_code_point_order_not_the_split_csv_order(tmp_path):
    root = write_imagefolder(tmp_path / "photos", per_class=2, classes=("moth", "Zebra", "ant", "bee"))
    (root / "split.csv").write_text("path,split\nmoth/moth_0.png,train\nZebra/Zebra_0.png,train\nant/ant_0.png,train\n"
                                    "moth/moth_1.JPG,test\nZebra/Zebra_1.JPG,test\nant/ant_1.JPG,val\n")
    manifest = step1("imagefolder", root, tmp_path / "out", "--split_csv", "split.csv")
    # sorted(["moth", "Zebra", "ant"]) is Zebra, ant, moth ("Z" is 90, "a" 97); bee holds no listed image: no class.
    # The split CSV's order would give moth 0, a case-blind sort ant 0, all folders bee a number: none of them.
    assert dict(zip(manifest["class_name"], manifest["label"])) == {"Zebra": 0, "ant": 1, "moth": 2}
    counts = pd.read_csv(tmp_path / "out" / "class_counts.csv")
    assert counts.to_dict("list") == {"label": [0, 1, 2], "num_train": [1, 1, 1], "num_val": [0, 1, 0],
                                      "num_test": [1, 0, 1]}


def test_imagefolder_with_the_seeded_split_numbers_every_folder(tmp_path):
    root = write_imagefolder(tmp_path / "photos", per_class=2, classes=("moth", "Zebra", "ant", "bee"))
    manifest = step1("imagefolder", root, tmp_path / "out", "--test_fraction", "0.5")
    assert dict(zip(manifest["class_name"], manifest["label"])) == {"Zebra": 0, "ant": 1, "bee": 2, "moth": 3}


def test_paired_labels_are_numbered_numerically_over_the_images_the_split_csv_keeps(tmp_path):
    root = write_paired_folders(tmp_path / "data", n_images=8)
    names = ["9", "10", "100", "2", "9", "10", "100", "2"]  # img_00 .. img_07
    (root / "groups.csv").write_text("stem,label\n" + "".join(f"img_{i:02d},{name}\n" for i, name in enumerate(names)))
    # listed first: 100, then 9, then 10; label 2 (img_03, img_07) is left out
    (root / "split.csv").write_text("stem,split\nimg_06,train\nimg_00,train\nimg_05,train\nimg_02,test\nimg_04,val\n"
                                    "img_01,test\n")
    manifest = step1("paired_folders", root, tmp_path / "out", "--split_csv", "split.csv")
    # numerically over the kept labels 9, 10, 100: 9 -> 0, 10 -> 1, 100 -> 2. As text ("10" < "100" < "9"), in the
    # split CSV's order (100 first) or over every label (2 -> 0) each number would differ.
    assert manifest[["sample_id", "label_name", "label"]].values.tolist() == [
        ["img_00.png", "9", 0], ["img_01.png", "10", 1], ["img_02.png", "100", 2], ["img_04.png", "9", 0],
        ["img_05.png", "10", 1], ["img_06.png", "100", 2]]


# ----- the ignore value of a target -----
def test_a_regression_pixel_is_ignored_only_where_every_channel_holds_the_ignore_value():
    spec = TargetSpec("normals", "regression", 3, 2.0, 0.0)
    # pixels: every channel 0 | channel 0 only | channel 1 only | two channels | none
    raw = np.array([[[0, 0, 5, 0, 7]], [[0, 4, 0, 0, 8]], [[0, 4, 5, 6, 9]]], dtype=np.uint16)
    target, valid = decode_target(raw, spec, Path("normals/x.npy"))
    assert valid.tolist() == [[False, True, True, True, True]]
    assert target.dtype == np.float32 and target[:, 0, 1].tolist() == [0.0, 2.0, 2.0]  # stored / scale 2, kept as is


def test_a_regression_target_without_an_ignore_value_masks_nothing():
    target, valid = decode_target(np.zeros((2, 1, 2), np.uint8), TargetSpec("flow", "regression", 2), Path("f.npy"))
    assert valid.tolist() == [[True, True]] and target.tolist() == [[[0.0, 0.0]], [[0.0, 0.0]]]


def test_segmentation_and_edges_ignore_their_one_channel():
    labels, valid = decode_target(np.array([[[0, 2, 255, 1]]]), SEGMENTATION, Path("s.npy"))
    assert labels.tolist() == [[0, 2, 255, 1]] and valid.tolist() == [[True, True, False, True]]
    edges, valid = decode_target(np.array([[[0, 128, 255, 1]]]), TargetSpec("b", "edges", 1, 1.0, 128.0), Path("b.png"))
    assert edges.tolist() == [[[0.0, 0.0, 1.0, 1.0]]] and valid.tolist() == [[True, False, True, True]]


# ----- empty parts of a split -----
def test_a_split_csv_without_validation_rows_gives_no_validation_part(tmp_path):
    root = write_imagefolder(tmp_path / "photos", per_class=2, classes=("a", "b"))
    (root / "split.csv").write_text("path,split\na/a_0.png,train\nb/b_0.png,train\na/a_1.JPG,test\n")
    manifest = step1("imagefolder", root, tmp_path / "out", "--split_csv", "split.csv")
    assert manifest[["image_path", "split", "val"]].values.tolist() == [
        ["a/a_0.png", "train", 0], ["a/a_1.JPG", "test", 0], ["b/b_0.png", "train", 0]]  # step 2 asks for --last_epoch


@pytest.mark.parametrize("family, rows, empty, count", [
    ("imagefolder", "path,split\na/a_0.png,val\nb/b_0.png,val\na/a_1.JPG,test\n", "train", 3),  # val rows are not train
    ("imagefolder", "path,split\na/a_0.png,train\nb/b_0.png,val\n", "test", 2),
    ("paired_folders", "stem,split\nimg_00,test\nimg_01,val\n", "train", 2),
    ("paired_folders", "stem,split\nimg_00,train\nimg_01,train\nimg_02,val\n", "test", 3),
])
def test_a_split_csv_leaving_train_or_test_empty_is_one_error_line(tmp_path, capsys, family, rows, empty, count):
    root = (write_imagefolder(tmp_path / "data", per_class=2, classes=("a", "b")) if family == "imagefolder"
            else write_paired_folders(tmp_path / "data", n_images=4))
    (root / "split.csv").write_text(rows)
    line = step1_error(capsys, family, root, tmp_path / "out", "--split_csv", "split.csv")
    assert line == f"error: {root}: the split gives no {empty} image ({count} images; split CSV {root}/split.csv)"


def test_a_seeded_split_of_one_image_per_class_has_no_test_part(tmp_path, capsys):
    root = write_imagefolder(tmp_path / "photos", per_class=1, classes=("a", "b"))
    # each class keeps a training image: min(round(0.5 x 1), 1 - 1) = 0 test images per class
    line = step1_error(capsys, "imagefolder", root, tmp_path / "out", "--test_fraction", "0.5")
    assert line == (f"error: {root}: the split gives no test image (2 images; raise --test_fraction or add images: "
                    "each class keeps one training image)")


def test_a_seeded_split_of_two_images_per_class_has_every_part(tmp_path):
    root = write_imagefolder(tmp_path / "photos", per_class=2, classes=("a", "b"))
    manifest = step1("imagefolder", root, tmp_path / "out", "--test_fraction", "0.5", "--val_fraction", "0.5")
    # per class: round(0.5 x 2) = 1 test; of the 1 training image, min(round(0.5), 0) = 0 validation
    assert manifest.groupby("label")["split"].apply(lambda split: (split == "test").sum()).tolist() == [1, 1]
    assert manifest["val"].sum() == 0
