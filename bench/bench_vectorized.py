"""Benchmark of vectorised clients (``--vectorize_clients``, network/vectorized.py); prints ratios.

Ratio = rounds per second of the engine with vectorised clients ÷ the same engine training
the clients one after another, for K = 8, 32, 128 sampled clients × 5 local steps of FedAvg
(momentum 0.9), on three models:

* ``decoder``: the demo's model (experiments/demo.yaml: the normal task's TaskModel with an
  EfficientNet-Lite0 encoder, frozen, decoder width 32, 32 px, batch 16) trained on *cached
  encoder maps*, as ``cache_features`` trains it: the maps are the frozen encoder's outputs of
  random images, computed once (random encoder weights: the timing does not depend on them);
* ``mlp``: the tiny MLP of bench/bench_engine.py (32 → 64 → 10, batch 16);
* ``cnn``: the small CNN of bench/bench_engine.py at 32 px (batch 32).

Each client holds 5 batches, so a round is 5 steps per client; every client is sampled. The
two engines' timed rounds alternate, so background load hits both alike. Beside each ratio:
the peak memory of the vectorised engine (CUDA: ``max_memory_allocated``; CPU: how much its
first round raises the process's peak RSS, ``ru_maxrss``, over the sequential engine's).

``--pfl`` runs instead the same FedAvg workload (tiny MLP) in Apple's pfl-research (``pfl``, a bench-only
dependency, imported only here) when it is importable, and prints TaskHet's rounds/s ÷ pfl's.

Run: ``.venv/bin/python bench/bench_vectorized.py`` (``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_engine import TensorDicts, small_cnn, tiny_mlp  # noqa: E402
from network.algorithms import build_algorithm  # noqa: E402
from network.client import ClientData  # noqa: E402
from network.engine_sequential import EngineConfig, SequentialEngine  # noqa: E402
from network.lr_schedule import make_lr_schedule  # noqa: E402
from utils.device import pick_device, prepare_model  # noqa: E402

STEPS = 5


def cross_entropy(model: nn.Module, batch: dict, reduction: str = "mean") -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch["x"]), batch["y"], reduction=reduction)


def decoder_case(count: int, batch_size: int = 16) -> tuple[nn.Module, list[ClientData], object]:
    """The demo's TaskModel (normal, frozen EfficientNet-Lite0, width 32, 32 px) and clients of cached maps."""
    from models import build_task_model, get_task

    model = build_task_model("normal", encoder="efficientnet_lite0", weights="none", freeze_encoder=True,
                             decoder_width=32, seed=0)
    task = get_task("normal")
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(batch_size * STEPS, 3, 32, 32, generator=generator)
    with torch.no_grad():
        maps = [feature.detach() for feature in model.encoder(model.normalise(images))]
    normals = nn.functional.normalize(torch.randn(batch_size * STEPS, 3, 32, 32, generator=generator), dim=1)

    class Maps(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return batch_size * STEPS

        def __getitem__(self, index: int) -> dict:
            return {"rgb": [feature[index] for feature in maps], "normal": normals[index],
                    "mask": torch.ones(1, 32, 32, dtype=torch.bool)}

    def loss(net: nn.Module, batch: dict, reduction: str = "mean") -> torch.Tensor:
        return task.loss(net(batch["rgb"])[0].float(), batch, reduction)

    return model, clients_of(count, lambda index: Maps(), batch_size), loss


def clients_of(count: int, dataset_of, batch_size: int) -> list[ClientData]:
    return [ClientData(str(index), batch_size * STEPS, lambda seed, data=dataset_of(index): DataLoader(
        data, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed)))
        for index in range(count)]


def tensor_case(count: int, shape: tuple[int, ...], batch_size: int, build) -> tuple[nn.Module, list[ClientData], object]:
    generator = torch.Generator().manual_seed(0)
    samples = batch_size * STEPS
    data = [TensorDicts(torch.randn(samples, *shape, generator=generator), torch.randint(0, 10, (samples,), generator=generator))
            for _ in range(count)]
    return build(), clients_of(count, lambda index: data[index], batch_size), cross_entropy


