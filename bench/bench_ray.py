"""Benchmark: the experiment grid's throughput on Ray against the local worker pool, at the same parallelism.

One small digits grid (2 groupings × 2 α × 2 algorithms × 2 seeds = 16 federated runs of a small CNN) has its
steps 1-3 run once; then its step-4 runs go, from a copy of those steps each time, through
``run_pipeline.py --jobs N --threads 1`` (the local pool of N worker processes) and through
``--executor ray --jobs N --cpus_per_run 1 --threads 1`` (Ray tasks on a Ray instance started on this machine),
alternating, ``--repeats`` times each. Printed per call: the wall time of the whole call, and the grid's own span
(from the first run's start to the last run's end, read from each run's placement record), which leaves out Ray's
start-up and shut-down. Ratio = local span / Ray span (runs per second on Ray ÷ on the local pool): the goal is
>= 0.9. Every run's metrics.csv is checked to equal the local pool's, byte for byte.

Run: ``.venv/bin/python bench/bench_ray.py`` (``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import utils.tv_compat  # noqa: E402,F401  (before anything imports torchvision)
from pipeline.command import main as run_pipeline  # noqa: E402
from pipeline.pool import PLACEMENT_FILE  # noqa: E402

NAME = "benchray"


def grid(n_rounds: int) -> dict:
    return {
        "name": NAME,
        "data": {"source": "digits", "n_samples": 400, "test_fraction": 0.25},
        "tasks": ["digit_class"],
        "model": {"encoder": "small_cnn", "weights": "none", "image_size": 16},
        "centralized": {"n_epochs": 1, "batch_size": 16},
        "embeddings": {"n_clusters": 4},
        "partition": {"alphas": [0.1, 1.0], "n_clients": 4},
        "federated": {"algorithms": {"fedavg": {}, "fedprox": {"mu": 0.01}}, "n_rounds": n_rounds,
                      "local_steps": 5, "batch_size": 16, "eval_every": n_rounds, "checkpoint_every": n_rounds},
        "heterogeneity_meter": False,
        "seeds": [0, 1],
        "use_accelerator": False,
    }


def steps_1_to_3(base: Path, config: dict) -> Path:
    """Run the whole grid once (one process) and keep its steps 1-3; returns the experiment file."""
    experiment = base / "grid.yaml"
    experiment.write_text(yaml.safe_dump(config))
    run_pipeline([str(experiment), "--results", str(base / "first"), "--threads", "1", "--no-progress"])
    return experiment


def fresh_copy(base: Path, to: Path) -> Path:
    """The first run's results without its step-4 folders and reports: only the pooled stages are left to run."""
    source = base / "first" / NAME
    shutil.copytree(source, to / NAME, ignore=lambda folder, names: [
        name for name in names if Path(folder) == source and (name == "federated" or name.startswith("report"))])
    return to


def records_of(results: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in (results / NAME).rglob(PLACEMENT_FILE)]


def grid_span(results: Path) -> float:
    """Seconds from the first run's start to the last run's end (the placement records of the runs)."""
    records = records_of(results)
    return max(record["finished"] for record in records) - min(record["started"] for record in records)


def where_time_goes(results: Path, jobs: int) -> str:
    """The span split into time inside runs (mean seconds per run, from each run's own start to its end) and the
    slots' idle time between runs (span × jobs − Σ run seconds, per run): what the executor costs a run."""
    records = records_of(results)
    inside = [record["finished"] - record["started"] for record in records]
    idle = grid_span(results) * jobs - sum(inside)
    return f"{statistics.mean(inside):.2f} s inside a run, {idle / len(records):.2f} s idle slot time per run"


def metrics_files(results: Path) -> dict[str, bytes]:
    root = results / NAME
    return {str(path.relative_to(root)): path.read_bytes() for path in root.glob("federated/**/metrics.csv")}


def timed(experiment: Path, results: Path, flags: list[str]) -> tuple[float, float]:
    start = time.perf_counter()
    run_pipeline([str(experiment), "--results", str(results), "--threads", "1", "--no-progress", *flags])
    return time.perf_counter() - start, grid_span(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2, help="runs at once on both sides (default: 2, this machine's cores)")
    parser.add_argument("--rounds", type=int, default=30, help="rounds of each federated run (default: 30)")
    parser.add_argument("--repeats", type=int, default=2, help="calls of each side, alternating (default: 2)")
    args = parser.parse_args()
    sides = {"local": ["--jobs", str(args.jobs)],
             "ray": ["--executor", "ray", "--jobs", str(args.jobs), "--cpus_per_run", "1"]}
    with tempfile.TemporaryDirectory(prefix="bench_ray_") as folder:
        base = Path(folder)
        experiment = steps_1_to_3(base, grid(args.rounds))
        reference = metrics_files(base / "first")
        spans: dict[str, list[float]] = {side: [] for side in sides}
        for repeat in range(args.repeats):
            for side, flags in sides.items():
                results = fresh_copy(base, base / f"{side}{repeat}")
                wall, span = timed(experiment, results, flags)
                assert metrics_files(results) == reference, f"{side}: metrics.csv differ from the one-process run"
                spans[side].append(span)
                print(f"{side} call {repeat + 1}: {len(reference)} runs, wall {wall:.1f} s, grid span {span:.1f} s "
                      f"({where_time_goes(results, args.jobs)})", flush=True)
    local, ray = statistics.median(spans["local"]), statistics.median(spans["ray"])
    print(f"median grid span: local pool {local:.1f} s, Ray {ray:.1f} s; throughput Ray / local = {local / ray:.2f} "
          f"(goal >= 0.9); every metrics.csv equal to the one-process run's")


if __name__ == "__main__":
    main()
