"""Every reader of a .npy file checks its header before numpy reads it (utils/loaders.py ``load_npy``): a header
claiming a huge shape over a few bytes of data is one error line naming the file, whether the file is a class_scene
score file (step 1), step 3's reused embeddings or a map of the decoded-sample cache (step 2's --cache_dir), and the
step writes nothing it would not write for any other bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from datasets.family import load_manifest
from datasets.taskonomy import domain_dir
from models import build_task_model, get_task
from steps import embed, select_scenes, train_centralized
from tests.fixtures import tiny_data_root, tiny_manifest  # noqa: F401
from training.selection import centralized_splits
from utils.cli import run_main
from utils.errors import TaskHetError
from utils.loaders import load_npy
from utils.run_dir import write_config
from utils.stages import stage_key

# 100000 x 100000 float64 = 80000000000 bytes (74.5 GiB) claimed over 16 bytes of data
HUGE = "its header claims shape (100000, 100000) of float64 (80000000000 bytes of data) but the file holds 16 bytes " \
       "after its header; the file is damaged or not what it says"


def hand_made_npy(path: Path, shape: tuple[int, ...], descr: str, data: bytes) -> Path:
    """A format-1.0 .npy file of a header claiming ``shape`` of ``descr``, then exactly ``data``."""
    with open(path, "wb") as file:
        np.lib.format.write_array_header_1_0(file, {"descr": descr, "fortran_order": False, "shape": shape})
        file.write(data)
    return path


def huge_npy(path: Path) -> Path:
    return hand_made_npy(path, (100000, 100000), "<f8", bytes(16))


def one_error_line(capsys, main, argv: list[str]) -> str:
    """``main`` run as its script runs: exit code 2 and exactly one ``error:`` line, returned."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        run_main(main, argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(err) == 1, err
    return err[0]


# ----- the loader itself -----
def test_a_memory_mapped_read_of_a_short_file_is_refused_and_the_file_is_not_grown(tmp_path):
    path = hand_made_npy(tmp_path / "map.npy", (4, 3), "<f4", bytes(8))  # 4 x 3 x 4 = 48 bytes claimed, 8 held
    size = path.stat().st_size
    with pytest.raises(TaskHetError) as refused:
        load_npy(path, "cache map", finite=False, mmap_mode="r+")  # numpy's r+ map would grow the file to 48 bytes
    assert str(refused.value) == (f"cache map {path}: its header claims shape (4, 3) of float32 (48 bytes of data) but "
                                  "the file holds 8 bytes after its header; the file is damaged or not what it says")
    assert path.stat().st_size == size


def test_a_memory_mapped_read_of_a_whole_file_is_a_map_that_writes_through(tmp_path):
    path = tmp_path / "map.npy"
    np.save(path, np.zeros((2, 3), np.float32))
    array = load_npy(path, "cache map", shape=(2, 3), finite=False, mmap_mode="r+")
    assert isinstance(array, np.memmap)
    array[1, 2] = 7.0
    array.flush()
    del array
    assert np.load(path).tolist() == [[0.0, 0.0, 0.0], [0.0, 0.0, 7.0]]


def test_a_negative_size_in_a_header_is_named(tmp_path):
    path = hand_made_npy(tmp_path / "t.npy", (-2, -3), "<u1", bytes(6))  # (-2) x (-3) x 1 = 6: the byte count agrees
    with pytest.raises(TaskHetError) as refused:
        load_npy(path, "class_scene scores")
    assert str(refused.value) == (f"class_scene scores {path}: its header claims shape (-2, -3), with a negative size; "
                                  "the file is damaged or not what it says")


def test_an_npz_archive_is_refused_unopened(tmp_path):
    path = tmp_path / "scores.npz"
    np.savez(path, scores=np.zeros(3))
    with pytest.raises(TaskHetError) as refused:
        load_npy(path, "class_scene scores")
    assert str(refused.value) == f"class_scene scores {path} is an .npz archive, expected one .npy array"


