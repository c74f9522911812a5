"""Whole-batch reads (datasets/batch_reads.py): every family's ``read_batch`` equals torch's collation of its
items, and ``make_loader`` hands out the same batches, in the same order, as an item-by-item DataLoader."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Subset, default_collate

from datasets.batch_reads import BatchReads, batch_reader
from datasets.cifar import CifarDataset, select_cifar
from datasets.cifar_files import load_split
from datasets.digits import DigitsDataset, select_digits
from datasets.encoded import ENCODED_KEY, EncodedDataset
from datasets.family import list_families
from datasets.imagefolder import ImageFolderDataset, select_imagefolder
from datasets.paired_folders import PairedDataset
from datasets.paired_selection import select_paired
from datasets.taskonomy import TaskonomyDataset, read_manifest
from models import build_task_model, get_task
from tests.fixtures import tiny_data_root, tiny_manifest, write_tiny_cifar  # noqa: F401 (fixtures)
from tests.folder_fixtures import write_imagefolder, write_paired_folders
from training.loop import make_loader
from utils.seeding import torch_generator

BATCH = [5, 0, 5, 11, 3]  # a repeated sample and an unsorted order


def assert_same_batch(got, want) -> None:
    """The same structure, key order, dtypes, shapes, memory layout and values."""
    assert type(got) is type(want)
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous() == want.is_contiguous()
        assert torch.equal(got, want)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            assert_same_batch(got[key], want[key])
    elif isinstance(want, list):
        assert len(got) == len(want)
        for one, other in zip(got, want):
            assert_same_batch(one, other)
    else:
        assert got == want


def collated(dataset, indices: list[int]) -> dict:
    return default_collate([dataset[index] for index in indices])


@pytest.fixture(scope="module")
def cifar_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("cifar")
    write_tiny_cifar(root, "cifar10", [3] * 10, test_per_class=1)
    return root


def digits(image_size: int = 16) -> DigitsDataset:
    return DigitsDataset(select_digits(0.25, seed=0, n_samples=60), image_size)


def cifar(root, image_size: int) -> CifarDataset:
    return CifarDataset(root, select_cifar(root, "cifar10", 1.0, 0.1, seed=0, verify_checksums=False), image_size)


def taskonomy(root, manifest, cache_dir=None) -> TaskonomyDataset:
    return TaskonomyDataset(root, read_manifest(manifest), ["normal", "segment_semantic"], 16, cache_dir=cache_dir)


def imagefolder(tmp_path) -> ImageFolderDataset:
    root = write_imagefolder(tmp_path / "imagefolder")
    return ImageFolderDataset(root, select_imagefolder(root, 0.25, 0.1, seed=0).manifest, 16, tmp_path / "cache")


def paired(tmp_path) -> PairedDataset:
    root = write_paired_folders(tmp_path / "paired")
    return PairedDataset(root, select_paired(root, 0.25, 0.1, seed=0).manifest, get_task("folder_segmentation"), 16,
                         tmp_path / "cache")


# One builder per registered family: a family added without one fails test_every_family_reads_whole_batches.
FAMILY_DATASETS = {
    "imagefolder": lambda root, manifest, cifar_root, tmp_path: imagefolder(tmp_path),
    "paired_folders": lambda root, manifest, cifar_root, tmp_path: paired(tmp_path),
    "digits": lambda root, manifest, cifar_root, tmp_path: digits(),
    "cifar": lambda root, manifest, cifar_root, tmp_path: cifar(cifar_root, 24),
    "taskonomy": lambda root, manifest, cifar_root, tmp_path: taskonomy(root, manifest, tmp_path / "cache"),
}


def test_every_family_reads_whole_batches(tiny_data_root, tiny_manifest, cifar_root, tmp_path):  # noqa: F811
    assert sorted(FAMILY_DATASETS) == sorted(list_families())
    for name, build in FAMILY_DATASETS.items():
        dataset = build(tiny_data_root, tiny_manifest, cifar_root, tmp_path)
        assert callable(getattr(dataset, "read_batch", None)), name
        want = collated(dataset, BATCH)
        assert_same_batch(dataset.read_batch(BATCH), want)
        assert_same_batch(dataset.read_batch(BATCH), want)  # a second read (Taskonomy: from the cache it filled)


@pytest.mark.parametrize("image_size", [8, 16, 32])
def test_digits_batches_are_the_collated_items(image_size):
    dataset = digits(image_size)
    got = dataset.read_batch(BATCH)
    assert_same_batch(got, collated(dataset, BATCH))
    assert got["image"].shape == (len(BATCH), 3, image_size, image_size)
    assert got["digit_class"] is not got["label"]  # two tensors, as collation makes: editing one leaves the other


@pytest.mark.parametrize("image_size", [24, 32, 40])
def test_cifar_batches_are_the_collated_items_resized_or_not(cifar_root, image_size):
    dataset = cifar(cifar_root, image_size)
    assert_same_batch(dataset.read_batch(BATCH), collated(dataset, BATCH))


def test_cifar_images_are_scaled_and_resized_bilinearly_by_hand(cifar_root):
    # 32 -> 16 px, bilinear without aligned corners, samples each output pixel halfway between two source
    # pixels in both directions: the mean of a 2x2 block. 32 px is the file's image / 255.
    manifest = select_cifar(cifar_root, "cifar10", 1.0, 0.1, seed=0, verify_checksums=False)
    rows = manifest[manifest["split"] == "test"].iloc[:3]
    images, _ = load_split(cifar_root, "cifar10", False, verify_checksums=False)
    raw = torch.from_numpy(images[rows["image_index"].to_numpy()]).permute(0, 3, 1, 2).double() / 255
    halved = CifarDataset(cifar_root, rows, 16).read_batch([0, 1, 2])["image"]
    torch.testing.assert_close(halved.double(), raw.reshape(3, 3, 16, 2, 16, 2).mean((3, 5)), rtol=0, atol=1e-6)
    torch.testing.assert_close(CifarDataset(cifar_root, rows, 32).read_batch([2, 0])["image"].double(), raw[[2, 0]],
                               rtol=0, atol=1e-7)
    assert halved.min() >= 0 and halved.max() <= 1


def test_taskonomy_batches_whatever_the_cache_holds(tiny_data_root, tiny_manifest, tmp_path, monkeypatch):  # noqa: F811
    plain = taskonomy(tiny_data_root, tiny_manifest)
    want = collated(plain, BATCH)
    assert_same_batch(plain.read_batch(BATCH), want)  # no cache: decoded one by one
    cached = taskonomy(tiny_data_root, tiny_manifest, tmp_path / "cache")
    cached[0]
    assert_same_batch(cached.read_batch(BATCH), want)  # partly filled: one by one, filling the rest
    monkeypatch.setattr(cached.cache, "get", lambda index: (_ for _ in ()).throw(AssertionError("read one by one")))
    monkeypatch.setattr(cached, "__getitems__", lambda indices: (_ for _ in ()).throw(AssertionError("item reads")))
    got = cached.read_batch(BATCH)  # filled: one read per array, collated as read
    assert_same_batch(got, want)
    assert got["segment_semantic"].dtype == torch.int64 and got["scene_class"].shape == (len(BATCH),)


@pytest.mark.parametrize("on_disk", [True, False])
def test_encoded_batches_are_the_collated_items(tiny_data_root, tiny_manifest, tmp_path, monkeypatch, on_disk):  # noqa: F811
    manifest = read_manifest(tiny_manifest)
    model = build_task_model("segment_semantic", "small_cnn", "none", seed=0, freeze_encoder=True)
    base = TaskonomyDataset(tiny_data_root, manifest, ["segment_semantic"], 32, cache_dir=tmp_path / "decoded")
    ids = manifest["sample_id"].tolist()
    dataset = EncodedDataset(base, ids, model.encoder, model.normalise, "rgb", 32, "test",
                             tmp_path / "cache" if on_disk else None, torch.device("cpu"))
    want = collated(dataset, BATCH)
    with monkeypatch.context() as patch:  # filled: the maps and the base's batch are each read whole
        patch.setattr(dataset, "__getitems__", lambda indices: (_ for _ in ()).throw(AssertionError("item reads")))
        patch.setattr(TaskonomyDataset, "__getitem__", lambda self, index: (_ for _ in ()).throw(AssertionError("base item")))
        got = dataset.read_batch(BATCH)
    assert_same_batch(got, want)
    assert "rgb" not in got and list(got)[-1] == ENCODED_KEY and len(got[ENCODED_KEY]) > 1
    monkeypatch.setattr(dataset.store, "get_many", lambda rows: None)  # a row another process has not filled yet
    assert_same_batch(dataset.read_batch(BATCH), want)


class ItemsOnly(torch.utils.data.Dataset):
    """A family dataset without ``read_batch``."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        return self.dataset[index]