CASES = {
    "decoder": decoder_case,
    "mlp": lambda count: tensor_case(count, (32,), 16, tiny_mlp),
    "cnn": lambda count: tensor_case(count, (3, 32, 32), 32, small_cnn),
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
    began = time.perf_counter()
    engine.train_round(round_index)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - began


def time_engines(engines: dict[str, SequentialEngine], rounds: int, device: torch.device) -> tuple[dict, str]:
    """Median seconds per round of each engine, rounds interleaved (background load hits both alike), and the
    peak memory the last engine adds (its warm-up runs after the others')."""
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
    memory = (f"peak CUDA memory {torch.cuda.max_memory_allocated(device) / 2**20:.0f} MB" if device.type == "cuda"
              else f"peak RSS +{peak_rss_mb() - before:.0f} MB (process peak {peak_rss_mb():.0f} MB)")
    return {name: statistics.median(values) for name, values in times.items()}, memory


def compare(name: str, count: int, chunk: int, rounds: int, device: torch.device) -> None:
    model, clients, loss = CASES[name](count)
    with tempfile.TemporaryDirectory() as folder:
        engines = {label: make_engine(model, clients, loss, size, Path(folder) / label, device)
                   for label, size in (("sequential", 0), ("vectorised", min(chunk, count)))}
        seconds, memory = time_engines(engines, rounds, device)
    sequential, vectorized = seconds["sequential"], seconds["vectorised"]
    print(f"{name:8s} K={count:4d} chunk={min(chunk, count):4d}: sequential {sequential:.3f} s/round, "
          f"vectorised {vectorized:.3f} s/round; ratio {sequential / vectorized:.2f}x; {memory}", flush=True)


def pfl_rounds_per_second(count: int, rounds: int) -> float:
    """pfl-research's FedAvg on the tiny MLP case: K users of 5 batches of 16, 1 local epoch (5 steps), SGD
    momentum 0.9, every user sampled each round (cohort K), no evaluation; rounds per second after a warm-up."""
    import functools

    import numpy as np
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.model.pytorch import PyTorchModel

    class Module(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = tiny_mlp()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def loss(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> torch.Tensor:  # noqa: A002 (pfl's name)
            self.eval() if eval else self.train()
            return nn.functional.cross_entropy(self(x), y)

        def metrics(self, x: torch.Tensor, y: torch.Tensor, eval: bool = True) -> dict:  # noqa: A002
            return {}

    generator = torch.Generator().manual_seed(0)
    samples = 16 * STEPS
    data = {str(index): (torch.randn(samples, 32, generator=generator), torch.randint(0, 10, (samples,), generator=generator))
            for index in range(count)}
    module = Module()
    model = PyTorchModel(model=module, local_optimizer_create=functools.partial(torch.optim.SGD, momentum=0.9),
                         central_optimizer=torch.optim.SGD(module.parameters(), 1.0))
    users = list(data)
    federated = FederatedDataset(make_dataset_fn=lambda user: Dataset(raw_data=list(data[user]), user_id=user),
                                 user_sampler=get_user_sampler("minimize_reuse", users))
    backend = SimulatedBackend(training_data=federated, val_data=federated, postprocessors=[])
    np.random.seed(0)

    def run(iterations: int) -> float:
        params = NNAlgorithmParams(central_num_iterations=iterations, evaluation_frequency=10**6,
                                   train_cohort_size=count, val_cohort_size=0)
        began = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):  # pfl prints every round's metrics
            FederatedAveraging().run(backend=backend, model=model, algorithm_params=params,
                                     model_train_params=NNTrainHyperParams(local_learning_rate=0.01,
                                                                           local_num_epochs=1, local_batch_size=16),
                                     model_eval_params=NNEvalHyperParams(local_batch_size=16))
        return time.perf_counter() - began

    run(1)  # warm-up
    return rounds / run(rounds)


def compare_pfl(count: int, chunk: int, rounds: int, device: torch.device) -> None:
    model, clients, loss = CASES["mlp"](count)
    with tempfile.TemporaryDirectory() as folder:
        engines = {name: make_engine(model, clients, loss, chunk_size, Path(folder) / name, device)
                   for name, chunk_size in (("sequential", 0), ("vectorised", min(chunk, count)))}
        taskhet = {name: 1 / seconds for name, seconds in time_engines(engines, rounds, device)[0].items()}
    pfl = pfl_rounds_per_second(count, rounds)
    print(f"pfl      K={count:4d} (tiny MLP, FedAvg, 5 steps): pfl {pfl:.2f} rounds/s; TaskHet sequential "
          f"{taskhet['sequential']:.2f} ({taskhet['sequential'] / pfl:.2f}x pfl), vectorised "
          f"{taskhet['vectorised']:.2f} ({taskhet['vectorised'] / pfl:.2f}x pfl)", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="8,32,128", help="sampled clients per round (default: 8,32,128)")
    parser.add_argument("--models", default=",".join(CASES), help=f"which models (default: {','.join(CASES)})")
    parser.add_argument("--chunk", type=int, default=128, help="--vectorize_chunk (default: 128, whole rounds)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per engine (default: 3)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default: 1, steadier timings on a shared machine)")
    parser.add_argument("--use_accelerator", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--pfl", action="store_true",
                        help="only the side-by-side with pfl-research (needs `pfl`: see docs/BENCHMARKS.md)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = pick_device(args.use_accelerator)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {device}; "
          f"FedAvg, {STEPS} local steps, momentum 0.9", flush=True)
    counts = [int(value) for value in args.counts.split(",")]
    if args.pfl:
        try:
            import pfl  # noqa: F401  (bench-only, never a project dependency)
        except ImportError as error:
            raise SystemExit(f"--pfl needs pfl-research ({error}); docs/BENCHMARKS.md says how to install it "
                             "beside the project's venv") from error
        for count in counts:
            compare_pfl(count, args.chunk, args.rounds, device)
        return
    for name in args.models.split(","):
        for count in counts:
            compare(name, count, args.chunk, args.rounds, device)


if __name__ == "__main__":
    main()
