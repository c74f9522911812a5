"""Benchmark: starting run_pipeline.py's worker pool (``--jobs N``), forked from a fork server vs spawned.

Times a pool of N workers from its creation until every worker has answered one task that needs
``pipeline.pool`` (what a step-3c or step-4 stage imports first) and takes one optimizer step (a stage's first step
imports ``torch._dynamo``, which the fork server imports once for its workers), three ways, in one run:

- spawned workers (how the pool started them before): each imports torch, pandas and the steps itself;
- the pool of ``pipeline.pool.worker_pool`` the first time in a process: the fork server starts and imports
  ``pipeline.pool`` once, then forks the N workers;
- the same again, the server already running (a study's later grids, a second pool of the same process).

Prints each time, the machine's CPU seconds over it (``/proc/stat``: every process, the server's and the
workers' included; other load too) and the ratios spawned / forked.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

# `make bench` runs this file as a script, so the repository root is not on sys.path by itself.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import machine_cpu_seconds, used_between  # noqa: E402
from pipeline.pool import placement, worker_pool  # noqa: E402
from utils.cli import positive_int, run_main  # noqa: E402


def first_step() -> dict:
    """What a stage does first in a worker: one SGD step on a tiny model; then where it ran."""
    import torch

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return placement()


def time_pool(make_pool, jobs: int) -> tuple[float, float | None]:
    """(seconds, machine CPU seconds) from the pool's creation until each of ``jobs`` tasks has answered."""
    cpu, start = machine_cpu_seconds(), time.perf_counter()
    with make_pool() as pool:
        for answer in [pool.submit(first_step) for _ in range(jobs)]:
            answer.result()
    seconds, used = time.perf_counter() - start, used_between(cpu, machine_cpu_seconds())
    return seconds, (None if used is None else used.busy)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--jobs", type=positive_int, default=2, help="workers per pool (run_pipeline.py --jobs)")
    args = parser.parse_args(argv)
    spawn = multiprocessing.get_context("spawn")
    cases = {
        "spawned": lambda: ProcessPoolExecutor(args.jobs, mp_context=spawn),
        "fork server, first pool": lambda: worker_pool(args.jobs, 1),
        "fork server, later pool": lambda: worker_pool(args.jobs, 1),
    }
    results = {name: time_pool(make_pool, args.jobs) for name, make_pool in cases.items()}
    print(f"a pool of {args.jobs} workers, until each has answered a task that needs pipeline.pool and takes an "
          "optimizer step:")
    for name, (seconds, cpu) in results.items():
        shown_cpu = f", {cpu:.1f} s of machine CPU" if cpu is not None else ""
        print(f"  {name:25s} {seconds:6.2f} s{shown_cpu}")
    spawned = results["spawned"][0]
    print(f"ratio spawned / fork server: first pool {spawned / results['fork server, first pool'][0]:.1f}x, "
          f"later pool {spawned / results['fork server, later pool'][0]:.1f}x")


if __name__ == "__main__":
    run_main(main)