def test_encoded_batches_over_a_base_that_reads_items_only():
    base = digits(32)
    model = build_task_model("digit_class", "small_cnn", "none", seed=0, freeze_encoder=True, num_classes=10)
    dataset = EncodedDataset(ItemsOnly(base), base.sample_ids, model.encoder, model.normalise, "image", 32, "test", None,
                             torch.device("cpu"))
    assert_same_batch(dataset.read_batch(BATCH), collated(dataset, BATCH))


def test_an_empty_read_has_the_item_dtypes(cifar_root):
    dataset = digits(8)
    empty = dataset.read_batch([])
    assert empty["image"].shape == (0, 3, 8, 8) and empty["label"].dtype == torch.int64 and empty["sample_id"] == []
    assert batch_reader(Subset(dataset, [4, 2]))[[]]["image"].shape == (0, 3, 8, 8)
    assert cifar(cifar_root, 24).read_batch([])["image"].shape == (0, 3, 24, 24)
    model = build_task_model("digit_class", "small_cnn", "none", seed=0, freeze_encoder=True, num_classes=10)
    encoded = EncodedDataset(dataset, dataset.sample_ids, model.encoder, model.normalise, "image", 8, "test", None,
                             torch.device("cpu"))
    assert encoded.read_batch([])["label"].shape == (0,)


