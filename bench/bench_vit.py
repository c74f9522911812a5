"""Benchmark: ViT-S/16 (vit_s16_dino) training samples/s, TaskHet's step-2 path vs a plain PyTorch loop.

TaskHet's side is a ``TaskModel`` (``cifar_class``, encoder ``vit_s16_dino``, the
CLS token into a linear head) trained by ``make_loader`` + ``train_one_batch``.
The plain side is what a timm tutorial would write: timm's
``vit_small_patch16_224`` with its own 10-class head (the same architecture,
position table resampled per input), a DataLoader, explicit ``.to(device)`` and
normalisation, inline cross-entropy, ``loss.item()``. Both train from random
weights (speed does not depend on the values) on the same in-memory random
images, with the same optimizer and device settings (bf16 autocast on CUDA).

Defaults: 32 px on the CPU, 224 px on a GPU. Passes alternate (plain, ours,
ours, plain, ...) so drifts in machine load hit both; the medians and the
ratio ours / plain are printed.
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
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from models import build_task_model  # noqa: E402
from models.encoders import IMAGENET_MEAN, IMAGENET_STD  # noqa: E402
from models.vit_dino import TIMM_ARCH  # noqa: E402
from training.loop import make_loader, train_one_batch  # noqa: E402
from utils.cli import positive_int, run_main  # noqa: E402
from utils.device import autocast, pick_device, prepare_model  # noqa: E402

TASK, INPUT_KEY, NUM_CLASSES = "cifar_class", "image", 10


def random_samples(count: int, image_size: int, seed: int) -> list[dict]:
    """``count`` items shaped like the cifar family's: ``{"image": [3, S, S] in [0, 1], "cifar_class": int64}``."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.rand(count, 3, image_size, image_size, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (count,), generator=generator)
    return [{INPUT_KEY: image, TASK: label} for image, label in zip(images, labels)]


def plain_model() -> torch.nn.Module:
    """timm's ViT-S/16 with a linear head on the CLS token, any input size (as vit_s16_dino builds it)."""
    import timm

    return timm.create_model(TIMM_ARCH, pretrained=False, num_classes=NUM_CLASSES, dynamic_img_size=True,
                             dynamic_img_pad=True)


def plain_epoch(model: torch.nn.Module, samples: list[dict], batch_size: int, device: torch.device) -> int:
    """The loop a PyTorch tutorial would write; returns samples seen."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    mean = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1)
    seen = 0
    for batch in DataLoader(samples, batch_size=batch_size, shuffle=True):
        images, labels = batch[INPUT_KEY].to(device), batch[TASK].to(device)
        with autocast(device):
            logits = model((images - mean) / std)
        loss = F.cross_entropy(logits.float(), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss.item()
        seen += images.shape[0]
    return seen


def taskhet_epoch(model: torch.nn.Module, samples: list[dict], batch_size: int, device: torch.device) -> int:
    """One epoch through TaskHet's loader and train_one_batch; returns samples seen."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    seen = 0
    for batch in make_loader(samples, batch_size, shuffle=True, seed=0):
        train_one_batch(model, batch, TASK, optimizer, device, input_key=INPUT_KEY)
        seen += batch[INPUT_KEY].shape[0]
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


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image_size", type=positive_int, default=None, help="default: 224 on CUDA, else 32")
    parser.add_argument("--batch_size", type=positive_int, default=None, help="default: 128 on CUDA, else 16")
    parser.add_argument("--num_samples", type=positive_int, default=None, help="per pass; default: 4 batches")
    parser.add_argument("--rounds", type=positive_int, default=6, help="timed passes of each loop")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch CPU threads (default: torch's; 1 is steadier on a shared machine)")
    parser.add_argument("--use_accelerator", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args(argv)
    device = pick_device(args.use_accelerator)
    if args.threads:
        torch.set_num_threads(args.threads)
    on_gpu = device.type == "cuda"
    image_size = args.image_size or (224 if on_gpu else 32)
    batch_size = args.batch_size or (128 if on_gpu else 16)
    samples = random_samples(args.num_samples or 4 * batch_size, image_size, seed=0)
    ours = prepare_model(build_task_model(TASK, "vit_s16_dino", "none", num_classes=NUM_CLASSES, seed=0), device)
    with torch.random.fork_rng(devices=[]):  # initialise without disturbing the global RNG
        torch.manual_seed(0)
        plain = prepare_model(plain_model(), device)
    loops = {
        "plain": lambda: plain_epoch(plain.train(), samples, batch_size, device),
        "taskhet": lambda: taskhet_epoch(ours.train(), samples, batch_size, device),
    }
    for run in loops.values():  # warm-up: allocator, kernels, oneDNN/cuDNN choices
        timed(run, device)
    rates: dict[str, list[float]] = {name: [] for name in loops}
    for round_index in range(args.rounds):
        order = list(loops) if round_index % 2 == 0 else list(reversed(loops))
        for name in order:
            rates[name].append(timed(loops[name], device))
    plain_rate, our_rate = statistics.median(rates["plain"]), statistics.median(rates["taskhet"])
    ratio = our_rate / plain_rate
    precision = "bf16 autocast" if on_gpu else "float32"
    print(f"ViT-S/16 training, {TASK} / vit_s16_dino, {len(samples)} samples at {image_size}px, batch {batch_size}, "
          f"device {device} ({precision}, {torch.get_num_threads()} torch threads), median of {args.rounds} passes")
    print(f"  plain PyTorch loop (timm model + head): {plain_rate:8.1f} samples/s")
    print(f"  TaskHet loop (TaskModel):               {our_rate:8.1f} samples/s")
    print(f"  ratio TaskHet/plain: {ratio:7.3f}")
    return ratio


if __name__ == "__main__":
    run_main(main)
