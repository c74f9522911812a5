"""Benchmark of the sequential federated engine (network/engine_sequential.py); prints ratios.

1. Overhead: one FedAvg round of K clients × J local steps through the engine against
   the same K·J SGD steps in a plain PyTorch loop on one model, same data loaders.
   Ratio = plain time / engine time (1.0 = no overhead; the goal is >= 0.95).
2. Scaling: time per round with 10, 100 and 1,000 clients of a small model (it should
   grow linearly: constant time per client), and the process RSS after each round
   (it should stay flat: no per-client leak). SCAFFOLD's per-client c_i are state the
   algorithm needs (N × model size, spillable); they are reported separately.
3. Methods: each algorithm's round time ÷ FedAvg's on the small-CNN case, measured interleaved in
   one run, with the factor its design predicts beside it (``--methods``; ``name:key=value`` sets a
   setting, e.g. ``ccvr:covariance=diagonal``).

Run: ``.venv/bin/python bench/bench_engine.py`` (``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
from torch import nn
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from network.algorithms import build_algorithm  # noqa: E402
from network.client import ClientData  # noqa: E402
from network.engine_sequential import EngineConfig, SequentialEngine  # noqa: E402
from network.lr_schedule import make_lr_schedule  # noqa: E402
from training.loop import make_loader  # noqa: E402
from utils.device import pick_device, prepare_model, to_device  # noqa: E402


class TensorDicts(Dataset):
    """Samples ``{"x": ..., "y": ...}`` from two tensors (the batch-dict convention), whose DataLoader batches are
    read whole, as the data families' are (``read_batch``, datasets/batch_reads.py)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.columns = {"x": x, "y": y}

    @classmethod
    def of(cls, **columns: torch.Tensor) -> "TensorDicts":
        """Samples with these keys (each column's first dimension indexes the samples)."""
        dataset = cls.__new__(cls)
        dataset.columns = columns
        return dataset

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, index: int) -> dict:
        # ids, as a data family's (FedEM)
        return {**{name: column[index] for name, column in self.columns.items()}, "sample_id": index}

    def read_batch(self, indices: list[int]) -> dict:
        rows = torch.as_tensor(indices, dtype=torch.long)  # indexing with a list would convert it once per column
        return {**{name: column[rows] for name, column in self.columns.items()}, "sample_id": rows}


class SmallCNN(nn.Module):
    """Two conv blocks and a linear classifier head (``head_keys``, as a TaskModel: FedRep, MOCHA)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                  nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten())
        self.head = nn.Linear(64 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def head_keys(self) -> list[str]:
        return ["head.weight", "head.bias"]


def small_cnn() -> nn.Module:
    return SmallCNN()


def tiny_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def loss_fn(model: nn.Module, batch: dict, reduction: str = "mean") -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch["x"]), batch["y"], reduction=reduction)


def make_clients(count: int, samples: int, shape: tuple[int, ...], batch_size: int) -> list[ClientData]:
    generator = torch.Generator().manual_seed(0)
    clients = []
    for index in range(count):
        labels = torch.randint(0, 10, (samples,), generator=generator)
        data = TensorDicts(torch.randn(samples, *shape, generator=generator), labels)
        counts = tuple(torch.bincount(labels, minlength=10).tolist())  # FedLC's calibration and FedRoD's prior read them
        clients.append(ClientData(str(index), samples, lambda seed, data=data: make_loader(data, batch_size, True, seed),
                                  class_counts=counts))
    return clients


def make_engine(model: nn.Module, name: str, clients: list[ClientData], steps: int, out_dir: Path,
                device: torch.device, settings: dict | None = None) -> SequentialEngine:
    config = EngineConfig(out_dir=out_dir, n_rounds=1000, lr_schedule=make_lr_schedule("constant", 0.01, 1),
                          local_steps=steps, progress=False)
    algorithm, worker = build_algorithm(name, model, {client.client_id: client.num_samples for client in clients},
                                        settings)
    return SequentialEngine(worker, algorithm, clients, loss_fn, lambda net, loader: {"loss": 0.0}, [], config, device)


def plain_loop(model: nn.Module, clients: list[ClientData], steps: int, device: torch.device) -> None:
    """K·J SGD steps on one model over the same loaders: the floor any engine is measured against."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model.train()
    for client in clients:
        taken = 0
        while taken < steps:
            for batch in client.train_loader(0):
                batch = to_device(batch, device)
                optimizer.zero_grad(set_to_none=True)
                loss_fn(model, batch).backward()
                optimizer.step()
                taken += 1
                if taken == steps:
                    break
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(function) -> float:
    began = time.perf_counter()
    function()
    return time.perf_counter() - began


