"""The paper grid's whole cost, beyond its federated rounds: step 2's training, step 3's embeddings, the step-3c
readings and the checkpoint writes, from the figures the GPU check's ``paper_round`` stage measured.

Each part is ``count × work ÷ rate``: the training rate is FedAvg's timed round (``per_round`` clients × local steps ×
batch samples, ResNet-50 at 256 px, forward, backward and SGD), the forward rate the evaluation's, the write rate an
``atomic_torch_save`` of the model timed on the machine's disk, and the bytes each run writes come from
pipeline/disk_sizes.py (the same code run_pipeline.py's disk check asks). :func:`complete_projection` adds one row per
part and the whole grid on 1 and 8 GPUs; :func:`assumption_lines` states every assumption for the Markdown.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from bench.gpu_federated_stages import PaperSetting
    from bench.gpu_stage_kit import Context

WRITE_REPEATS = 3  # timed checkpoint writes (the median is the rate)


@dataclass(frozen=True)
class GridParts:
    """Hours of each part of the paper grid beside its federated rounds (``step4``: ``grid_1gpu``)."""

    step4: float
    step2: float
    embeddings: float
    readings: float
    checkpoints: float

    @property
    def compute(self) -> float:
        """Every part a GPU runs (the checkpoint writes go to a disk)."""
        return self.step4 + self.step2 + self.embeddings + self.readings

    def on(self, gpus: int) -> float:
        """Hours on ``gpus`` GPUs sharing the independent stages evenly and one disk (its writes one after another)."""
        return self.compute / gpus + self.checkpoints


def write_rate(state: dict[str, torch.Tensor], folder: Path | None) -> tuple[float, int]:
    """MiB/s of ``atomic_torch_save`` (fsync included) of ``state`` into a temporary folder under ``folder``: the
    median of :data:`WRITE_REPEATS` writes, and the file's bytes."""
    from utils.run_dir import atomic_torch_save

    seconds = []
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        path = Path(scratch) / "checkpoint.pt"
        for _ in range(WRITE_REPEATS):
            began = time.perf_counter()
            atomic_torch_save({"model": state}, path)
            seconds.append(time.perf_counter() - began)
        size = path.stat().st_size
    return size / 2**20 / statistics.median(seconds), size


def checkpoint_writes(n_rounds: int, every: int) -> int:
    """checkpoint.pt writes of a run: round 0, every ``every``-th round and the last (EngineConfig.checkpoint_every)."""
    return 1 + sum(1 for index in range(1, n_rounds + 1) if index % every == 0 or index == n_rounds)


def run_bytes_written(setting: "PaperSetting", method: str) -> int:
    """Bytes one run of ``method`` writes: checkpoint.pt at round 0 (no client state yet) and at the last round as
    it is kept, every write between at its size during the run (every client holding a state: an upper bound for the
    first rounds), and best.pt at every evaluation (each one an improvement: an upper bound)."""
    from bench.gpu_stage_kit import DENSE_TASK
    from pipeline.disk_probe import run_bytes
    from pipeline.disk_sizes import ModelSpec

    spec = ModelSpec(DENSE_TASK, setting.encoder, "none", False, None, setting.image)
    size = run_bytes(spec, method, setting.algorithms[method] or {}, setting.n_clients, False, {})
    writes = checkpoint_writes(setting.n_rounds, setting.checkpoint_every)
    return 2 * size.finished + (writes - 2) * size.during + setting.evaluations * size.best


def step2_bytes_written(setting: "PaperSetting") -> int:
    """Bytes one step-2 model writes: best.pt and last.pt (with the optimizer's state) every epoch (an upper bound:
    best.pt only when the validation loss falls)."""
    from bench.gpu_stage_kit import DENSE_TASK
    from pipeline.disk_sizes import ModelSpec, centralized_bytes

    spec = ModelSpec(DENSE_TASK, setting.encoder, "none", False, None, setting.image)
    return setting.epochs * centralized_bytes(spec, setting.optimizer)


def grid_parts(ctx: "Context", setting: "PaperSetting", step4_hours: float, train_rate: float, eval_rate: float,
               mib_per_s: float) -> GridParts:
    """Hours of each part (the arithmetic :func:`assumption_lines` states)."""
    models = setting.tasks * setting.seeds
    epoch = ctx.train_samples / train_rate + ctx.eval_samples / eval_rate
    written = (sum(run_bytes_written(setting, method) for method in setting.algorithms)
               * setting.runs / len(setting.algorithms) + models * step2_bytes_written(setting))
    return GridParts(step4=step4_hours, step2=models * setting.epochs * epoch / 3600,
                     embeddings=models * (ctx.train_samples + ctx.eval_samples) / eval_rate / 3600,
                     readings=setting.readings * ctx.train_samples / train_rate / 3600,
                     checkpoints=written / 2**20 / mib_per_s / 3600)


