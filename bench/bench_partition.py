"""Partitioning at paper scale: 1,000,000 samples among 1,000 clients over 100 groups.

Times TaskHet's ``dirichlet_split`` against Flower Datasets' ``DirichletPartitioner``
on the same labels and settings (alpha 0.5, min partition size 10, shuffled, no
self-balancing), plus TaskHet's other schemes, and prints a Markdown table for
docs/BENCHMARKS.md. Then TaskHet's own Flower Datasets partitioners
(``partitioning/flwr_partitioners.py``) against step 3b's split of the same groups
(``dirichlet_mixture``, the same rows by construction), over labels and over cluster ids:
the adapter's cost is reading the column from the ``datasets.Dataset`` and selecting a
partition; the goal is at most 1.2× step 3b's split. ``--adapter_only`` runs that part alone.
``flwr-datasets`` is installed by ``make setup`` and ``make bench`` (requirements-flwr-datasets.txt).
"""

from __future__ import annotations

import argparse
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
        raise SystemExit(f"bench_partition.py needs flwr-datasets ({error}); run `make setup`") from error
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


def interleaved(runs: dict[str, Callable[[], object]], repeats: int = REPEATS) -> dict[str, tuple[float, float]]:
    """Median wall and process CPU time of each run over ``repeats`` rounds that take the runs in turn, so that a
    change in the machine's load (other jobs share its cores) falls on every run alike; the CPU time is what the
    run itself costs, whatever the load."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            wall, cpu = time.perf_counter(), time.process_time()
            run()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {name: (statistics.median(t[0] for t in values), statistics.median(t[1] for t in values))
            for name, values in times.items()}


def bench_adapter(hf_datasets, labels: np.ndarray) -> None:
    """TaskHet's flwr_datasets partitioners vs step 3b's split of the same groups (labels, then cluster ids)."""
    from partitioning.flwr_partitioners import TaskHetEmbeddingPartitioner, TaskHetLabelPartitioner
    from partitioning.partition import get_partitioner

    clusters = np.random.default_rng(SEED + 1).integers(0, N_GROUPS, N_SAMPLES)  # a step-3 clusters column
    table = hf_datasets.Dataset.from_dict({"label": labels, "cluster": clusters, "row": np.arange(N_SAMPLES)})
    step3b = get_partitioner("dirichlet_mixture", N_CLIENTS, alpha=ALPHA, min_client_size=MIN_SIZE, seed=SEED)

    def adapter(build: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            partitioner = build()
            partitioner.dataset = table
            return partitioner.load_partition(0)  # the first load draws every partition
        return run

    runs = {
        "step 3b split, labels": lambda: step3b.split(labels).client_indices(),
        "TaskHetLabelPartitioner": adapter(lambda: TaskHetLabelPartitioner(N_CLIENTS, "label", alpha=ALPHA, seed=SEED,
                                                                          min_partition_size=MIN_SIZE)),
        "step 3b split, clusters": lambda: step3b.split(clusters).client_indices(),
        "TaskHetEmbeddingPartitioner": adapter(lambda: TaskHetEmbeddingPartitioner(
            N_CLIENTS, "cluster", alpha=ALPHA, seed=SEED, min_partition_size=MIN_SIZE)),
    }
    check = TaskHetLabelPartitioner(N_CLIENTS, "label", alpha=ALPHA, seed=SEED, min_partition_size=MIN_SIZE)
    check.dataset = table
    same = all(np.array_equal(a, b) for a, b in zip(check.partition_indices(), step3b.split(labels).client_indices()))
    times = interleaved(runs)
    print(f"\n{N_SAMPLES:,} samples, {N_CLIENTS:,} clients, {N_GROUPS} groups, dirichlet_mixture alpha {ALPHA}, min size "
          f"{MIN_SIZE}; median of {REPEATS} interleaved runs; adapter partitions equal step 3b's: {same}")
    print("| groups | step 3b split: wall, CPU (s) | flwr_datasets adapter: wall, CPU (s) | adapter ÷ step 3b: wall, CPU "
          "(goal ≤ 1.2) |")
    print("|---|---|---|---|")
    for groups, ours, theirs in (("labels", "step 3b split, labels", "TaskHetLabelPartitioner"),
                                 ("cluster ids", "step 3b split, clusters", "TaskHetEmbeddingPartitioner")):
        (ours_wall, ours_cpu), (theirs_wall, theirs_cpu) = times[ours], times[theirs]
        print(f"| {groups} (`{theirs}`) | {ours_wall:.3f}, {ours_cpu:.3f} | {theirs_wall:.3f}, {theirs_cpu:.3f} | "
              f"**{theirs_wall / ours_wall:.2f}**, **{theirs_cpu / ours_cpu:.2f}** |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter_only", action="store_true", help="time only TaskHet's flwr_datasets partitioners")
    args = parser.parse_args()
    hf_datasets, FlowerDirichlet = import_flower()
    sys.path.insert(0, str(ROOT))
    labels = np.random.default_rng(SEED).integers(0, N_GROUPS, N_SAMPLES)
    if args.adapter_only:
        bench_adapter(hf_datasets, labels)
        return
    from partitioning.partition import get_partitioner, list_schemes, scheme_parameters
    from partitioning.partition_stats import client_stats

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
    bench_adapter(hf_datasets, labels)


if __name__ == "__main__":
    main()