def overhead(device: torch.device, clients: int, steps: int, repeats: int, tiny: bool = False) -> None:
    data = make_clients(clients, 32, (32,), 16) if tiny else make_clients(clients, 256, (3, 32, 32), 32)
    model = prepare_model(tiny_mlp() if tiny else small_cnn(), device)
    with tempfile.TemporaryDirectory() as folder:
        engine = make_engine(model, "fedavg", data, steps, Path(folder), device)
        engine.train_round(1)  # warm-up (lazy imports, allocator)
        plain_loop(model, data, steps, device)
        engine_times, plain_times = [], []
        for round_index in range(2, 2 + repeats):  # interleaved, so background load hits both alike
            engine_times.append(timed(lambda: (engine.train_round(round_index),
                                               device.type == "cuda" and torch.cuda.synchronize())))
            plain_times.append(timed(lambda: plain_loop(model, data, steps, device)))
    engine_time, plain_time = statistics.median(engine_times), statistics.median(plain_times)
    what = "tiny MLP, batch 16: the worst case" if tiny else "small CNN, 32×32, batch 32"
    print(f"overhead: {clients} clients × {steps} steps ({what}) on {device}: "
          f"engine {engine_time:.3f} s/round, plain loop {plain_time:.3f} s; ratio plain/engine = "
          f"{plain_time / engine_time:.3f}; engine overhead per client {1e3 * (engine_time - plain_time) / clients:.2f} ms")


def scaling(device: torch.device, counts: list[int], steps: int, rounds: int) -> None:
    process = psutil.Process()
    per_client = {}
    for name in ("fedavg", "scaffold"):
        for count in counts:
            data = make_clients(count, 32, (32,), 16)
            model = prepare_model(tiny_mlp(), device)
            with tempfile.TemporaryDirectory() as folder:
                engine = make_engine(model, name, data, steps, Path(folder), device)
                engine.train_round(1)
                times, rss = [], []
                for round_index in range(2, 2 + rounds):
                    times.append(timed(lambda: engine.train_round(round_index)))
                    rss.append(process.memory_info().rss / 2**20)
                state_mb = engine.store.memory_bytes / 2**20
            round_time = statistics.median(times)
            per_client[(name, count)] = round_time / count
            print(f"scaling {name}: {count:5d} clients × {steps} steps: {round_time:.3f} s/round, "
                  f"{1e3 * round_time / count:.3f} ms/client; RSS per round (MB): "
                  f"{', '.join(f'{value:.1f}' for value in rss)}; client state {state_mb:.2f} MB")
        smallest, largest = min(counts), max(counts)
        print(f"scaling {name}: time per client at {largest} vs {smallest} clients = "
              f"{per_client[(name, largest)] / per_client[(name, smallest)]:.3f} (1.0 = linear)")


