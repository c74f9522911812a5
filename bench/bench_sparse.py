"""Benchmark: Fisher scoring (torch.func vs a per-example loop) and SparseSGDM vs torch.optim.SGD.

Model: a small ViT built by timm (``vit_tiny_patch16_224`` geometry at 32×32 input,
patch 4, 100 classes; random weights, nothing downloaded), on random images.

1. Fisher scores (``sparse.fisher.fisher_diagonal``, one sampled label per example)
   against the obvious loop: for each example, a forward, ``autograd.grad`` of its
   sampled log-probability, squared and summed. Samples/s of each and the ratio.
2. One optimizer step with momentum 0.9 and weight decay 0.1 on fixed gradients:
   SparseSGDM (density 0.1 masks) vs torch.optim.SGD, for the default (per-tensor)
   and the foreach path; steps/s and the ratio SparseSGDM / SGD (goal: >= 0.9), from the
   median and from the best single step (the best is the uncontended cost on a shared machine).
Passes alternate between the two sides.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import timm  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from sparse.fisher import fisher_diagonal  # noqa: E402
from sparse.optim import SparseSGDM  # noqa: E402


def make_model() -> torch.nn.Module:
    # The explicit attention, not SDPA: vmap has no batching rule for CPU flash attention (a slow fallback).
    timm.layers.set_fused_attn(False)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4, num_classes=100)


def loop_fisher(model: torch.nn.Module, x: torch.Tensor, generator: torch.Generator) -> dict:
    """The per-example Python loop the torch.func path replaces."""
    model.eval()
    params = dict(model.named_parameters())
    scores = {name: torch.zeros_like(param) for name, param in params.items()}
    for example in x:
        logits = model(example.unsqueeze(0))[0]
        label = torch.multinomial(F.softmax(logits.detach(), -1), 1, generator=generator)
        grads = torch.autograd.grad(F.log_softmax(logits, -1)[label].sum(), list(params.values()))
        for name, grad in zip(params, grads):
            scores[name] += grad ** 2
    return scores


def timed(function, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return times


def bench_fisher(batch: int, passes: int) -> None:
    model = make_model()
    x = torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    ours, loop = [], []
    for _ in range(passes):
        ours += timed(lambda: fisher_diagonal(model, [{"x": x}], generator=torch.Generator().manual_seed(0)), 1)
        loop += timed(lambda: loop_fisher(model, x, torch.Generator().manual_seed(0)), 1)
    fast, slow = batch / statistics.median(ours), batch / statistics.median(loop)
    print(f"fisher: torch.func {fast:.1f} samples/s, per-example loop {slow:.1f} samples/s, ratio {fast / slow:.2f}")


def bench_step(steps: int, passes: int, foreach: bool | None) -> None:
    def build(sparse: bool):
        model = make_model()
        generator = torch.Generator().manual_seed(1)
        for param in model.parameters():
            param.grad = torch.randn(param.shape, generator=generator) * 1e-3
        options = dict(lr=1e-3, momentum=0.9, weight_decay=0.1, foreach=foreach)
        if not sparse:
            return torch.optim.SGD(model.parameters(), **options)
        masks = [torch.rand(param.shape, generator=generator) < 0.1 for param in model.parameters()]
        return SparseSGDM(model.parameters(), masks, **options)

    dense, sparse = build(False), build(True)
    dense.step(), sparse.step()  # the first step creates the momentum buffers
    dense_times, sparse_times = [], []
    for _ in range(passes):
        dense_times += timed(dense.step, steps)
        sparse_times += timed(sparse.step, steps)
    path = {None: "default", True: "foreach"}[foreach]
    for name, pick in (("median", statistics.median), ("best", min)):
        dense_rate, sparse_rate = 1 / pick(dense_times), 1 / pick(sparse_times)
        print(f"step ({path}, {name} of {len(dense_times)}): SGD {dense_rate:.1f} steps/s, "
              f"SparseSGDM {sparse_rate:.1f} steps/s, ratio {sparse_rate / dense_rate:.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="calibration examples per Fisher pass")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (each timed) per pass")
    parser.add_argument("--passes", type=int, default=5, help="alternating passes per side")
    parser.add_argument("--only", choices=("fisher", "step"), default=None, help="run one of the two benchmarks")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{sum(p.numel() for p in make_model().parameters()) / 1e6:.2f} M parameters")
    if args.only != "step":
        bench_fisher(args.batch, args.passes)
    if args.only != "fisher":
        for foreach in (None, True):
            bench_step(args.steps, args.passes, foreach)


if __name__ == "__main__":
    main()
