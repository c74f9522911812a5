"""Benchmark: what per-client skews (partitioning/skews.py) add to a local step of the small CNN.

One local step = one batch from a client's loader (``make_loader``) + ``train_one_batch`` of the
small CNN on digits (32 px, batch 32: the digits experiments' settings). A client of
``--client_size`` samples (digits' train split over 10 clients) runs ``--fl_rounds`` rounds of
``--local_steps`` steps, with no skew and with every skew a partition can give one client at once:
all six image shifts (brightness, contrast, saturation, hue, blur, rotation), per-sample seeded
noise and two swapped class pairs. A sample's transformed image is computed once and kept
(``ClientSkew.memo``), so the first epoch pays the transforms and later steps only the lookup;
the bench reports the whole run's ratio (the goal, <= 1.10) and the first epoch's alone. Each pass
starts from an empty memo; passes alternate (plain, skewed, skewed, plain, ...) so machine-load
drifts hit both; medians are reported, in CPU time (the goal: the process's own work on one thread)
and in wall time (which also holds other jobs' waits on a shared CPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

# `make bench` runs this file as a script, so the repository root is not on sys.path by itself.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from datasets.digits import DigitsDataset, select_digits  # noqa: E402
from models import build_task_model, get_task  # noqa: E402
from partitioning.skew_record import client_skews  # noqa: E402
from partitioning.skews import BatchKeys  # noqa: E402
from training.loop import make_loader, train_one_batch  # noqa: E402
from utils.cli import positive_int, run_main  # noqa: E402

RECORD = {
    "feature_shift": {1: {"brightness": 1.2, "contrast": 0.8, "saturation": 1.1, "hue": 0.05, "blur": 1.0, "rotation": 12.0}},
    "feature_noise": {1: {"sigma": 0.2, "seed": 123}},
    "label_swap": {1: {"pairs": [[1, 7], [3, 8]]}},
}


def steps(model: torch.nn.Module, dataset, batch_size: int, collate, count: int) -> tuple[float, float]:
    """(wall, CPU) seconds per local step over ``count`` steps (data loading included), epoch after epoch.

    On one thread the process's CPU time is the step's own work; wall time also holds the waits
    that other jobs on a shared CPU cause, which are not the skews' cost.
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    done, wall, cpu = 0, time.perf_counter(), time.process_time()
    while done < count:
        for batch in make_loader(dataset, batch_size, True, done, collate_fn=collate):
            train_one_batch(model, batch, "digit_class", optimizer, torch.device("cpu"), input_key="image")
            done += 1
            if done == count:
                break
    return (time.perf_counter() - wall) / count, (time.process_time() - cpu) / count


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image_size", type=positive_int, default=32)
    parser.add_argument("--batch_size", type=positive_int, default=32)
    parser.add_argument("--client_size", type=positive_int, default=144, help="the client's train samples")
    parser.add_argument("--local_steps", type=positive_int, default=50, help="local steps per round")
    # 4 x 50 = 200 local steps per client: the digits studies give a client 160-240 (experiments/digits_*.yaml)
    parser.add_argument("--fl_rounds", type=positive_int, default=4, help="rounds the client trains in one pass")
    parser.add_argument("--passes", type=positive_int, default=8, help="timed passes of each variant")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one client's local step on a shared CPU
    rows = select_digits(0.2, seed=0).query("split == 'train'").head(args.client_size).reset_index(drop=True)
    dataset = DigitsDataset(rows, args.image_size)
    task = get_task("digit_class")
    keys = BatchKeys("image", task.name, task.domain, task.kind, "label", 10)
    model = build_task_model("digit_class", "small_cnn", "none", num_classes=10, seed=0).train()
    steps(model, dataset, args.batch_size, None, 5)  # warm-up: allocator, oneDNN choices
    epoch = -(-args.client_size // args.batch_size)
    total = args.local_steps * args.fl_rounds
    times: dict[tuple[str, str, int], list[float]] = {}  # (variant, clock, 0 run / 1 first epoch / 2 later) -> passes
    for index in range(args.passes):
        for name in (("plain", "skewed") if index % 2 == 0 else ("skewed", "plain")):
            collate = client_skews(RECORD, keys)[1] if name == "skewed" else None  # an empty memo each pass
            first = steps(model, dataset, args.batch_size, collate, epoch)
            rest = steps(model, dataset, args.batch_size, collate, total - epoch)
            for clock in (0, 1):
                times.setdefault((name, "wall cpu".split()[clock], 1), []).append(first[clock])
                times.setdefault((name, "wall cpu".split()[clock], 2), []).append(rest[clock])
                run = (first[clock] * epoch + rest[clock] * (total - epoch)) / total
                times.setdefault((name, "wall cpu".split()[clock], 0), []).append(run)
    median = {key: statistics.median(values) for key, values in times.items()}
    print(f"local step, digit_class / small_cnn, {args.image_size}px, batch {args.batch_size}, 1 thread; a client of "
          f"{args.client_size} samples, {args.fl_rounds} rounds x {args.local_steps} steps; median of {args.passes} passes")
    for clock in ("cpu", "wall"):
        plain, skewed = median[("plain", clock, 0)], median[("skewed", clock, 0)]
        cold = median[("skewed", clock, 1)] / median[("plain", clock, 1)]
        warm = median[("skewed", clock, 2)] / median[("plain", clock, 2)]
        print(f"  {clock:4s} time: no skew {plain * 1e3:6.2f} ms/step, shift + noise + label swap {skewed * 1e3:6.2f} ms/step: "
              f"ratio over the run {skewed / plain:.3f} (goal <= 1.10); first epoch {cold:.3f}, later steps {warm:.3f}")
    return median[("skewed", "cpu", 0)] / median[("plain", "cpu", 0)]


if __name__ == "__main__":
    run_main(main)
