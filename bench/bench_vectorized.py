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

Each client holds 5 batches, read whole as the families' datasets read them (`--item_reads`: item by item, as
before datasets/batch_reads.py), so a round is 5 steps per client; every client is sampled. The
two engines' timed rounds alternate, so background load hits both alike. Beside each ratio:
the peak memory of the vectorised engine (CUDA: ``max_memory_allocated``; CPU: how much its
first round raises the process's peak RSS, ``ru_maxrss``, over the sequential engine's).

``--chunks 4,128`` times each chunk size (``--vectorize_chunk``). ``--ceiling`` prints instead, for the conv
models, the sequential round's CPU time ÷ the CPU time of its convolutions and max-pools alone in their fastest
form (each Conv2d layer timed one client after another and as vmap's grouped convolution, each MaxPool2d one
client after another and with the clients' batches as one): a ratio no engine reaches while it runs these kernels.

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
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_engine import TensorDicts, small_cnn, tiny_mlp  # noqa: E402
from network.algorithms import build_algorithm  # noqa: E402
from network.client import ClientData  # noqa: E402
from network.engine_sequential import EngineConfig, SequentialEngine  # noqa: E402
from network.lr_schedule import make_lr_schedule  # noqa: E402
from training.loop import make_loader  # noqa: E402
from utils.device import pick_device, prepare_model  # noqa: E402

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


def compare(name: str, count: int, chunk: int, rounds: int, device: torch.device, item_reads: bool) -> None:
    timing = measure(name, count, chunk, rounds, device, item_reads)
    sequential, vectorized = timing.sequential, timing.vectorised
    print(f"{name:8s} K={count:4d} chunk={min(chunk, count):4d}: sequential {sequential:.3f} s/round, "
          f"vectorised {vectorized:.3f} s/round; ratio {sequential / vectorized:.2f}x; {timing.memory}", flush=True)


KERNEL_LAYERS = (nn.Conv2d, nn.MaxPool2d)


def kernel_layers(model: nn.Module, clients: list[ClientData], loss) -> list[tuple[nn.Module, tuple, bool]]:
    """Each trained Conv2d and each MaxPool2d a training step runs: (module, its input's shape, whether its input
    needs a gradient)."""
    seen: list[tuple[nn.Module, tuple, bool]] = []
    hooks = [module.register_forward_pre_hook(lambda module, inputs: seen.append(
        (module, tuple(inputs[0].shape), inputs[0].requires_grad))) for module in model.modules()
        if isinstance(module, nn.MaxPool2d) or (isinstance(module, nn.Conv2d) and module.weight.requires_grad)]
    model.train()
    batch = next(iter(clients[0].train_loader(0)))
    loss(model, {key: value for key, value in batch.items() if key != "sample_id"}).backward()
    model.zero_grad(set_to_none=True)
    for hook in hooks:
        hook.remove()
    return [(module, shape, needs_grad) for module, shape, needs_grad in seen if not isinstance(module, nn.MaxPool2d)
            or needs_grad]  # a pool on the frozen encoder's side is not part of a training step's work


def conv_runs(module: nn.Conv2d, shape: tuple, input_grad: bool, count: int):
    """A convolution's forward and backward for ``count`` clients: client after client, as the sequential engine
    runs it, and as the grouped convolution ``vmap`` makes of it (groups = count)."""
    # Each client's own leaf tensors (as in the sequential engine), and their stacks (as in the lock-step).
    inputs = [torch.randn(*shape, requires_grad=input_grad) for _ in range(count)]
    weights = [module.weight.detach().clone().requires_grad_() for _ in range(count)]
    stacked_inputs = torch.stack(inputs).detach().requires_grad_(input_grad)
    stacked_weights = torch.stack(weights).detach().requires_grad_()
    options = dict(stride=module.stride, padding=module.padding, dilation=module.dilation)

    def one_by_one() -> None:
        for client_input, weight in zip(inputs, weights):
            output = nn.functional.conv2d(client_input, weight, **options)
            torch.autograd.grad(output.sum(), [weight] + ([client_input] if input_grad else []))

    def grouped() -> None:
        folded = stacked_inputs.movedim(0, 1).reshape(shape[0], count * shape[1], *shape[2:])
        output = nn.functional.conv2d(folded, stacked_weights.reshape(-1, *stacked_weights.shape[2:]),
                                      groups=count, **options)
        torch.autograd.grad(output.sum(), [stacked_weights] + ([stacked_inputs] if input_grad else []))

    return one_by_one, grouped


def pool_runs(module: nn.MaxPool2d, shape: tuple, count: int):
    """A max-pool's forward and backward for ``count`` clients: client after client, and the clients' batches as
    one (vmap's rule folds the clients into the batch dimension)."""
    inputs = [torch.randn(*shape, requires_grad=True) for _ in range(count)]
    folded = torch.cat(inputs).detach().requires_grad_()
    options = dict(kernel_size=module.kernel_size, stride=module.stride, padding=module.padding,
                   dilation=module.dilation, ceil_mode=module.ceil_mode)

    def one_by_one() -> None:
        for client_input in inputs:
            torch.autograd.grad(nn.functional.max_pool2d(client_input, **options).sum(), [client_input])

    def together() -> None:
        torch.autograd.grad(nn.functional.max_pool2d(folded, **options).sum(), [folded])

    return one_by_one, together


def kernel_seconds(layers: list[tuple[nn.Module, tuple, bool]], count: int, repeats: int = 3) -> tuple[float, float]:
    """CPU seconds of one step's convolutions and max-pools (forward and backward) for ``count`` clients, each
    layer timed client after client and batched (:func:`conv_runs`, :func:`pool_runs`); returns (client after
    client, the faster of the two per layer, summed)."""
    sequential = best = 0.0
    for module, shape, input_grad in layers:
        runs = (pool_runs(module, shape, count) if isinstance(module, nn.MaxPool2d)
                else conv_runs(module, shape, input_grad, count))
        times = []
        for run in runs:
            run()
            began = time.process_time()
            for _ in range(repeats):
                run()
            times.append((time.process_time() - began) / repeats)
        sequential, best = sequential + times[0], best + min(times)
    return sequential, best


def ceiling(name: str, count: int, device: torch.device, item_reads: bool) -> None:
    """How far vectorising can go on CPU for this model: the sequential round's CPU time ÷ the CPU time of its
    convolutions and max-pools alone in their fastest form (a ratio no engine that runs these kernels reaches)."""
    model, clients, loss = CASES[name](count, item_reads)
    layers = kernel_layers(model, clients, loss)
    with tempfile.TemporaryDirectory() as folder:
        engine = make_engine(model, clients, loss, 0, Path(folder), device)
        engine.train_round(1)
        began = time.process_time()
        engine.train_round(2)
        round_seconds = time.process_time() - began
    pools = sum(isinstance(module, nn.MaxPool2d) for module, _, _ in layers)
    sequential, best = (seconds * STEPS for seconds in kernel_seconds(layers, count))
    print(f"{name:8s} K={count:4d}: sequential round {round_seconds:.3f} CPU s, of which its convolutions and max-pools "
          f"{sequential:.3f} s; those in their fastest form (per layer, one by one or batched) {best:.3f} s; "
          f"ceiling {round_seconds / best:.2f}x ({len(layers) - pools} conv, {pools} max-pool layers)", flush=True)


def pfl_unavailable() -> str | None:
    """Why pfl-research cannot be imported here (its ImportError), or None when it can."""
    try:
        import pfl  # noqa: F401  (bench-only, never a project dependency)
    except ImportError as error:
        return str(error)
    return None


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


def taskhet_and_pfl(count: int, chunk: int, rounds: int, device: torch.device, item_reads: bool) -> dict[str, float]:
    """Rounds per second on the tiny-MLP FedAvg workload: TaskHet's sequential and vectorised engines, and pfl's."""
    model, clients, loss = CASES["mlp"](count, item_reads)
    with tempfile.TemporaryDirectory() as folder:
        engines = {name: make_engine(model, clients, loss, chunk_size, Path(folder) / name, device)
                   for name, chunk_size in (("sequential", 0), ("vectorised", min(chunk, count)))}
        rates = {name: 1 / seconds for name, seconds in time_engines(engines, rounds, device)[0].items()}
    return {**rates, "pfl": pfl_rounds_per_second(count, rounds)}


def compare_pfl(count: int, chunk: int, rounds: int, device: torch.device, item_reads: bool) -> None:
    rates = taskhet_and_pfl(count, chunk, rounds, device, item_reads)
    pfl = rates["pfl"]
    print(f"pfl      K={count:4d} (tiny MLP, FedAvg, 5 steps): pfl {pfl:.2f} rounds/s; TaskHet sequential "
          f"{rates['sequential']:.2f} ({rates['sequential'] / pfl:.2f}x pfl), vectorised "
          f"{rates['vectorised']:.2f} ({rates['vectorised'] / pfl:.2f}x pfl)", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="8,32,128", help="sampled clients per round (default: 8,32,128)")
    parser.add_argument("--models", default=",".join(CASES), help=f"which models (default: {','.join(CASES)})")
    parser.add_argument("--chunks", default="128", help="--vectorize_chunk values, comma-separated, each timed "
                        "(default: 128, whole rounds)")
    parser.add_argument("--ceiling", action="store_true",
                        help="only the CPU ceiling of the conv models: their convolutions' and max-pools' CPU time vs "
                        "the round's")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per engine (default: 3)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default: 1, steadier timings on a shared machine)")
    parser.add_argument("--use_accelerator", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--item_reads", action="store_true",
                        help="read every batch item by item and collate it, as before datasets/batch_reads.py")
    parser.add_argument("--pfl", action="store_true",
                        help="only the side-by-side with pfl-research (needs `pfl`: see docs/BENCHMARKS.md)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = pick_device(args.use_accelerator)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {device}; "
          f"FedAvg, {STEPS} local steps, momentum 0.9; batches read {'item by item' if args.item_reads else 'whole'}",
          flush=True)
    counts = [int(value) for value in args.counts.split(",")]
    chunks = [int(value) for value in args.chunks.split(",")]
    if args.pfl:
        missing = pfl_unavailable()
        if missing:
            raise SystemExit(f"--pfl needs pfl-research ({missing}); docs/BENCHMARKS.md says how to install it "
                             "beside the project's venv")
        for count in counts:
            compare_pfl(count, chunks[-1], args.rounds, device, args.item_reads)
        return
    if args.ceiling:
        for name in args.models.split(","):
            for count in counts:
                ceiling(name, count, device, args.item_reads)
        return
    for name in args.models.split(","):
        for count in counts:
            for chunk in sorted({min(chunk, count) for chunk in chunks}):
                compare(name, count, chunk, args.rounds, device, args.item_reads)


if __name__ == "__main__":
    main()
