"""CIFAR files from a download are untrusted (issue 19, items 1 and 2): a pickle payload never runs, and a
batch whose content is wrong is one ``error:`` line naming the file, at the step that reads it.

Each crafted file is written as the official files are (``tests.fixtures.dump_py2_pickle``: Python 2's
protocol 2) into otherwise valid tiny CIFAR folders. Step 1 runs with ``--no-verify_checksums`` (the md5s
of hand-made files cannot match) and with its default md5 check; step 2 never re-checks the md5s, so the
file is swapped in after step 1 wrote the manifest; steps 3, 4 and the studies read the files through the
family's dataset, which is tested directly.
"""

from __future__ import annotations

import os
import re
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from datasets.cifar_files import load_split
from datasets.family import get_family, load_manifest
from models import get_task
from steps import select, train_centralized
from tests.fixtures import dump_py2_pickle, write_tiny_cifar
from utils.cli import run_main
from utils.errors import TaskHetError
from utils.loaders import INCOMPLETE, load_data_pickle

FOLDERS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}


class MarkerByExec:
    """Unpickles as ``exec("open(marker, 'w').close()")``: harmless, but proof that the file's code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


class MarkerBySystem(MarkerByExec):
    """Unpickles as ``os.system("touch marker")``."""

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> tuple[Path, Path]:
    """Valid tiny CIFAR-10 files (4 train and 1 test image a class) and the manifest step 1 writes for them."""
    root = write_tiny_cifar(tmp_path_factory.mktemp("cifar"), "cifar10", [4] * 10, test_per_class=1)
    out = tmp_path_factory.mktemp("step1") / "s1"
    manifest = select.main(step1(root, out))
    return root, manifest


def data_copy(clean, tmp_path: Path) -> Path:
    return Path(shutil.copytree(clean[0], tmp_path / "data"))


def read_raw(path: Path) -> dict:
    with open(path, "rb") as file:
        return pickle.load(file, encoding="bytes")  # the tests' own, trusted files


def step1(root: Path, out: Path, *extra: str) -> list[str]:
    # a validation image of each class (the default 10% of 4 rounds to none, and step 2 selects on validation)
    return ["--family", "cifar", "--data_path", str(root), "--no-verify_checksums", "--val_fraction", "0.25", "--out",
            str(out), *extra]


def step2(root: Path, manifest: Path, out: Path) -> list[str]:
    return ["--task", "cifar_class", "--encoder", "small_cnn", "--weights", "none", "--data_path", str(root),
            "--manifest", str(manifest), "--image_size", "32", "--batch_size", "8", "--n_epochs", "1",
            "--no-use_accelerator", "--out", str(out)]


def one_error_line(main, argv: list[str], capsys) -> str:
    """Run a step as its script does; it must stop with exit code 2 and exactly one ``error:`` line, no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        run_main(main, argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert exit_info.value.code == 2 and "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def nothing_looks_finished(out: Path) -> bool:
    return not (out / "best.pt").exists() or (out / INCOMPLETE).is_file()


# ----- item 1: a pickle payload never runs -----
def payload_files(folder: Path, name: str, marker: Path, kind: str) -> None:
    """Replace ``folder/name``: the whole file is the payload, or the payload hides inside a valid batch."""
    payload = (MarkerByExec if kind != "system" else MarkerBySystem)(marker)
    if kind == "nested":
        content = read_raw(folder / name)
        content[b"batch_label"] = payload
        dump_py2_pickle(folder / name, content)
    else:
        dump_py2_pickle(folder / name, {b"data": payload})


@pytest.mark.parametrize("kind", ["exec", "system", "nested"])
@pytest.mark.parametrize("name", ["data_batch_1", "batches.meta"])
@pytest.mark.parametrize("verify", [False, True])
def test_a_payload_never_runs_at_step1(clean, tmp_path, capsys, name, kind, verify):
    root, marker = data_copy(clean, tmp_path), tmp_path / "marker"
    payload_files(root / FOLDERS["cifar10"], name, marker, kind)
    argv = step1(root, tmp_path / "out")
    line = one_error_line(select.main, argv if not verify else [a for a in argv if a != "--no-verify_checksums"], capsys)
    assert not marker.exists()
    assert name in line
    if verify:  # the default: the md5 check refuses every hand-made file before any is read
        assert "fail torchvision's md5 check" in line
    else:
        expected = {"exec": "__builtin__.exec", "system": "posix.system", "nested": "__builtin__.exec"}[kind]
        assert f"asks for the Python object {expected} while loading" in line and "refused unread" in line
    assert not (tmp_path / "out" / "manifest.csv").exists()


@pytest.mark.parametrize("name", ["data_batch_1", "test_batch", "batches.meta"])
def test_a_payload_never_runs_at_step2(clean, tmp_path, capsys, name):
    root, marker = data_copy(clean, tmp_path), tmp_path / "marker"
    payload_files(root / FOLDERS["cifar10"], name, marker, "exec")
    line = one_error_line(train_centralized.main, step2(root, clean[1], tmp_path / "out"), capsys)
    assert not marker.exists()
    assert f"{name} asks for the Python object __builtin__.exec" in line
    assert nothing_looks_finished(tmp_path / "out")


def test_a_payload_never_runs_where_steps_3_and_4_read(clean, tmp_path):
    """Steps 3, 3c and 4 and the studies read CIFAR only through the family's dataset."""
    root, marker = data_copy(clean, tmp_path), tmp_path / "marker"
    payload_files(root / FOLDERS["cifar10"], "data_batch_3", marker, "system")
    family, manifest = load_manifest(clean[1])
    with pytest.raises(TaskHetError, match="data_batch_3 asks for the Python object posix.system"):
        family.dataset(root, manifest, get_task("cifar_class"), 32)
    assert not marker.exists()


def test_the_file_table_is_torchvisions():
    """datasets/cifar_files.py holds torchvision's file names, md5s and download itself (so that it never imports a
    reader that unpickles with plain pickle): they must stay the values torchvision's classes give."""
    import datasets.cifar
    import datasets.cifar_files as cifar
    from torchvision.datasets import CIFAR10, CIFAR100

    for module in (cifar, datasets.cifar):
        assert not hasattr(module, "CIFAR10") and not hasattr(module, "CIFAR100")
    for name, dataset_class in (("cifar10", CIFAR10), ("cifar100", CIFAR100)):
        files = cifar.DATASET_CLASSES[name]
        assert files.folder_name == dataset_class.base_folder
        assert files.split_files(True) == [tuple(entry) for entry in dataset_class.train_list]
        assert files.split_files(False) == [tuple(entry) for entry in dataset_class.test_list]
        meta = dataset_class.meta
        assert files.meta == (meta["filename"], meta["md5"], meta["key"])
        assert (files.url, files.archive, files.archive_md5) == (dataset_class.url, dataset_class.filename,
                                                                 dataset_class.tgz_md5)


def test_torchvisions_cifar_classes_are_never_built(clean, tmp_path, monkeypatch):
    """Building torchvision's CIFAR10/CIFAR100 would read the batches with plain pickle: steps 1 and 2 and the
    family's dataset never build one."""
    from torchvision.datasets import CIFAR10, CIFAR100

    def refuse(self, *args, **kwargs):
        raise AssertionError("a torchvision CIFAR dataset was built: it would unpickle the batches unrestricted")

    for dataset_class in (CIFAR10, CIFAR100):
        monkeypatch.setattr(dataset_class, "__init__", refuse)
    manifest = select.main(step1(clean[0], tmp_path / "s1"))
    family, table = load_manifest(manifest)
    assert len(family.dataset(clean[0], table, get_task("cifar_class"), 32)) == len(table)
    train_centralized.main(step2(clean[0], manifest, tmp_path / "s2"))
    assert (tmp_path / "s2" / "best.pt").is_file()


def test_cifar100_files_are_read_the_same_way(tmp_path):
    root = write_tiny_cifar(tmp_path / "data", "cifar100", [1] * 100, test_per_class=1)
    marker = tmp_path / "marker"
    payload_files(root / FOLDERS["cifar100"], "meta", marker, "exec")
    with pytest.raises(TaskHetError, match="cifar100 file .*meta asks for the Python object __builtin__.exec"):
        load_split(root, "cifar100", False, verify_checksums=False)
    assert not marker.exists()


def test_the_official_format_loads_and_names_only_numpy(tmp_path):
    """The fixtures write numpy arrays as Python 2's numpy did (numpy.core.multiarray._reconstruct), and
    numpy 2's own pickles (numpy._core.multiarray) load too; a Python 3 protocol-2 pickle needs
    _codecs.encode for its bytes, which no official file names, and is refused."""
    array = np.arange(12, dtype=np.uint8).reshape(2, 6)
    dump_py2_pickle(tmp_path / "py2", {b"data": array, b"labels": [0, 1]})
    assert b"cnumpy.core.multiarray\n_reconstruct\n" in (tmp_path / "py2").read_bytes()
    for protocol in (2, 4):
        (tmp_path / f"py3_{protocol}").write_bytes(pickle.dumps({"data": array}, protocol=protocol))
    loaded = load_data_pickle(tmp_path / "py2", "file")
    assert set(loaded) == {"data", "labels"} and loaded["labels"] == [0, 1]
    np.testing.assert_array_equal(loaded["data"], array)
    np.testing.assert_array_equal(load_data_pickle(tmp_path / "py3_4", "file")["data"], array)
    with pytest.raises(TaskHetError, match="asks for the Python object _codecs.encode"):
        load_data_pickle(tmp_path / "py3_2", "file")


# {"data": uint8 [[0, 1, 2], [253, 254, 255]], "labels": [6, 1]} as Python 2's cPickle wrote it at protocol 2,
# opcode by opcode (numpy 1.x's array reduction; raw bytes above 0x7f, which only latin1 keeps exact).
PYTHON2_BATCH = (b"\x80\x02}q\x01(U\x04dataq\x02cnumpy.core.multiarray\n_reconstruct\nq\x03cnumpy\nndarray\nq\x04K\x00"
                 b"\x85U\x01b\x87Rq\x05(K\x01K\x02K\x03\x86cnumpy\ndtype\nq\x06U\x02u1K\x00K\x01\x87Rq\x07(K\x03U\x01|NNN"
                 b"J\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb\x89U\x06\x00\x01\x02\xfd\xfe\xfftbU\x06labelsq\x08]q\t(K\x06K\x01eu.")


def test_a_python2_batch_written_opcode_by_opcode_loads(tmp_path):
    (tmp_path / "batch").write_bytes(PYTHON2_BATCH)
    loaded = load_data_pickle(tmp_path / "batch", "file")
    assert loaded["labels"] == [6, 1] and loaded["data"].dtype == np.uint8
    np.testing.assert_array_equal(loaded["data"], [[0, 1, 2], [253, 254, 255]])


# ----- item 2: content checked at the step that reads the file -----
def edit_batch(folder: Path, name: str, edit) -> None:
    content = read_raw(folder / name)
    edit(content)
    dump_py2_pickle(folder / name, content)


def one_more_label(batch: dict) -> None:
    batch[b"labels"] = batch[b"labels"] + [3]


def one_label_less(batch: dict) -> None:
    batch[b"labels"] = batch[b"labels"][:-1]


def label(value: int):
    def edit(batch: dict) -> None:
        batch[b"labels"] = [value] + batch[b"labels"][1:]
    return edit


def truncate(folder: Path, name: str) -> None:
    path = folder / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


BAD_CONTENT = {
    # name: (how the file is damaged, what the error line says after the file's name)
    "more labels than images": (lambda f: edit_batch(f, "data_batch_2", one_more_label),
                                "data_batch_2 has 9 labels for 8 images"),
    "fewer labels than images": (lambda f: edit_batch(f, "data_batch_2", one_label_less),
                                 "data_batch_2 has 7 labels for 8 images"),
    "label -1": (lambda f: edit_batch(f, "data_batch_2", label(-1)), "data_batch_2: label -1 of image 0 is outside 0..9"),
    "label 10 of cifar10": (lambda f: edit_batch(f, "test_batch", label(10)), "test_batch: label 10 of image 0 is outside 0..9"),
    "truncated batch": (lambda f: truncate(f, "data_batch_4"), "data_batch_4 is truncated or not a pickle of data"),
    "truncated meta": (lambda f: truncate(f, "batches.meta"), "batches.meta is truncated or not a pickle of data"),
    "zero-byte batch": (lambda f: (f / "test_batch").write_bytes(b""), "test_batch is empty (0 bytes)"),
    "data of the wrong shape": (lambda f: edit_batch(f, "data_batch_1", lambda b: b.update({b"data": b[b"data"][:, :100]})),
                                "data_batch_1: 'data' is uint8 [8, 100], expected a uint8 array [images, 3072]"),
    "labels that are not integers": (lambda f: edit_batch(f, "data_batch_1", lambda b: b.update({b"labels": [0.5] * 8})),
                                     "data_batch_1: 'labels' is not a list of integer labels"),
    "meta of another dataset": (lambda f: edit_batch(f, "batches.meta", lambda b: b.update({b"label_names": [b"x"] * 100})),
                                "batches.meta is not cifar10's meta file"),
}


@pytest.mark.parametrize("name", list(BAD_CONTENT))
def test_bad_content_is_one_error_line_at_step1(clean, tmp_path, capsys, name):
    root = data_copy(clean, tmp_path)
    damage, expected = BAD_CONTENT[name]
    damage(root / FOLDERS["cifar10"])
    line = one_error_line(select.main, step1(root, tmp_path / "out"), capsys)
    assert expected in line and str(root / FOLDERS["cifar10"]) in line
    assert not (tmp_path / "out" / "manifest.csv").exists()


@pytest.mark.parametrize("name", ["more labels than images", "label -1", "truncated batch", "truncated meta"])
def test_bad_content_is_one_error_line_at_step2(clean, tmp_path, capsys, name):
    root = data_copy(clean, tmp_path)
    damage, expected = BAD_CONTENT[name]
    damage(root / FOLDERS["cifar10"])
    line = one_error_line(train_centralized.main, step2(root, clean[1], tmp_path / "out"), capsys)
    assert expected in line
    assert nothing_looks_finished(tmp_path / "out")


@pytest.mark.parametrize("missing", [0, 9])
def test_a_class_without_images_refuses_a_long_tail(tmp_path, capsys, missing):
    """Class 0 empty used to be an error naming no file; class 9 empty made a 9-class profile silently."""
    counts = [6] * 10
    counts[missing] = 0
    root = write_tiny_cifar(tmp_path / "data", "cifar10", counts, test_per_class=1)
    line = one_error_line(select.main, step1(root, tmp_path / "out", "--imbalance_factor", "0.5"), capsys)
    assert (f"cifar10 training files data_batch_1, data_batch_2, data_batch_3, data_batch_4, data_batch_5 under "
            f"{root / FOLDERS['cifar10']}: class {missing} has no images, but a long-tailed profile (imbalance factor 0.5) "
            f"needs images of all 10 classes") in line
    # without a long tail the missing class is no error: the balanced set is kept as it is
    manifest = select.main(step1(root, tmp_path / "balanced"))
    _, rows = load_manifest(manifest)
    train = rows[rows["split"] == "train"]
    assert missing not in set(train["label"]) and len(train) == 54 and len(rows) == 54 + 10


def test_download_fetches_and_never_unpickles(tmp_path, monkeypatch):
    """--download used to build torchvision's CIFAR10, which unpickles the files it fetched; now it only fetches."""
    import datasets.cifar_files as cifar
    from torchvision.datasets import CIFAR10

    marker, calls = tmp_path / "marker", []

    def fetch(url: str, root: str, filename: str, md5: str) -> None:  # stands in for the network
        calls.append((url, filename, md5))
        write_tiny_cifar(Path(root), "cifar10", [1] * 10, test_per_class=1)
        payload_files(Path(root) / FOLDERS["cifar10"], "data_batch_1", marker, "exec")

    monkeypatch.setattr(cifar, "download_and_extract_archive", fetch)
    cifar.download(tmp_path / "data", "cifar10")
    assert calls == [(CIFAR10.url, CIFAR10.filename, CIFAR10.tgz_md5)] and not marker.exists()


@pytest.mark.parametrize("labels, expected", [
    ([[0, 1]] + [0] * 7, "'labels' is not a list of integer labels"),  # a ragged list (numpy refuses it with ValueError)
    ([True] + [0] * 7, "'labels' is not a list of integer labels"),
    ([2**70] + [0] * 7, "label 1180591620717411303424 of image 0 is outside 0..9"),
    (np.array(3), "'labels' is not a list of integer labels"),  # a 0-d array has no len()
])
def test_odd_label_lists_are_named(clean, tmp_path, labels, expected):
    root = data_copy(clean, tmp_path)
    edit_batch(root / FOLDERS["cifar10"], "data_batch_1", lambda batch: batch.update({b"labels": labels}))
    with pytest.raises(TaskHetError, match=f"data_batch_1: {re.escape(expected)}"):
        load_split(root, "cifar10", True, verify_checksums=False)
