"""The workloads of bench/bench_vectorized.py (the demo's decoder on cached encoder maps, the tiny MLP, the small
CNN; K clients of 5 batches each) and their timing: both engines' rounds alternated, with the vectorised engine's
peak memory."""

from __future__ import annotations

import resource
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

from bench.bench_engine import TensorDicts, small_cnn, tiny_mlp
from network.algorithms import build_algorithm
from network.client import ClientData
from network.engine_sequential import EngineConfig, SequentialEngine
from network.lr_schedule import make_lr_schedule
from training.loop import make_loader
from utils.device import prepare_model

STEPS = 5


def cross_entropy(model: nn.Module, batch: dict, reduction: str = "mean") -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch["x"]), batch["y"], reduction=reduction)


def decoder_case(count: int, item_reads: bool, batch_size: int = 16) -> tuple[nn.Module, list[ClientData], object]:
    """The demo's TaskModel (normal, frozen EfficientNet-Lite0, width 32, 32 px) and clients of cached maps: a
    ``datasets.encoded.EncodedDataset`` (in memory) over random images, as ``cache_features`` trains it."""
    from datasets.encoded import ENCODED_KEY, EncodedDataset
    from models import build_task_model, get_task

    model = build_task_model("normal", encoder="efficientnet_lite0", weights="none", freeze_encoder=True,
                             decoder_width=32, seed=0)
    task = get_task("normal")
    samples = batch_size * STEPS
    generator = torch.Generator().manual_seed(0)
    images = TensorDicts.of(rgb=torch.rand(samples, 3, 32, 32, generator=generator),
                            normal=nn.functional.normalize(torch.randn(samples, 3, 32, 32, generator=generator), dim=1),
                            mask=torch.ones(samples, 1, 32, 32, dtype=torch.bool))
    maps = EncodedDataset(images, [str(index) for index in range(samples)], model.encoder, model.normalise, "rgb", 32, "bench", None,
                          torch.device("cpu"))

    def loss(net: nn.Module, batch: dict, reduction: str = "mean") -> torch.Tensor:
        return task.loss(net(batch[ENCODED_KEY])[0].float(), batch, reduction)

    return model, clients_of(count, lambda index: maps, batch_size, item_reads), loss


class ItemReads(Dataset):
    """A dataset read item by item, as every DataLoader batch was before ``datasets/batch_reads.py``."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> list[dict]:  # the cached datasets' batched item reads, as before
        read_many = getattr(self.dataset, "__getitems__", None)
        return read_many(indices) if callable(read_many) else [self.dataset[index] for index in indices]


def clients_of(count: int, dataset_of, batch_size: int, item_reads: bool) -> list[ClientData]:
    """Clients of ``batch_size * STEPS`` samples, loaded as TaskHet's runs load them (``make_loader``)."""
    return [ClientData(str(index), batch_size * STEPS, lambda seed, data=dataset_of(index): make_loader(
        ItemReads(data) if item_reads else data, batch_size, True, seed)) for index in range(count)]


def tensor_case(count: int, shape: tuple[int, ...], batch_size: int, build,
                item_reads: bool) -> tuple[nn.Module, list[ClientData], object]:
    generator = torch.Generator().manual_seed(0)
    samples = batch_size * STEPS
    data = [TensorDicts(torch.randn(samples, *shape, generator=generator), torch.randint(0, 10, (samples,), generator=generator))
            for _ in range(count)]
    return build(), clients_of(count, lambda index: data[index], batch_size, item_reads), cross_entropy


# case(count, item_reads, batch_size) -> (model, clients, loss); each case's default batch size is the one measured.
CASES = {
    "decoder": lambda count, item_reads, batch_size=16: decoder_case(count, item_reads, batch_size),
    "mlp": lambda count, item_reads, batch_size=16: tensor_case(count, (32,), batch_size, tiny_mlp, item_reads),
    "cnn": lambda count, item_reads, batch_size=32: tensor_case(count, (3, 32, 32), batch_size, small_cnn, item_reads),
}


def make_engine(model: nn.Module, clients: list[ClientData], loss, chunk: int, out_dir: Path,
                device: torch.device) -> SequentialEngine:
    config = EngineConfig(out_dir=out_dir, n_rounds=1000, lr_schedule=make_lr_schedule("constant", 0.01, 1),
                          local_steps=STEPS, momentum=0.9, progress=False, vectorize_chunk=chunk)
    algorithm, worker = build_algorithm("fedavg", model, {client.client_id: client.num_samples for client in clients})
    return SequentialEngine(prepare_model(worker, device), algorithm, clients, loss, lambda net, loader: {"loss": 0.0},
                            [], config, device)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed_round(engine: SequentialEngine, round_index: int, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()  # no queued work of the round before (a warm-up's) counts in this one
    began = time.perf_counter()
    engine.train_round(round_index)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - began


def time_engines(engines: dict[str, SequentialEngine], rounds: int, device: torch.device) -> tuple[dict, str, float]:
    """Median seconds per round of each engine, rounds interleaved (background load hits both alike), and the
    peak memory the last engine adds (its warm-up runs after the others'): as text, and in MB."""
    names = list(engines)
    for name in names[:-1]:
        engines[name].train_round(1)  # warm-up
    before = peak_rss_mb()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    engines[names[-1]].train_round(1)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(2, 2 + rounds):
        for name in names:
            times[name].append(timed_round(engines[name], round_index, device))
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
        memory = f"peak CUDA memory {peak:.0f} MB"
    else:
        peak = peak_rss_mb() - before
        memory = f"peak RSS +{peak:.0f} MB (process peak {peak_rss_mb():.0f} MB)"
    return {name: statistics.median(values) for name, values in times.items()}, memory, peak


@dataclass(frozen=True)
class CaseTiming:
    """One model at K clients: median seconds per round of each engine and the vectorised engine's peak memory."""

    sequential: float
    vectorised: float
    memory: str  # as printed: CUDA's max_memory_allocated, or the CPU's peak RSS increase
    peak_mb: float


def measure(name: str, count: int, chunk: int, rounds: int, device: torch.device, item_reads: bool,
            batch_size: int | None = None) -> CaseTiming:
    """Time the sequential engine and the vectorised one (chunks of ``min(chunk, count)``) on one case (at its own
    batch size unless ``batch_size`` is given)."""
    model, clients, loss = CASES[name](count, item_reads, *(() if batch_size is None else (batch_size,)))
    with tempfile.TemporaryDirectory() as folder:
        engines = {label: make_engine(model, clients, loss, size, Path(folder) / label, device)
                   for label, size in (("sequential", 0), ("vectorised", min(chunk, count)))}
        seconds, memory, peak = time_engines(engines, rounds, device)
    return CaseTiming(seconds["sequential"], seconds["vectorised"], memory, peak)
