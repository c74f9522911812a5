"""Tiny data built on the fly for tests: synthetic buildings and their step-1 manifest, CIFAR pickles.

Other test files import the helpers (``from tests.fixtures import render_tiny_dataset``)
or the session fixtures ``tiny_data_root`` / ``tiny_manifest`` (import them by name
into the test module), which render once per test session.
"""

from __future__ import annotations

import pickle
import struct
from pathlib import Path
from typing import Sequence

import numpy as np
import pytest

from datasets.selection import SelectionConfig, select_datapoints, write_selection
from datasets.synthetic import RenderConfig, render_dataset

VIEWS_PER_POINT = 3


def tiny_render_config(n_buildings: int = 4, n_views: int = 6, image_size: int = 32, seed: int = 0) -> RenderConfig:
    """The render config :func:`render_tiny_dataset` uses."""
    return RenderConfig(num_buildings=n_buildings, views_per_building=n_views, views_per_point=VIEWS_PER_POINT, image_size=image_size, seed=seed)


def render_tiny_dataset(root: Path, n_buildings: int = 4, n_views: int = 6, image_size: int = 32, seed: int = 0) -> Path:
    """Render synthetic buildings into ``root`` (one process, no progress bar); returns the data root.

    4 buildings x 6 views at 32x32 take about a tenth of a second. Every building
    gets a different scene class while ``n_buildings`` <= 12.
    """
    return render_dataset(Path(root), tiny_render_config(n_buildings, n_views, image_size, seed), workers=1, progress=False)


def make_tiny_manifest(root: Path, out_dir: Path, top_k: int = 4) -> Path:
    """Run step 1's library code on ``root`` (split by sample, 25% test, 10% validation, seed 0); returns
    ``manifest.csv``. Step 2 selects on the validation rows, as it does for every manifest step 1 writes."""
    config = SelectionConfig(data_path=Path(root), top_k_classes=top_k, test_fraction=0.25, val_fraction=0.1,
                             split_by="sample", seed=0)
    selection = select_datapoints(config, progress=False)
    return write_selection(selection, Path(out_dir))["manifest"]


@pytest.fixture(scope="session")
def tiny_data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny synthetic data root rendered once per session (treat as read-only)."""
    return render_tiny_dataset(tmp_path_factory.mktemp("tiny_synthetic"))


@pytest.fixture(scope="session")
def tiny_manifest(tiny_data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The step-1 manifest of :func:`tiny_data_root` (treat as read-only)."""
    return make_tiny_manifest(tiny_data_root, tmp_path_factory.mktemp("tiny_step1"))


class _Py2Pickler(pickle._Pickler):
    """Pickles as Python 2's cPickle wrote the CIFAR files (protocol 2): bytes as Python 2 ``str`` (the
    BINSTRING opcodes), numpy arrays through ``numpy.core.multiarray._reconstruct`` (numpy 1.x's name).

    The real files load as dicts with b"data" keys under ``encoding="bytes"`` and "data" keys under
    torchvision's ``encoding="latin1"``; Python 3's own bytes pickling would load as bytes under both
    (and at protocol 2 it needs ``_codecs.encode``, which the files never name).
    """

    dispatch = dict(pickle._Pickler.dispatch)

    def save_py2_str(self, obj: bytes) -> None:
        header = pickle.SHORT_BINSTRING + bytes([len(obj)]) if len(obj) < 256 else pickle.BINSTRING + struct.pack("<i", len(obj))
        self.write(header + obj)
        self.memoize(obj)

    dispatch[bytes] = save_py2_str

    def save_global(self, obj, name=None) -> None:
        if obj is _NUMPY_RECONSTRUCT:
            self.write(pickle.GLOBAL + b"numpy.core.multiarray\n_reconstruct\n")
            self.memoize(obj)
            return
        super().save_global(obj, name)


_NUMPY_RECONSTRUCT = np.ndarray.__reduce__(np.zeros(1))[0]


def dump_py2_pickle(path: Path, content: object) -> None:
    """Write ``content`` to ``path`` as the official CIFAR files are written (see :class:`_Py2Pickler`)."""
    with open(path, "wb") as file:
        _Py2Pickler(file, protocol=2).dump(content)