def complete_projection(ctx: "Context", setting: "PaperSetting", step4_hours: float, fedavg_round: float,
                        eval_rate: float, state: dict[str, torch.Tensor]) -> GridParts:
    """Time the checkpoint writes, then add a row per part of the grid and the whole grid on 1 and 8 GPUs."""
    from bench.gpu_federated_stages import GPUS_IN_PROJECTION

    mib_per_s, size = write_rate(state, ctx.report.out)
    ctx.add("checkpoint_write", mib_per_s, "MiB/s", f"atomic_torch_save (fsync included) of a {size / 2**20:.1f} MiB "
            f"model, median of {WRITE_REPEATS}, on the disk of the check's folder")
    train_rate = setting.per_round * setting.steps * setting.batch / fedavg_round
    ctx.add("train_samples_per_s", train_rate, "samples/s", f"FedAvg's timed round: {setting.per_round} clients × "
            f"{setting.steps} steps × batch {setting.batch}")
    parts = grid_parts(ctx, setting, step4_hours, train_rate, eval_rate, mib_per_s)
    ctx.add("step2_1gpu", parts.step2, "h", f"{setting.tasks * setting.seeds} models × {setting.epochs} epochs of "
            f"{ctx.train_samples:,} samples, each epoch evaluating {ctx.eval_samples:,}")
    ctx.add("embeddings_1gpu", parts.embeddings, "h", f"{setting.tasks * setting.seeds} models × "
            f"{ctx.train_samples + ctx.eval_samples:,} samples forward")
    ctx.add("readings_1gpu", parts.readings, "h", f"{setting.readings} step-3c readings × {ctx.train_samples:,} "
            "samples forward and backward")
    ctx.add("checkpoints_1gpu", parts.checkpoints, "h", "every checkpoint.pt, best.pt and step-2 write at the "
            "measured rate")
    ctx.add("complete_1gpu", parts.on(1), "h", "steps 2, 3 (embeddings), 3c and 4 and the checkpoint writes")
    ctx.add("complete_8gpu", parts.on(GPUS_IN_PROJECTION), "h",
            f"the GPU parts shared by {GPUS_IN_PROJECTION} GPUs, the writes on one disk")
    return parts


def assumption_lines(ctx: "Context", setting: "PaperSetting", parts: GridParts) -> list[str]:
    """The complete projection's assumptions, for the Markdown under the step-4 ones."""
    from bench.gpu_federated_stages import GPUS_IN_PROJECTION

    writes = checkpoint_writes(setting.n_rounds, setting.checkpoint_every)
    return [
        f"- Step 2: {setting.tasks} tasks × {setting.seeds} seeds = {setting.tasks * setting.seeds} models, each "
        f"{setting.epochs} epochs (early stopping may end it sooner: an upper bound) of `--train_samples` "
        f"{ctx.train_samples:,} samples at FedAvg's training rate ({setting.encoder} at {setting.image} px, forward, "
        f"backward and an optimizer step; step 2's AdamW at batch 64 is taken to cost what SGD at batch "
        f"{setting.batch} does), "
        f"each epoch evaluating `--eval_samples` {ctx.eval_samples:,} at the evaluation's rate: "
        f"{parts.step2:.2f} h.",
        f"- Step 3: each model embeds the whole manifest ({ctx.train_samples + ctx.eval_samples:,} samples) forward "
        f"at the evaluation's rate: {parts.embeddings:.2f} h; the KMeans fits are left out (CPU, seconds).",
        f"- Step 3c: {setting.readings} readings (label- and embedding-based partitions × α × seeds × tasks), each "
        f"the gradient of every client's train rows ({ctx.train_samples:,} samples) at the step-2 model: forward and "
        f"backward without an optimizer step, taken at the training rate (an upper bound): {parts.readings:.2f} h.",
        f"- Checkpoints: a run writes checkpoint.pt {writes} times (round 0, then every "
        f"`federated.checkpoint_every` = {setting.checkpoint_every} rounds and the last), each at its size while every "
        f"client holds a state (SCAFFOLD: the model, c and {setting.n_clients} clients' c_i; pipeline/disk_sizes.py) "
        "except the first and the last, and best.pt at every evaluation; each step-2 model writes best.pt and "
        "last.pt every epoch. At the measured write rate of one model-sized file (a larger file may write slower): "
        f"{parts.checkpoints:.2f} h, on one disk whatever the GPUs (not shared out).",
        f"- The whole grid: {parts.on(1):.1f} h on one GPU, {parts.on(GPUS_IN_PROJECTION):.1f} h on "
        f"{GPUS_IN_PROJECTION} (steps 2–4 shared evenly, the "
        "writes one after another). Still left out: step 1, KMeans, loading ImageNet weights, PNG decoding (the "
        "decoded-sample cache's path is what is timed) and filling that cache.",
    ]
