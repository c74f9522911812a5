"""A compound partition at paper scale: 1,000,000 samples among 1,000 clients over 100 groups (issue 22).

Times step 3b's compound partition (label skew ``dirichlet_split`` α = 0.5, quantity skew
``lognormal:1.0``, the client-test split and temporal skew ``rotate:4:5`` scheduled up to round 40,
so every train row gets two windows) against ``dirichlet_split`` alone on the same labels, and prints
the ratios of wall and process CPU time (goal: ≤ 2). Two compound timings: the arrays step 3b draws (partition, test split, phases,
windows), and the same plus the assignments table with its schedule columns (``schedule_table``:
pandas, 1.6 M rows). One run each, as the bench rules ask; docs/BENCHMARKS.md records the numbers.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
N_SAMPLES, N_CLIENTS, N_GROUPS, ALPHA, MIN_SIZE, SEED = 1_000_000, 1_000, 100, 0.5, 10, 0
SIZE_SKEW, TEMPORAL, N_ROUNDS, TEST_FRACTION = "lognormal:1.0", "rotate:4:5", 40, 0.2


def timed(run: Callable[[], object]) -> tuple[tuple[float, float], object]:
    """``((wall seconds, CPU seconds of this process), result)``: on a shared CPU the CPU time is the steadier."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = run()
    return (time.perf_counter() - wall, time.process_time() - cpu), result


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from partitioning.assignments import assignments_table
    from partitioning.client_tests import client_test_mask
    from partitioning.partition import get_partitioner
    from partitioning.temporal import client_phases, parse_temporal, schedule_rows, schedule_table
    from utils.seeding import numpy_rng

    labels = np.random.default_rng(SEED).integers(0, N_GROUPS, N_SAMPLES)
    spec = parse_temporal(TEMPORAL)
    plain = get_partitioner("dirichlet_split", N_CLIENTS, alpha=ALPHA, min_client_size=MIN_SIZE, seed=SEED)
    skewed = get_partitioner("dirichlet_split", N_CLIENTS, alpha=ALPHA, min_client_size=MIN_SIZE, seed=SEED,
                             size_skew=SIZE_SKEW)

    def compound_arrays():
        client_of = skewed.split(labels).client_of
        is_test = client_test_mask(client_of, TEST_FRACTION, numpy_rng(SEED, "client_test"))
        train = ~is_test & (client_of >= 0)
        phase = client_phases(client_of[train], labels[train], spec.phases, numpy_rng(SEED, "temporal"))
        return schedule_rows(phase, spec, N_ROUNDS)

    def compound_table():
        client_of = skewed.split(labels).client_of
        is_test = client_test_mask(client_of, TEST_FRACTION, numpy_rng(SEED, "client_test"))
        table = assignments_table(np.arange(N_SAMPLES), labels, client_of, is_test)
        return schedule_table(table, spec, N_ROUNDS, numpy_rng(SEED, "temporal"))[0]

    compound_arrays(), plain.split(labels)  # untimed warm-up: the first large allocations fault pages in
    base, _ = timed(lambda: plain.split(labels))
    with_test, _ = timed(lambda: client_test_mask(plain.split(labels).client_of, TEST_FRACTION, numpy_rng(SEED, "client_test")))
    arrays, (source, _, _) = timed(compound_arrays)
    table_time, table = timed(compound_table)
    print(f"{N_SAMPLES:,} samples, {N_CLIENTS:,} clients, {N_GROUPS} groups; compound = dirichlet_split α={ALPHA} + "
          f"--size_skew {SIZE_SKEW} + client-test {TEST_FRACTION} + --temporal {TEMPORAL} up to round {N_ROUNDS} "
          f"({source.size:,} scheduled train rows, table {len(table):,} rows)")
    print("| what | wall (s) | ÷ dirichlet_split | CPU (s) | ÷ dirichlet_split |")
    print("|---|---|---|---|---|")
    for name, (wall, cpu) in (("dirichlet_split alone", base),
                              ("dirichlet_split + the client-test split (step 3b without skews)", with_test),
                              ("compound, arrays (goal ≤ 2)", arrays),
                              ("compound + assignments table with schedule columns", table_time)):
        print(f"| {name} | {wall:.2f} | {wall / base[0]:.2f} | {cpu:.2f} | {cpu / base[1]:.2f} |")


if __name__ == "__main__":
    main()