def write_tiny_cifar(root: Path, dataset: str, train_per_class: Sequence[int], test_per_class: int = 2, seed: int = 0,
                     learnable: bool = False) -> Path:
    """Write torchvision's on-disk CIFAR pickles (exact keys and dtypes, random pixels) under ``root``; returns ``root``.

    Class c gets ``train_per_class[c]`` training and ``test_per_class`` test images; cifar10 needs 10
    classes, cifar100 100 (fine labels). Labels are shuffled so files do not list classes in order.
    ``learnable``: each class's images share a brightness (plus noise), so a model can learn the labels.
    """
    rng = np.random.default_rng(seed)
    num_classes = len(train_per_class)

    def batch(counts: Sequence[int]) -> tuple[np.ndarray, list[int]]:
        labels = rng.permutation(np.repeat(np.arange(num_classes), counts)).tolist()
        pixels = rng.integers(0, 256, size=(len(labels), 3072))
        if learnable:
            brightness = (np.array(labels) * 200 // max(num_classes - 1, 1) + 20)[:, None]
            pixels = np.clip(brightness + (pixels - 128) // 8, 0, 255)
        return pixels.astype(np.uint8), labels

    names = [f"class_{label}".encode() for label in range(num_classes)]
    if dataset == "cifar10":
        folder = Path(root) / "cifar-10-batches-py"
        folder.mkdir(parents=True, exist_ok=True)
        data, labels = batch(train_per_class)
        for part, chunk in enumerate(np.array_split(np.arange(len(labels)), 5), start=1):
            dump_py2_pickle(folder / f"data_batch_{part}", {b"batch_label": b"training batch", b"labels": [labels[i] for i in chunk],
                                                 b"data": data[chunk], b"filenames": [b"x.png"] * len(chunk)})
        data, labels = batch([test_per_class] * num_classes)
        dump_py2_pickle(folder / "test_batch", {b"batch_label": b"testing batch", b"labels": labels, b"data": data})
        dump_py2_pickle(folder / "batches.meta", {b"label_names": names, b"num_cases_per_batch": 10000, b"num_vis": 3072})
    else:
        folder = Path(root) / "cifar-100-python"
        folder.mkdir(parents=True, exist_ok=True)
        for name, counts in (("train", train_per_class), ("test", [test_per_class] * num_classes)):
            data, labels = batch(counts)
            dump_py2_pickle(folder / name, {b"filenames": [b"x.png"] * len(labels), b"batch_label": name.encode(),
                                 b"fine_labels": labels, b"coarse_labels": [label // 5 for label in labels], b"data": data})
        dump_py2_pickle(folder / "meta", {b"fine_label_names": names, b"coarse_label_names": [f"super_{i}".encode() for i in range(20)]})
    return Path(root)


class Killed(Exception):
    """Stands in for the process being killed."""


def die_after_saving(monkeypatch, module, epoch: int = 1, name: str = "last.pt") -> None:
    """Make ``module.atomic_torch_save`` write ``name`` of ``epoch`` (its ``state["epoch"]``) and then raise
    :class:`Killed`, as a process killed right after its checkpoint would stop."""
    real_save = module.atomic_torch_save

    def save_then_die(obj, path):
        real_save(obj, path)
        if path.name == name and obj["state"]["epoch"] == epoch:
            raise Killed

    monkeypatch.setattr(module, "atomic_torch_save", save_then_die)


def script_evaluation(monkeypatch, scripted: dict[str, list[float]]) -> None:
    """Replace step 2's evaluation (``training.fit._evaluate_all``) by ``scripted``: split -> its loss at epoch 0, 1, …
    (top-1 a flat 0.5); training itself still runs."""
    import training.fit

    calls = {"epoch": 0}

    def evaluate_all(model, loaders, spec, device, input_key, progress=True):
        epoch = calls["epoch"]
        calls["epoch"] += 1
        return {split: {"loss": scripted[split][epoch], "top1": 0.5} for split in loaders}

    monkeypatch.setattr(training.fit, "_evaluate_all", evaluate_all)
