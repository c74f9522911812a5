"""Benchmark: samples/s of TaskHet's training loop vs a minimal plain PyTorch loop.

Both loops train the same model (one instance, a fresh optimizer per pass) on
the same batches of rendered synthetic data, held decoded in memory so that
only the loops differ: TaskHet's ``make_loader`` + ``train_one_batch`` (batch
dict moved by ``to_device``, task loss via the TaskSpec, float loss returned)
against a hand-written loop (DataLoader, explicit ``.to(device)``, inline
masked L1, ``loss.item()``). Both use the same device settings (bf16 autocast
and channels_last on CUDA). Passes alternate (plain, ours, ours, plain, ...) so
drifts in machine load hit both; the median of each is reported with the ratio
ours / plain (goal: >= 0.9).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

# `make bench` runs this file as a script, so the repository root is not on sys.path by itself.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from datasets.selection import SelectionConfig, select_datapoints  # noqa: E402
from datasets.synthetic import RenderConfig, render_dataset  # noqa: E402
from datasets.taskonomy import TaskonomyDataset  # noqa: E402
from models import build_task_model, get_task  # noqa: E402
from training.loop import make_loader, train_one_batch  # noqa: E402
from utils.cli import positive_int, run_main  # noqa: E402
from utils.device import autocast, pick_device, prepare_model  # noqa: E402


def plain_epoch(model: torch.nn.Module, samples: list[dict], domain: str, batch_size: int, device: torch.device) -> int:
    """The loop a PyTorch tutorial would write for a masked-L1 dense task; returns samples seen."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    loader = DataLoader(samples, batch_size=batch_size, shuffle=True)
    seen = 0
    for batch in loader:
        rgb, target, mask = batch["rgb"].to(device), batch[domain].to(device), batch["mask"].to(device)
        with autocast(device):
            prediction, _ = model(rgb)
        loss = (prediction.float() - target).abs()[mask.expand_as(target)].mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss.item()
        seen += rgb.shape[0]
    return seen


def taskhet_epoch(model: torch.nn.Module, samples: list[dict], task_name: str, batch_size: int, device: torch.device) -> int:
    """One epoch through TaskHet's loader and train_one_batch; returns samples seen."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    seen = 0
    for batch in make_loader(samples, batch_size, shuffle=True, seed=0):
        train_one_batch(model, batch, task_name, optimizer, device, input_key="rgb")
        seen += batch["rgb"].shape[0]
    return seen


def timed(run, device: torch.device) -> float:
    """Samples per second of one call of ``run``."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    seen = run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return seen / (time.perf_counter() - start)


def rendered_samples(task_name: str, image_size: int, num_buildings: int, views_per_building: int,
                     render_size: int | None = None) -> list[dict]:
    """Every sample of freshly rendered synthetic buildings (the Taskonomy layout) with the task's domains, decoded at
    ``image_size`` and held in memory, so that a timing measures the training loop and not PNG decoding.

    Args:
        render_size: the side the buildings are rendered at (default: ``image_size``); a smaller one renders faster
            and the dataset resizes its PNGs to ``image_size``.
    """
    task = get_task(task_name)
    with tempfile.TemporaryDirectory() as temp:
        config = RenderConfig(num_buildings, views_per_building, 4, render_size or image_size, 0)
        root = render_dataset(Path(temp) / "data", config, progress=False)
        manifest = select_datapoints(SelectionConfig(data_path=root, domains=(task.domain,)), progress=False).manifest
        dataset = TaskonomyDataset(root, manifest, task.required_domains, image_size)
        return [dataset[index] for index in range(len(dataset))]


def compare_loops(model: torch.nn.Module, samples: list[dict], task_name: str, batch_size: int, device: torch.device,
                  rounds: int) -> dict[str, float]:
    """Median samples/s of the plain loop and TaskHet's over ``rounds`` timed passes each (one warm-up pass each
    first: allocator, kernels, oneDNN/cuDNN choices), passes alternating so load drifts hit both."""
    domain = get_task(task_name).domain
    loops = {
        "plain": lambda: plain_epoch(model, samples, domain, batch_size, device),
        "taskhet": lambda: taskhet_epoch(model, samples, task_name, batch_size, device),
    }
    for run in loops.values():
        timed(run, device)
    rates: dict[str, list[float]] = {name: [] for name in loops}
    for round_index in range(rounds):
        order = list(loops) if round_index % 2 == 0 else list(reversed(loops))
        for name in order:
            rates[name].append(timed(loops[name], device))
    return {name: statistics.median(values) for name, values in rates.items()}


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="depth_euclidean", help="a dense task with a masked L1 loss")
    parser.add_argument("--encoder", default="small_cnn")
    parser.add_argument("--image_size", type=positive_int, default=64)
    parser.add_argument("--batch_size", type=positive_int, default=16)
    parser.add_argument("--num_buildings", type=positive_int, default=4)
    parser.add_argument("--views_per_building", type=positive_int, default=32)
    parser.add_argument("--rounds", type=positive_int, default=4, help="timed passes of each loop")
    parser.add_argument("--use_accelerator", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args(argv)
    task = get_task(args.task)
    device = pick_device(args.use_accelerator)
    samples = rendered_samples(task.name, args.image_size, args.num_buildings, args.views_per_building)
    model = prepare_model(build_task_model(args.task, args.encoder, "none", seed=0), device).train()
    medians = compare_loops(model, samples, task.name, args.batch_size, device, args.rounds)
    plain, ours = medians["plain"], medians["taskhet"]
    ratio = ours / plain
    print(f"training loop, {args.task} / {args.encoder}, {len(samples)} samples at {args.image_size}px, "
          f"batch {args.batch_size}, device {device}, median of {args.rounds} passes")
    print(f"  plain PyTorch loop: {plain:8.1f} samples/s")
    print(f"  TaskHet loop:       {ours:8.1f} samples/s")
    print(f"  ratio TaskHet/plain: {ratio:7.3f}")
    return ratio

if __name__ == "__main__":
    run_main(main)
