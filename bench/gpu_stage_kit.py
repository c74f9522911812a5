"""What every stage of the GPU check (bench/gpu_check.py) shares: its sizes (:class:`Plan`), its context (where
the figures go, the device, the deadline), progress through a stage's cases, and synchronised timing."""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from bench.gpu_report import SKIPPED, Report, Row, progress

DENSE_TASK = "depth_euclidean"  # a dense task with the paper's decoder (6 of paper.yaml's 7 tasks are dense)


@dataclass(frozen=True)
class Plan:
    """Every stage's sizes: :data:`FULL` on a GPU, :data:`DRY` on the CPU. ``None``: the experiment file's value."""

    matmul_side: int = 8192
    matmul_repeats: int = 50
    render: tuple[int, int, int] = (1, 64, 64)  # buildings, views, rendered px (read back at the stage's size)
    loop_encoder: str = "resnet50"
    loop_image: int = 224
    loop_batch: int = 64
    loop_steps: int = 25  # steps a pass: 2 timed passes of each loop are its 50 timed steps
    loop_passes: int = 2
    vector_models: tuple[str, ...] = ("mlp", "cnn", "decoder")
    vector_counts: tuple[int, ...] = (32, 128)
    vector_rounds: int = 2
    vector_batch: int | None = None  # None: each case's own batch size (bench/vectorized_cases.py, CASES)
    pfl_rounds: int = 3
    paper_encoder: str | None = None
    paper_image: int | None = None
    paper_clients: int | None = None
    paper_steps: int | None = None
    paper_batch: int | None = None
    paper_rounds: int = 1  # timed rounds per algorithm (the first algorithm's after one warm-up round)
    eval_batches: int = 16  # batches of one timed evaluation pass
    fedloge_encoder: str | None = None
    fedloge_clients: int | None = None
    fedloge_steps: int | None = None
    fedloge_etf_steps: int | None = None
    fedloge_rounds: int = 3
    client_samples: int = 64  # random CIFAR samples per FedLoGe client (cycled: a step costs the same)
    encoder_image: int = 224
    encoder_batch: int = 8


FULL = Plan()
DRY = dataclasses.replace(
    FULL, matmul_side=64, matmul_repeats=2, render=(1, 4, 16), loop_encoder="small_cnn", loop_image=32, loop_batch=2,
    loop_steps=2, loop_passes=1, vector_counts=(2,), vector_rounds=1, vector_batch=2, pfl_rounds=1,
    paper_encoder="small_cnn", paper_image=32, paper_clients=5, paper_steps=1, paper_batch=2, eval_batches=2,
    fedloge_encoder="small_cnn", fedloge_clients=5, fedloge_steps=1, fedloge_etf_steps=2, client_samples=4,
    encoder_image=32, encoder_batch=2)


@dataclass
class Context:
    """What a stage needs: where its figures go, its sizes, the device and its deadline."""

    report: Report
    plan: Plan
    device: torch.device
    eval_samples: int
    encoders: tuple[str, ...]
    began: float
    stage: str = ""
    deadline: float = math.inf
    train_samples: int = 40_000  # step 2's train rows a paper-grid epoch reads (gpu_check.py --train_samples)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def add(self, figure: str, value: float | str, unit: str = "", detail: str = "") -> None:
        self.report.add(Row(self.stage, figure, value, unit, detail))

    def skip(self, figure: str, reason: str) -> None:
        self.add(figure, SKIPPED, "", reason)

    def time_left(self) -> float:
        return self.deadline - time.perf_counter()

    def note(self, message: str) -> None:
        progress(f"[{clock(time.perf_counter() - self.began)}] {self.stage}: {message}")

    def peak_memory(self, figure: str = "peak_memory", what: str = "") -> None:
        """The stage's peak CUDA memory since :func:`reset_peak_memory` (skipped on the CPU)."""
        if not self.cuda:
            self.skip(figure, "CUDA only (torch.cuda.max_memory_allocated)")
            return
        self.add(figure, torch.cuda.max_memory_allocated(self.device) / 2**20, "MB",
                 f"torch.cuda.max_memory_allocated{': ' + what if what else ''}")


class Steps:
    """Progress through a stage's cases, with an ETA from the mean time of those done, and whether the next fits."""

    def __init__(self, ctx: Context, total: int) -> None:
        self.ctx, self.total, self.done, self.began = ctx, total, 0, time.perf_counter()

    def mean(self) -> float:
        return (time.perf_counter() - self.began) / self.done if self.done else 0.0

    def start(self, label: str) -> bool:
        """Announce case ``label``; False (nothing to run) when the stage's budget cannot fit one more case."""
        if self.done and self.mean() > self.ctx.time_left():
            self.ctx.note(f"{label}: skipped, {self.ctx.time_left():.0f} s left of the stage's budget")
            return False
        eta = f", stage ETA {self.mean() * (self.total - self.done):.0f} s" if self.done else ""
        self.ctx.note(f"{label} ({self.done + 1}/{self.total}{eta})")
        return True

    def finish(self) -> None:
        self.done += 1


@dataclass(frozen=True)
class Stage:
    """A stage: its name (the CSV's ``stage``), what it measures, its time budget in seconds, and its function."""

    name: str
    title: str
    budget_s: float
    run: Callable[[Context], None]


def clock(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"



def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synced_seconds(run: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of ``run()``, the device's queued work finished before and after."""
    synchronize(device)
    began = time.perf_counter()
    run()
    synchronize(device)
    return time.perf_counter() - began


def reset_peak_memory(device: torch.device) -> None:
    """Free the previous case's CUDA memory and restart the peak (nothing to do on the CPU: a collection there
    costs seconds of a dry run's few)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def repeated(samples: list, count: int) -> list:
    """``count`` samples cycling through ``samples`` (the same objects: the data stays small)."""
    return [samples[index % len(samples)] for index in range(count)]



def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"
