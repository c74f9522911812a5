"""Benchmark of ``--diagnostics``' gradient rounds (network/diagnostics.py): what one costs over a plain round.

One FedAvg round of K sampled clients × J local steps (small CNN, 32×32, batch 32) through the
sequential engine, against the same round followed by the gradient diagnostics: every one of the
N clients' ∇F_k at the global model (a full pass over its train rows, or ``--max_samples`` of them),
folded into G² and B². Timed interleaved in one run (so background load hits both alike); prints
the ratio (round + diagnostics) / round. A full pass reads N·n samples forward and backward where
the round trains K·J·B, so the ratio should be near 1 + N·n / (K·J·B).

Run: ``.venv/bin/python bench/bench_diagnostics.py`` (``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_engine import loss_fn, make_clients, small_cnn, timed  # noqa: E402
from network.algorithms import build_algorithm  # noqa: E402
from network.engine_sequential import EngineConfig, SequentialEngine  # noqa: E402
from network.lr_schedule import make_lr_schedule  # noqa: E402
from utils.device import pick_device, prepare_model  # noqa: E402


def make_engine(clients, steps: int, fraction: float, max_samples: int | None, out_dir: Path,
                device: torch.device) -> SequentialEngine:
    config = EngineConfig(out_dir=out_dir, n_rounds=1000, lr_schedule=make_lr_schedule("constant", 0.01, 1),
                          local_steps=steps, client_fraction=fraction, progress=False, diagnostics=True,
                          diagnostics_max_samples=max_samples)
    torch.manual_seed(0)
    algorithm, worker = build_algorithm("fedavg", prepare_model(small_cnn(), device),
                                        {client.client_id: client.num_samples for client in clients})
    return SequentialEngine(worker, algorithm, clients, loss_fn, lambda net, loader: {"loss": 0.0}, [], config, device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=20, help="N, every client of the federation (default: 20)")
    parser.add_argument("--fraction", type=float, default=0.5, help="share sampled per round (default: 0.5)")
    parser.add_argument("--samples", type=int, default=256, help="train rows per client, n (default: 256)")
    parser.add_argument("--steps", type=int, default=10, help="J local steps (default: 10)")
    parser.add_argument("--max_samples", type=int, default=64, help="the sampled setting's rows (default: 64)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats; medians are printed (default: 3)")
    parser.add_argument("--use_accelerator", action=argparse.BooleanOptionalAction, default=False)
    args = parser.parse_args(argv)
    device = pick_device(args.use_accelerator)
    clients = make_clients(args.clients, args.samples, (3, 32, 32), 32)
    times: dict[str, list[float]] = {"round": [], "diagnostics (full pass)": [], f"diagnostics ({args.max_samples} rows)": []}
    with tempfile.TemporaryDirectory() as folder:
        engine = make_engine(clients, args.steps, args.fraction, None, Path(folder), device)
        full, sampled = engine.config, dataclasses.replace(engine.config, diagnostics_max_samples=args.max_samples)
        engine.train_round(1)  # warm-up (lazy imports, allocator)
        engine.diagnose(1)
        for round_index in range(2, 2 + args.repeats):
            times["round"].append(timed(lambda: (engine.train_round(round_index), synchronize(device))))
            times["diagnostics (full pass)"].append(timed(lambda: (engine.diagnose(round_index), synchronize(device))))
            engine.config = sampled
            times[f"diagnostics ({args.max_samples} rows)"].append(
                timed(lambda: (engine.diagnose(round_index), synchronize(device))))
            engine.config = full
    sampled_count = round(args.fraction * args.clients)
    base = statistics.median(times["round"])
    print(f"diagnostics: {args.clients} clients × {args.samples} rows, {sampled_count} sampled × {args.steps} steps "
          f"(small CNN, 32×32, batch 32) on {device}, {torch.get_num_threads()} threads; medians of {args.repeats}")
    print(f"diagnostics: round without diagnostics {base:.3f} s")
    for name, rows in (("diagnostics (full pass)", args.samples),
                       (f"diagnostics ({args.max_samples} rows)", min(args.max_samples, args.samples))):
        cost = statistics.median(times[name])
        expected = 1 + args.clients * rows / (sampled_count * args.steps * 32)
        print(f"diagnostics: {name}: {cost:.3f} s; ratio (round + diagnostics) / round = {(base + cost) / base:.2f} "
              f"(expected ≈ {expected:.2f} from the samples read)")


if __name__ == "__main__":
    main()
