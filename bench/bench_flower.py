"""Benchmark: time per round of the Flower simulation engine against the sequential engine; prints ratios.

For K = 4 and 64 clients of a small CNN (32×32 inputs, batch 32, J local steps of FedAvg),
both engines run the same rounds with the same seeds, so they do the same computation
(the final weights are checked to agree). Time per round is the median gap between
consecutive end-of-round log records, over the rounds after the first (Flower's first round
includes every Ray worker loading the model and the data) and before the last (which also
evaluates). Ratio = Flower / sequential: 1.0 is no overhead, above 1 is the price of
messaging, below 1 is parallel clients paying off. Flower's fixed costs (Ray start, nodes
up, round-0 evaluation; shut-down) are printed apart: they are paid once per run.

Run: ``.venv/bin/python bench/bench_flower.py`` (``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from network.algorithms import build_algorithm  # noqa: E402
from network.client import ClientData  # noqa: E402
from network.engine_sequential import EngineConfig, SequentialEngine  # noqa: E402
from network.lr_schedule import make_lr_schedule  # noqa: E402
from network.flower.simulation import FlowerOptions, run_flower  # noqa: E402


class RoundClock(logging.Handler):
    """Records when each engine logs the end of a round ("round N: ...")."""

    def __init__(self) -> None:
        super().__init__()
        self.ends: dict[int, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        words = record.getMessage().split(":", 1)[0].split()
        if len(words) == 2 and words[0] == "round" and words[1].isdigit():
            self.ends[int(words[1])] = time.perf_counter()


def small_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1),
                         nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 8 * 8, 10))


def loss_fn(model: nn.Module, batch: dict, reduction: str = "mean") -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch["x"]), batch["y"], reduction=reduction)


def evaluate(model: nn.Module, loader) -> dict[str, float]:
    losses = [float(loss_fn(model, batch)) for batch in loader]
    return {"loss": sum(losses) / max(len(losses), 1)}


def batches(samples: list[dict], batch_size: int, seed: int) -> DataLoader:
    return DataLoader(samples, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed))


def make_clients(count: int, samples: int, batch_size: int) -> list[ClientData]:
    generator = torch.Generator().manual_seed(0)
    clients = []
    for index in range(count):
        x = torch.randn(samples, 3, 32, 32, generator=generator)
        y = torch.randint(0, 10, (samples,), generator=generator)
        # clone(): a view pickles its whole storage, once per sample, when the clients go to the Ray workers
        data = [{"x": row.clone(), "y": label.clone()} for row, label in zip(x, y)]
        clients.append(ClientData(str(index), samples, partial(batches, data, batch_size)))
    return clients


def timed_run(engine_name: str, count: int, args: argparse.Namespace, out_dir: Path) -> tuple[float, dict, dict]:
    """One run of ``n_rounds``; returns (seconds per round, final weights, fixed costs)."""
    clock, logger = RoundClock(), logging.getLogger(f"bench_flower.{engine_name}.{count}")
    logger.addHandler(clock)
    logger.setLevel(logging.INFO)
    torch.manual_seed(0)
    clients = make_clients(count, args.samples, args.batch_size)
    algorithm, model = build_algorithm("fedavg", small_cnn(), {client.client_id: client.num_samples for client in clients})
    inputs = (model, algorithm, clients, loss_fn, evaluate,
              [], EngineConfig(out_dir=out_dir, n_rounds=args.rounds, lr_schedule=make_lr_schedule("constant", 0.01, 1),
                               seed=0, local_steps=args.steps, eval_every=args.rounds, progress=False),
              torch.device("cpu"))
    began = time.perf_counter()
    if engine_name == "flower":
        weights = run_flower(*inputs, logger=logger, options=FlowerOptions(num_cpus=args.num_cpus)).global_weights
    else:
        weights = SequentialEngine(*inputs, logger=logger).run()
    ended = time.perf_counter()
    gaps = [clock.ends[r] - clock.ends[r - 1] for r in range(2, args.rounds)]
    fixed = {"start-up": clock.ends[0] - began, "first round": clock.ends[1] - clock.ends[0],
             "shut-down": ended - clock.ends[args.rounds]}
    return statistics.median(gaps), weights, fixed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="4,64", help="client counts (default: 4,64)")
    parser.add_argument("--steps", type=int, default=5, help="J local steps per client and round (default: 5)")
    parser.add_argument("--samples", type=int, default=64, help="samples per client (default: 64)")
    parser.add_argument("--batch_size", type=int, default=32, help="local batch size (default: 32)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per run; rounds 2..n-1 are timed (default: 5)")
    parser.add_argument("--num_cpus", type=float, default=1.0, help="Flower CPU cores per client (default: 1)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the sequential engine (default: 1, as each Ray worker of one core; "
                             "on a busy machine more threads than free cores slow torch down many times)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.rounds < 3:
        parser.error("--rounds must be >= 3 (the first and the last round are not timed)")
    print(f"torch {torch.__version__}, {os.cpu_count()} cores; sequential: {torch.get_num_threads()} torch threads; "
          f"Flower: Ray workers of {args.num_cpus:g} core(s) each; FedAvg, small CNN 32×32, batch {args.batch_size}, "
          f"{args.steps} local steps")
    for count in (int(value) for value in args.counts.split(",")):
        with tempfile.TemporaryDirectory() as folder:
            sequential, reference, _ = timed_run("sequential", count, args, Path(folder) / "sequential")
            flower, weights, fixed = timed_run("flower", count, args, Path(folder) / "flower")
        agree = all(torch.allclose(reference[key], weights[key], rtol=1e-4, atol=1e-6) for key in reference)
        print(f"{count:3d} clients: sequential {sequential:.3f} s/round, Flower simulation {flower:.3f} s/round; "
              f"ratio Flower/sequential = {flower / sequential:.2f} (weights agree: {agree}); Flower fixed costs: "
              + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in fixed.items()))


if __name__ == "__main__":
    main()