def test_a_dataset_without_read_batch_is_read_item_by_item():
    items = [{"x": torch.tensor([float(index)]), "sample_id": str(index)} for index in range(7)]
    assert batch_reader(items) is None and batch_reader(Subset(items, [1, 2])) is None
    loader = make_loader(Subset(items, [6, 1, 4]), 2, True, seed=0)
    assert loader.batch_size == 2 and isinstance(loader.dataset, Subset)
    assert sorted(sample for batch in loader for sample in batch["sample_id"]) == ["1", "4", "6"]


def item_by_item(dataset, batch_size: int, shuffle: bool, seed: int) -> DataLoader:
    """What make_loader built before whole-batch reads: torch's automatic batching over items."""
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=torch_generator(seed, "loader"))


@pytest.mark.parametrize("shuffle", [True, False])
def test_make_loader_gives_the_batches_an_item_by_item_loader_gives(shuffle):
    dataset = digits()
    # a client's rows (a tensor of indices) inside a temporal schedule's rows: two Subsets deep
    nested = Subset(Subset(dataset, torch.tensor([30, 2, 17, 9, 25, 4, 11, 38, 0, 21, 7])), [10, 3, 0, 8, 5, 1, 6])
    loader, reference = make_loader(nested, 3, shuffle, seed=5), item_by_item(nested, 3, shuffle, seed=5)
    assert isinstance(loader.dataset, BatchReads) and len(loader.dataset) == len(nested) == 7
    assert len(loader) == len(reference) == 3  # the short last batch is kept
    for epoch in range(2):  # the second epoch's order comes from the generator's state after the first
        batches, expected = list(loader), list(reference)
        assert len(batches) == len(expected)
        for got, want in zip(batches, expected):
            assert_same_batch(got, want)
    assert torch.equal(loader.generator.get_state(), reference.generator.get_state())  # what a checkpoint saves


def test_make_loader_with_workers_gives_the_same_batches():
    dataset = digits()
    loader = make_loader(Subset(dataset, list(range(0, 40, 3))), 4, True, seed=1, num_workers=1)
    assert loader.persistent_workers and loader.pin_memory == torch.cuda.is_available()
    assert not make_loader(dataset, 4, True, seed=1).persistent_workers
    for got, want in zip(list(loader), list(item_by_item(Subset(dataset, list(range(0, 40, 3))), 4, True, seed=1))):
        assert_same_batch(got, want)


def test_a_collate_function_keeps_item_reads():
    # A client's skews transform items in the collate function, so they must still see items.
    dataset = digits()
    seen = []
    loader = make_loader(Subset(dataset, [3, 8, 1]), 2, False, seed=0, collate_fn=lambda items: seen.append(items) or
                         default_collate(items))
    batches = list(loader)
    assert [len(items) for items in seen] == [2, 1] and all(isinstance(item, dict) for item in seen[0])
    assert_same_batch(batches[0], collated(dataset, [3, 8]))


def test_a_subset_subclass_keeps_item_reads():
    class Flipped(Subset):  # changes its items, so reading its dataset's batches would skip that
        def __getitem__(self, index):
            item = dict(self.dataset[self.indices[index]])
            item["image"] = item["image"].flip(-1)
            return item

        def __getitems__(self, indices):  # torch requires it beside __getitem__
            return [self[index] for index in indices]

    dataset = digits()
    assert batch_reader(Flipped(dataset, [1, 2])) is None and batch_reader(Subset(Flipped(dataset, [1, 2]), [0])) is None
    batch = next(iter(make_loader(Flipped(dataset, [1, 2]), 2, False, seed=0)))
    assert torch.equal(batch["image"], dataset.read_batch([1, 2])["image"].flip(-1))


def test_index_maps_compose_outermost_first():
    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 10

        def __getitem__(self, index: int) -> int:
            return index

        def read_batch(self, indices: list[int]) -> list[int]:
            return indices

    reader = batch_reader(Subset(Subset(Rows(), [9, 8, 7, 6]), np.array([3, 0])))
    assert reader[[0, 1, 1]] == [6, 9, 9] and len(reader) == 2


def test_a_loader_for_accelerate_keeps_item_reads():
    # step 2's training loader: accelerate's split_batches reads the DataLoader's batch_size
    loader = make_loader(digits(), 4, True, seed=0, batch_reads=False)
    assert loader.batch_size == 4 and isinstance(loader.dataset, DigitsDataset)
    assert_same_batch(next(iter(loader)), next(iter(make_loader(digits(), 4, True, seed=0))))