# What each method's design predicts for its round time over FedAvg's (J local steps of one model):
# Ditto and FedRep train twice; pFedMe takes K = 5 inner steps per local step; FedEM trains M = 3
# components plus an E-step (M forward passes over the client's rows); q-FedAvg adds one forward pass.
EXPECTED_FACTORS = {"fedavg": "1", "fedprox": "≈ 1", "scaffold": "≈ 1", "fedrep": "≈ 2", "fedper": "≈ 1",
                    "fedbn": "≈ 1", "ditto": "≈ 2", "ifca": "≈ 1 + k forward passes", "local": "≈ 1",
                    "pfedme": "≈ K = 5", "fedem": "≈ M = 3 (+ E-step)", "qfedavg": "≈ 1 (+ 1 forward pass)",
                    "fedamp": "≈ 1 (+ server mixing, N·model)", "mocha": "≈ 1", "cfl": "≈ 1", "sparse_ft": "≈ 1",
                    # the standard non-IID baselines: a forward pass is about a third of a training step
                    "feddyn": "≈ 1", "fednova": "≈ 1", "feddecorr": "≈ 1", "fedlc": "≈ 1", "lgfedavg": "≈ 1",
                    "moon": "≈ 1.7 (+ 2 forward passes a step)", "apfl": "≈ 2 (w and v̄ each a backward pass)",
                    "perfedavg": "≈ 4 hf (2 steps + 2 gradients for Hv) / 2 fo",
                    "fedala": "≈ 1 + ALA (one pass over 80% of the data: 6.4 steps on J)",
                    "ccvr": "≈ 1 + 1 forward pass over the data, + d² statistics and the server's calibration"}


def method_spec(text: str) -> tuple[str, dict[str, str]]:
    """``ccvr:covariance=diagonal:num_virtual=200`` -> ("ccvr", {"covariance": "diagonal", "num_virtual": "200"})."""
    name, *pairs = text.split(":")
    return name, dict(pair.split("=", 1) for pair in pairs)


def methods(device: torch.device, names: list[str], clients: int, steps: int, repeats: int) -> None:
    """Each method's round time over FedAvg's, interleaved round by round so background load hits all alike.

    ``names`` are algorithm names, each optionally with settings: ``ccvr:covariance=diagonal``."""
    data = make_clients(clients, 256, (3, 32, 32), 32)
    engines, times = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        for spec in ["fedavg", *[spec for spec in names if spec != "fedavg"]]:
            name, settings = method_spec(spec)
            torch.manual_seed(0)
            engines[spec] = make_engine(prepare_model(small_cnn(), device), name, data, steps,
                                        Path(folder) / spec.replace(":", "_"), device, settings)
            engines[spec].train_round(1)  # warm-up
            times[spec] = []
        for round_index in range(2, 2 + repeats):
            for name, engine in engines.items():
                times[name].append(timed(lambda: (engine.train_round(round_index),
                                                  device.type == "cuda" and torch.cuda.synchronize())))
    base = statistics.median(times["fedavg"])
    print(f"methods: {clients} clients × {steps} steps (small CNN, 32×32, batch 32) on {device}; "
          f"fedavg {base:.3f} s/round")
    for name in engines:
        ratio = statistics.median(times[name]) / base
        print(f"methods: {name:10s} {statistics.median(times[name]):.3f} s/round, ÷ fedavg = {ratio:.2f} "
              f"(expected {EXPECTED_FACTORS.get(method_spec(name)[0], '?')})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=10, help="K of the overhead comparison (default: 10)")
    parser.add_argument("--steps", type=int, default=20, help="J of the overhead comparison (default: 20)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds of the overhead comparison (default: 5)")
    parser.add_argument("--counts", default="10,100,1000", help="client counts of the scaling test")
    parser.add_argument("--scaling_steps", type=int, default=5, help="local steps in the scaling test (default: 5)")
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds per client count (default: 4)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default: 1, steadier timings on a shared machine)")
    parser.add_argument("--use_accelerator", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--methods", default="",
                        help="comma-separated algorithms to time against fedavg instead of the default benchmarks "
                             "(e.g. local,pfedme,fedem,qfedavg,fedamp,mocha,cfl,ditto)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = pick_device(args.use_accelerator)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {device}")
    if args.methods:
        methods(device, args.methods.split(","), args.clients, args.steps, args.repeats)
        return
    overhead(device, args.clients, args.steps, args.repeats)
    overhead(device, 100, 5, args.repeats, tiny=True)
    scaling(device, [int(count) for count in args.counts.split(",")], args.scaling_steps, args.rounds)


if __name__ == "__main__":
    main()
