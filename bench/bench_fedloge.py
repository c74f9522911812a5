"""Benchmark: one FedLoGe local step against one FedAvg local step on the same model (issue 20).

Both run ``client_update`` of the registered algorithm with the same model architecture, data and
local budget (J steps of SGD with momentum), so the only difference is FedLoGe's step: the SSE-C loss
through the backbone plus two extra heads (g_aux, the local head) on the *detached* features from the
same backbone pass. Rounds alternate (fedavg, fedloge, fedloge, fedavg, ...) so drifts in machine load
hit both; the median seconds per local step of each is reported with the ratio fedloge / fedavg
(goal: <= 1.15).
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

from models import build_task_model, get_task  # noqa: E402
from network.algorithms import build_algorithm  # noqa: E402
from network.algorithms.base import ClientConfig  # noqa: E402
from utils.cli import positive_int, run_main  # noqa: E402
from utils.device import pick_device, prepare_model  # noqa: E402

TASK = "cifar_class"


def batches(count: int, batch_size: int, image_size: int, classes: int) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    domain = get_task(TASK).domain
    return [{"image": torch.rand(batch_size, 3, image_size, image_size, generator=generator),
             domain: torch.randint(0, classes, (batch_size,), generator=generator)} for _ in range(count)]


def setup(method: str, args: argparse.Namespace, device: torch.device):
    model = build_task_model(TASK, args.encoder, "none", num_classes=args.classes, seed=0)
    algorithm, worker = build_algorithm(method, model, {"0": 1000}, {"etf_steps": 10} if method == "fedloge" else {})
    worker = prepare_model(worker, device)
    server = algorithm.init_server({key: value.detach().clone() for key, value in worker.state_dict().items()})
    task = get_task(TASK)

    def loss_fn(net, batch, reduction="mean"):
        return task.loss(net(batch["image"])[0].float(), batch, reduction)

    cfg = ClientConfig(lr=0.01, loss_fn=loss_fn, device=device, num_samples=1000, local_steps=args.steps, momentum=0.9)
    return algorithm, worker, algorithm.broadcast(server), cfg


def timed_round(algorithm, worker, broadcast, cfg, data, device) -> float:
    """Seconds per local step of one client_update (a fresh first round each time)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    algorithm.client_update(worker, broadcast, {}, data, cfg)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / cfg.local_steps


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--encoder", default="resnet18", help="encoder of the shared model (default: resnet18)")
    parser.add_argument("--classes", type=positive_int, default=100, help="classes (default: 100, CIFAR-100)")
    parser.add_argument("--image_size", type=positive_int, default=32)
    parser.add_argument("--batch_size", type=positive_int, default=32)
    parser.add_argument("--steps", type=positive_int, default=5, help="local steps per timed round")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed rounds per method")
    parser.add_argument("--use_accelerator", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args(argv)
    device = pick_device(args.use_accelerator)
    data = batches(args.steps, args.batch_size, args.image_size, args.classes)
    runs = {method: setup(method, args, device) for method in ("fedavg", "fedloge")}
    for method in runs:  # warm-up: allocator, kernels
        timed_round(*runs[method], data, device)
    times: dict[str, list[float]] = {method: [] for method in runs}
    for repeat in range(args.repeats):
        order = ("fedavg", "fedloge") if repeat % 2 == 0 else ("fedloge", "fedavg")
        for method in order:
            times[method].append(timed_round(*runs[method], data, device))
    medians = {method: statistics.median(values) for method, values in times.items()}
    ratio = medians["fedloge"] / medians["fedavg"]
    print(f"device {device}, {args.encoder}, {args.classes} classes, batch {args.batch_size} at {args.image_size} px")
    for method, median in medians.items():
        print(f"{method:8s} {median * 1000:8.1f} ms per local step (median of {args.repeats})")
    print(f"fedloge / fedavg: {ratio:.3f} (goal <= 1.15)")
    return ratio


if __name__ == "__main__":
    run_main(main)
