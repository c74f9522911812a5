"""Benchmark: a frozen encoder's cached feature maps vs recomputing the encoder in every step.

The demo's model (EfficientNet-Lite0 with its ImageNet weights, frozen; the normal task's
decoder at width 32; 32 px; batch 16) takes SGD steps through ``train_one_batch`` two ways:
on images, so the frozen encoder runs forward in every step (what ``--freeze_encoder`` alone
does), and on the encoder's maps computed once (``--cache_features``). Steps alternate between
the two in blocks so that drifts in machine load hit both; the medians and the ratio
cached / images (steps per second) are printed, with the one-time cost of encoding the
samples, in steps of the cached loop it equals.
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

from datasets.encoded import ENCODED_KEY  # noqa: E402
from models import build_task_model  # noqa: E402
from training.loop import train_one_batch  # noqa: E402
from utils.cli import positive_int, run_main  # noqa: E402


def batches(count: int, batch_size: int, size: int, generator: torch.Generator) -> list[dict]:
    """Random images with unit-normal targets (the values do not change the arithmetic's cost)."""
    result = []
    for _ in range(count):
        normal = torch.nn.functional.normalize(torch.randn(batch_size, 3, size, size, generator=generator), dim=1)
        result.append({"rgb": torch.rand(batch_size, 3, size, size, generator=generator), "normal": normal,
                       "mask": torch.ones(batch_size, 1, size, size, dtype=torch.bool)})
    return result


def steps_per_second(model, data: list[dict], key: str, optimizer) -> float:
    start = time.perf_counter()
    for batch in data:
        train_one_batch(model, batch, "normal", optimizer, torch.device("cpu"), input_key=key)
    return len(data) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=positive_int, default=20, help="steps per timed block (default: 20)")
    parser.add_argument("--blocks", type=positive_int, default=5, help="timed blocks per way (default: 5)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads (default: 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build_task_model("normal", "efficientnet_lite0", "imagenet", seed=0, freeze_encoder=True, decoder_width=32)
    data = batches(args.steps, 16, 32, torch.Generator().manual_seed(0))
    start = time.perf_counter()
    with torch.no_grad():  # not inference_mode: its tensors may not enter a later backward
        encoded = [{**batch, ENCODED_KEY: model.encoder.eval()(model.normalise(batch["rgb"]))}
                   for batch in data]
    encode_seconds = (time.perf_counter() - start) / len(data)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3, momentum=0.9)
    model.train()
    steps_per_second(model, data[:3], "rgb", optimizer)  # warm-up
    steps_per_second(model, encoded[:3], ENCODED_KEY, optimizer)
    images, cached = [], []
    for _ in range(args.blocks):
        images.append(steps_per_second(model, data, "rgb", optimizer))
        cached.append(steps_per_second(model, encoded, ENCODED_KEY, optimizer))
    median_images, median_cached = statistics.median(images), statistics.median(cached)
    print(f"threads {args.threads}, batch 16, 32 px, EfficientNet-Lite0 frozen, normal decoder width 32")
    print(f"images (encoder every step): {median_images:.1f} steps/s")
    print(f"cached maps:                 {median_cached:.1f} steps/s")
    print(f"ratio cached / images: {median_cached / median_images:.2f}")
    print(f"encoding once: {encode_seconds * 1e3:.1f} ms per batch of 16, the cost of {encode_seconds * median_cached:.1f} "
          "cached steps")

if __name__ == "__main__":
    run_main(main)
