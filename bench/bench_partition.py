"""Partitioning at paper scale: 1,000,000 samples among 1,000 clients over 100 groups.

Times TaskHet's ``dirichlet_split`` against Flower Datasets' ``DirichletPartitioner``
on the same labels and settings (alpha 0.5, min partition size 10, shuffled, no
self-balancing), plus TaskHet's other schemes, and prints a Markdown table for
docs/BENCHMARKS.md. ``flwr-datasets`` is a bench-only dependency (bench/requirements.txt,
installed by ``make bench``).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
N_SAMPLES, N_CLIENTS, N_GROUPS, ALPHA, MIN_SIZE, SEED, REPEATS = 1_000_000, 1_000, 100, 0.5, 10, 0, 3


def import_flower():
    """Import flwr_datasets and Hugging Face ``datasets`` with the repository root off sys.path:
    the repository's own ``datasets/`` package would otherwise shadow Hugging Face's."""
    if "datasets" in sys.modules and Path(getattr(sys.modules["datasets"], "__file__", "") or "").resolve().is_relative_to(ROOT):
        raise SystemExit("bench_partition.py: the repository's datasets package is already imported; run it as a script")
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
    try:
        import datasets as hf_datasets
        from flwr_datasets.partitioner import DirichletPartitioner
    except ImportError as error:
        raise SystemExit(f"bench_partition.py needs flwr-datasets ({error}); run `make bench`") from error
    finally:
        sys.path[:] = saved
    return hf_datasets, DirichletPartitioner


def timed(run: Callable[[], object], repeats: int = REPEATS) -> tuple[float, object]:
    """Median wall time of ``repeats`` runs, and the last result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    hf_datasets, FlowerDirichlet = import_flower()
    sys.path.insert(0, str(ROOT))
    from partitioning.partition import get_partitioner, list_schemes, scheme_parameters
    from partitioning.partition_stats import client_stats

    labels = np.random.default_rng(SEED).integers(0, N_GROUPS, N_SAMPLES)
    table = hf_datasets.Dataset.from_dict({"label": labels, "row": np.arange(N_SAMPLES)})

    def ours(scheme: str) -> Callable[[], list[np.ndarray]]:
        params = {"alpha": ALPHA, "groups_per_client": 10, "min_client_size": MIN_SIZE, "seed": SEED}
        accepted = scheme_parameters(scheme)
        partitioner = get_partitioner(scheme, N_CLIENTS, **{k: v for k, v in params.items() if k in accepted})
        return lambda: partitioner.split(labels).client_indices()

    def flower():
        partitioner = FlowerDirichlet(num_partitions=N_CLIENTS, partition_by="label", alpha=ALPHA, min_partition_size=MIN_SIZE,
                                      self_balancing=False, shuffle=True, seed=SEED)
        partitioner.dataset = table
        partitioner.load_partition(0)  # the first load computes every partition's indices
        return partitioner

    def describe(indices: list[np.ndarray]) -> str:
        client_of = np.full(N_SAMPLES, -1)
        for client, rows in enumerate(indices):
            client_of[rows] = client
        stats = client_stats(client_of, labels, N_CLIENTS)
        return f"sizes {stats['size'].min()}–{stats['size'].max()}, mean JS {stats['js_divergence'].mean():.3f}"

    ours_time, ours_result = timed(ours("dirichlet_split"))
    flower_time, flower_partitioner = timed(flower)
    flower_result = [np.asarray(flower_partitioner.load_partition(k)["row"]) for k in range(N_CLIENTS)]
    print(f"{N_SAMPLES:,} samples, {N_CLIENTS:,} clients, {N_GROUPS} groups, alpha {ALPHA}, min size {MIN_SIZE}; median of {REPEATS} runs")
    print("| partitioner | time (s) | vs Flower | partition |")
    print("|---|---|---|---|")
    print(f"| flwr_datasets DirichletPartitioner | {flower_time:.3f} | 1.0× | {describe(flower_result)} |")
    print(f"| TaskHet dirichlet_split | {ours_time:.3f} | {flower_time / ours_time:.1f}× faster | {describe(ours_result)} |")
    for scheme in list_schemes():
        if scheme in ("dirichlet_split", "natural"):
            continue
        scheme_time, result = timed(ours(scheme))
        print(f"| TaskHet {scheme} | {scheme_time:.3f} | — | {describe(result)} |")


if __name__ == "__main__":
    main()
