"""Benchmark: decoded-sample cache reads vs PNG decoding (samples per second and their ratio).

Renders a synthetic dataset into a temp folder, then reads every sample of its
manifest three times: decoding the PNGs (no cache), filling the cache (first
pass), and reading the filled cache (later epochs). Prints samples/s and the
ratio cached / PNG. Then reads the filled cache in DataLoader batches (``--batch_size``,
shuffled, through ``Subset``, as a federated client does), once one sample at a time
and once with the dataset's batched read (``__getitems__``), and prints their ratio.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

# `make bench` runs this file as a script, so the repository root is not on sys.path by itself.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torch.utils.data import DataLoader, Subset  # noqa: E402

from datasets.selection import SelectionConfig, select_datapoints  # noqa: E402
from datasets.synthetic import RenderConfig, render_dataset  # noqa: E402
from datasets.taskonomy import TaskonomyDataset  # noqa: E402
from datasets.taskonomy_domains import DOMAINS  # noqa: E402
from utils.cli import positive_int, run_main  # noqa: E402


def samples_per_second(dataset: TaskonomyDataset) -> float:
    """Read every sample once; samples per second."""
    start = time.perf_counter()
    for index in range(len(dataset)):
        dataset[index]
    return len(dataset) / (time.perf_counter() - start)


class OneByOne(Subset):
    """A Subset without torch's batched read: the DataLoader then calls ``__getitem__`` per sample."""

    __getitems__ = None  # torch's fetcher checks ``hasattr(dataset, "__getitems__") and dataset.__getitems__``


def loader_samples_per_second(subset: Subset, batch_size: int, epochs: int = 5) -> float:
    """Read ``subset`` ``epochs`` times in shuffled DataLoader batches; samples per second."""
    loader = DataLoader(subset, batch_size=batch_size, shuffle=True)
    start = time.perf_counter()
    for _ in range(epochs):
        for _batch in loader:
            pass
    return epochs * len(subset) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n_buildings", type=positive_int, default=8)
    parser.add_argument("--n_views", type=positive_int, default=50)
    parser.add_argument("--render_size", type=positive_int, default=128, help="resolution of the PNGs on disk")
    parser.add_argument("--image_size", type=positive_int, default=64, help="training resolution (decoded and cached)")
    parser.add_argument("--batch_size", type=positive_int, default=16, help="DataLoader batch of the batched-read comparison")
    args = parser.parse_args(argv)
    domains = [domain for domain in DOMAINS if domain != "rgb"]
    with tempfile.TemporaryDirectory() as temp:
        root = render_dataset(Path(temp) / "data", RenderConfig(args.n_buildings, args.n_views, 5, args.render_size, 0), progress=False)
        manifest = select_datapoints(SelectionConfig(data_path=root), progress=False).manifest
        png_rate = samples_per_second(TaskonomyDataset(root, manifest, domains, args.image_size))
        cached = TaskonomyDataset(root, manifest, domains, args.image_size, cache_dir=Path(temp) / "cache")
        fill_rate = samples_per_second(cached)
        cached_rate = samples_per_second(cached)
        every = list(range(len(cached)))
        one_by_one = loader_samples_per_second(OneByOne(cached, every), args.batch_size)
        batched = loader_samples_per_second(Subset(cached, every), args.batch_size)
    ratio = cached_rate / png_rate
    print(f"decoded-sample cache, {len(manifest)} samples, {len(domains) + 1} domains, {args.render_size}px PNGs -> {args.image_size}px")
    print(f"  PNG decoding:      {png_rate:8.1f} samples/s")
    print(f"  cache first pass:  {fill_rate:8.1f} samples/s")
    print(f"  cached reads:      {cached_rate:8.1f} samples/s")
    print(f"  ratio cached/PNG:  {ratio:8.1f}x")
    print(f"DataLoader batches of {args.batch_size} from the filled cache (collated):")
    print(f"  one sample at a time:     {one_by_one:8.1f} samples/s")
    print(f"  batched reads:            {batched:8.1f} samples/s")
    print(f"  ratio batched/one by one: {batched / one_by_one:8.2f}x")
    return ratio


if __name__ == "__main__":
    run_main(main)
