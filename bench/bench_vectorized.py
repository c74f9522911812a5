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

Run: ``.venv/bin/python bench/bench_vectorized.py`` (``--help`` for sizes). The workloads and their timing are
bench/vectorized_cases.py, ``--ceiling`` bench/vectorized_ceiling.py, ``--pfl`` bench/vectorized_pfl.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.vectorized_cases import CASES, STEPS, measure  # noqa: E402
from bench.vectorized_ceiling import ceiling  # noqa: E402
from bench.vectorized_pfl import pfl_unavailable, taskhet_and_pfl  # noqa: E402
from utils.device import pick_device  # noqa: E402


def compare(name: str, count: int, chunk: int, rounds: int, device: torch.device, item_reads: bool) -> None:
    timing = measure(name, count, chunk, rounds, device, item_reads)
    sequential, vectorized = timing.sequential, timing.vectorised
    print(f"{name:8s} K={count:4d} chunk={min(chunk, count):4d}: sequential {sequential:.3f} s/round, "
          f"vectorised {vectorized:.3f} s/round; ratio {sequential / vectorized:.2f}x; {timing.memory}", flush=True)


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