def test_the_expected_shape_is_checked_from_the_header(tmp_path):
    path = hand_made_npy(tmp_path / "t.npy", (2, 5), "<f4", bytes(40))
    with pytest.raises(TaskHetError) as refused:
        load_npy(path, "reused embeddings", shape=(3, -1))
    assert str(refused.value) == f"reused embeddings {path} has shape (2, 5), expected 3xN"


# ----- each reader, through its step -----
def test_step1_refuses_a_class_scene_file_whose_header_claims_a_huge_shape(tiny_data_root, tmp_path, capsys):
    root = Path(shutil.copytree(tiny_data_root, tmp_path / "data"))
    scores = huge_npy(domain_dir(root, "class_scene", "synth002") / "point_0_view_1_domain_class_places.npy")
    out = tmp_path / "step1"
    line = one_error_line(capsys, select_scenes.main, ["--data_path", str(root), "--out", str(out), "--no-progress"])
    assert line == f"error: class_scene scores {scores}: {HUGE}"
    assert not out.exists()


def test_step3_refuses_reused_embeddings_whose_header_claims_a_huge_shape(tiny_data_root, tiny_manifest, tmp_path,
                                                                          capsys):
    checkpoint = tmp_path / "step2" / "best.pt"
    checkpoint.parent.mkdir()
    model = build_task_model("depth_euclidean", encoder="small_cnn", seed=0)
    torch.save({"model": model.state_dict(), "model_config": model.config}, checkpoint)
    (checkpoint.parent / "config.json").write_text(json.dumps({"args": {"image_size": 16}}))
    out = tmp_path / "step3"  # an earlier step-3 run's folder whose embeddings.npy was damaged since
    out.mkdir()
    write_config(out, {}, step=embed.STEP)
    key = stage_key({"data_path": str(tiny_data_root), "image_size": 16}, [checkpoint, tiny_manifest])
    (out / "embeddings_key.txt").write_text(key)
    embeddings = huge_npy(out / "embeddings.npy")
    line = one_error_line(capsys, embed.main, ["--checkpoint", str(checkpoint), "--manifest", str(tiny_manifest),
                                               "--data_path", str(tiny_data_root), "--out", str(out), "--n_clusters", "2",
                                               "--no-use_accelerator"])
    assert line == f"error: reused embeddings {embeddings}: {HUGE}"
    # no clusters, centers or diagnostics; the folder stays marked unfinished and the damaged file is left as it was
    assert not {"clusters.csv", "centers.npy", "agreement.json", "metrics.csv"} & {path.name for path in out.iterdir()}
    assert (out / "INCOMPLETE").is_file()
    assert embeddings.stat().st_size == 128 + 16


def test_step2_refuses_a_cache_map_whose_header_claims_a_huge_shape(tiny_data_root, tiny_manifest, tmp_path, capsys):
    cache = tmp_path / "cache"
    family, manifest = load_manifest(tiny_manifest)
    train_rows = centralized_splits(manifest)["train"]  # the cache step 2 opens first, made as step 2 makes it
    folder = family.dataset(tiny_data_root, train_rows, get_task("depth_euclidean"), 16, cache).cache.directory
    rgb_map = huge_npy(folder / "rgb.npy")
    out = tmp_path / "step2"
    line = one_error_line(capsys, train_centralized.main,
                          ["--task", "depth_euclidean", "--encoder", "small_cnn", "--weights", "none", "--image_size",
                           "16", "--batch_size", "4", "--n_epochs", "1", "--cache_dir", str(cache), "--data_path",
                           str(tiny_data_root), "--manifest", str(tiny_manifest), "--no-use_accelerator", "--no-progress",
                           "--no-plots", "--out", str(out)])
    assert line == f"error: cache map {rgb_map}: {HUGE}; delete the cache folder {folder} to rebuild it"
    assert not out.exists()  # refused before step 2 writes its folder
    assert rgb_map.stat().st_size == 128 + 16  # not grown to the claimed shape
