"""The GPU check: every GPU goal of docs/BENCHMARKS.md measured by one command, in at most 8 minutes on one H100.

``make gpu-bench OUT=folder`` (``.venv/bin/python bench/gpu_check.py folder``) runs six stages, each within its own
time budget, and prints one line per figure (progress lines, with ETAs, go to stderr). ``folder/gpu_check.csv``
(stage, figure, value, unit, detail) and ``folder/gpu_check.md`` (the same table, the goals, and the paper-grid
projection's assumptions) are rewritten after every stage, so a run cut short keeps the stages it finished. A stage
that fails is one ``error`` row with its exception (the traceback on stderr); the other stages still run.

1. ``device``: the device, torch, CUDA and cuDNN versions, and a bf16 matmul's TFLOP/s against the card's peak.
2. ``train_loop``: step 2's training loop ÷ a plain PyTorch bf16 loop (bench/bench_train_loop.py): ResNet50 at
   224 px, batch 64, 50 steps a pass, the same rendered samples for both.
3. ``vectorised``: vectorised ÷ sequential rounds/s at 32 and 128 clients for the MLP, the small CNN and the demo's
   decoder (bench/bench_vectorized.py), with the vectorised engine's peak memory.
4. ``pfl``: TaskHet ÷ pfl-research on the same FedAvg workload (``bench_vectorized.py --pfl``) when ``pfl`` imports;
   it is never installed at run time (the GPU machines are offline): otherwise one row says why.
5. ``paper_round``: one round of experiments/paper.yaml's setting for each of its algorithms (ResNet50 at 256 px,
   10 of 25 clients × 20 local steps at batch 32) on rendered Taskonomy-format data, an evaluation's throughput, and
   from them the paper grid's projected cost on 1 and 8 GPUs (its assumptions are written into the Markdown).
6. ``fedloge``: a 3-round FedLoGe run at experiments/cifar10_lt_fedloge.yaml's sizes on random CIFAR-shaped data:
   seconds per round, projected to the file's 500 rounds.

``--quick`` (``make gpu-check``): the device stage and one training step of every registered encoder.
``--dry-run``: every stage at tiny sizes on the CPU, in seconds (tests/test_gpu_check.py runs it, so the script
cannot rot); figures only CUDA has are rows marked skipped. Without ``--dry-run``, a machine where torch sees no
CUDA device gets one ``error:`` line and nothing is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

# `make gpu-bench` runs this file as a script, so the repository root is not on sys.path by itself.
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import bench_train_loop, bench_vectorized  # noqa: E402
from bench.bench_engine import TensorDicts  # noqa: E402
from bench.gpu_report import FAILED, SKIPPED, Report, Row, progress  # noqa: E402
from utils import cli  # noqa: E402
from utils.device import pick_device, prepare_model  # noqa: E402
from utils.errors import TaskHetError  # noqa: E402
from utils.run_dir import git_revision  # noqa: E402
from utils.seeding import set_deterministic  # noqa: E402

DENSE_TASK = "depth_euclidean"  # a dense task with the paper's decoder (6 of paper.yaml's 7 tasks are dense)
PAPER_FILE = ROOT / "experiments" / "paper.yaml"
FEDLOGE_FILE = ROOT / "experiments" / "cifar10_lt_fedloge.yaml"
CIFAR_CLASSES = {"cifar10": 10, "cifar100": 100}
DEFAULT_BUDGET_S = 480.0  # the 8 minutes on one H100, imports included
DEFAULT_EVAL_SAMPLES = 10_000
GPUS_IN_PROJECTION = 8

# Dense bf16 tensor-core peaks (without sparsity) from NVIDIA's data sheets, matched as substrings of the device
# name in this order (a longer name first: "H100 PCIe" before "H100", "GH200" before "H200", "L40S" before "L4").
BF16_PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("GH200", 989.0), ("H200", 989.0), ("H100", 989.0),
                    ("A100", 312.0), ("L40S", 362.0), ("L4", 121.0))


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
    vector_batch: int | None = None  # None: each case's own batch size (bench_vectorized.CASES)
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


# ----- stage 1: the device -----

def device_stage(ctx: Context) -> None:
    name = torch.cuda.get_device_name(ctx.device) if ctx.cuda else f"CPU ({torch.get_num_threads()} torch threads)"
    ctx.add("device", name)
    ctx.add("torch", torch.__version__)
    ctx.add("cuda", torch.version.cuda or "none", "", "" if torch.version.cuda else "a CPU build of torch")
    if ctx.cuda:
        ctx.add("cudnn", str(torch.backends.cudnn.version()))
        ctx.add("memory_total", torch.cuda.get_device_properties(ctx.device).total_memory / 2**30, "GiB")
        ctx.add("driver", nvidia_driver())
    else:
        for figure in ("cudnn", "memory_total", "driver"):
            ctx.skip(figure, "no CUDA device (dry run)")
    side, repeats = ctx.plan.matmul_side, ctx.plan.matmul_repeats
    tflops = matmul_tflops(ctx.device, side, repeats)
    ctx.add("bf16_matmul", tflops, "TFLOP/s", f"{side}×{side} by {side}×{side} in bf16, {repeats} back to back after "
            "3 warm-up")
    peak = bf16_peak(name) if ctx.cuda else None
    if peak is None:
        ctx.skip("bf16_peak", "no CUDA device (dry run)" if not ctx.cuda else f"{name} is not in the table of peaks")
        return
    ctx.add("bf16_peak", peak, "TFLOP/s", "dense bf16 tensor cores, the card's data sheet")
    ctx.add("bf16_of_peak", tflops / peak, "", "measured ÷ peak")


def matmul_tflops(device: torch.device, side: int, repeats: int) -> float:
    """TFLOP/s of ``repeats`` bf16 products of two ``side``² matrices, into one output buffer, after 3 warm-up."""
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(side, side, generator=generator).to(device, torch.bfloat16) for _ in range(2))
    product = torch.empty(side, side, device=device, dtype=torch.bfloat16)

    def multiply(times: int) -> None:
        for _ in range(times):
            torch.matmul(a, b, out=product)

    multiply(3)
    seconds = synced_seconds(lambda: multiply(repeats), device)
    return 2 * side**3 * repeats / seconds / 1e12


def bf16_peak(name: str) -> float | None:
    return next((peak for key, peak in BF16_PEAK_TFLOPS if key in name), None)


def nvidia_driver() -> str:
    try:
        found = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError) as error:
        return f"unknown ({type(error).__name__})"
    return found.stdout.strip().splitlines()[0] if found.stdout.strip() else "unknown"


# ----- stage 2: step 2's loop vs a plain bf16 loop -----

def train_loop_stage(ctx: Context) -> None:
    from models import build_task_model

    plan = ctx.plan
    samples = bench_train_loop.rendered_samples(DENSE_TASK, plan.loop_image, plan.render[0], plan.render[1],
                                                plan.render[2])
    epoch = repeated(samples, plan.loop_steps * plan.loop_batch)
    model = prepare_model(build_task_model(DENSE_TASK, plan.loop_encoder, "none", seed=0), ctx.device).train()
    reset_peak_memory(ctx.device)
    ctx.note(f"{plan.loop_encoder}: 2 warm-up and {2 * plan.loop_passes} timed passes of {plan.loop_steps} steps, "
             "alternating")
    rates = bench_train_loop.compare_loops(model, epoch, DENSE_TASK, plan.loop_batch, ctx.device, plan.loop_passes)
    detail = (f"{plan.loop_encoder}, {DENSE_TASK} at {plan.loop_image} px, batch {plan.loop_batch}, "
              f"{plan.loop_steps * plan.loop_passes} timed steps a loop ({plan.loop_passes} passes of "
              f"{plan.loop_steps}, alternating, after a warm-up pass each; median pass), {len(samples)} rendered "
              "samples cycled")
    ctx.add("plain_samples_per_s", rates["plain"], "samples/s", detail)
    ctx.add("taskhet_samples_per_s", rates["taskhet"], "samples/s", detail)
    ctx.add("taskhet_over_plain", rates["taskhet"] / rates["plain"], "×",
            "step 2's loop ÷ the plain bf16 loop; goal ≥ 0.9")
    ctx.peak_memory(what="both loops")


# ----- stage 3: vectorised vs sequential clients -----

def vectorised_stage(ctx: Context) -> None:
    plan = ctx.plan
    cases = [(model, count) for model in plan.vector_models for count in plan.vector_counts]
    steps = Steps(ctx, len(cases))
    for model, count in cases:
        figure = f"{model}_k{count}"
        if not steps.start(f"{model} at K={count}"):
            ctx.skip(f"{figure}_ratio", "the stage's time budget is spent")
            continue
        reset_peak_memory(ctx.device)
        timing = bench_vectorized.measure(model, count, count, plan.vector_rounds, ctx.device, item_reads=False,
                                          batch_size=plan.vector_batch)
        batch = f"batch {plan.vector_batch}" if plan.vector_batch else "bench_vectorized.py's batch"
        detail = (f"FedAvg, {count} clients × {bench_vectorized.STEPS} local steps, {batch}, whole-round chunks, "
                  f"median of {plan.vector_rounds} interleaved rounds after a warm-up")
        ctx.add(f"{figure}_sequential", 1 / timing.sequential, "rounds/s", detail)
        ctx.add(f"{figure}_vectorised", 1 / timing.vectorised, "rounds/s", detail)
        ctx.add(f"{figure}_ratio", timing.sequential / timing.vectorised, "×",
                "vectorised ÷ sequential; goal ≥ 10 at 128")
        ctx.add(f"{figure}_peak_memory", timing.peak_mb, "MB", timing.memory if ctx.cuda else
                "CPU: how much the vectorised engine raised the process's peak RSS")
        steps.finish()


# ----- stage 4: TaskHet vs pfl-research -----

def pfl_stage(ctx: Context) -> None:
    missing = bench_vectorized.pfl_unavailable()
    if missing:
        ctx.add("pfl", "not installed", "", f"{missing}; the check never installs it (offline machines): "
                "docs/BENCHMARKS.md, 'Side by side with pfl-research', says how")
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        ctx.add("pfl", version("pfl"))
    except PackageNotFoundError:
        ctx.add("pfl", "importable, version unknown")
    steps = Steps(ctx, len(ctx.plan.vector_counts))
    for count in ctx.plan.vector_counts:
        if not steps.start(f"K={count}"):
            ctx.skip(f"k{count}_vectorised_over_pfl", "the stage's time budget is spent")
            continue
        rates = bench_vectorized.taskhet_and_pfl(count, count, ctx.plan.pfl_rounds, ctx.device, False)
        detail = (f"tiny MLP, FedAvg, {count} clients × {bench_vectorized.STEPS} local steps, "
                  f"{ctx.plan.pfl_rounds} rounds")
        ctx.add(f"k{count}_pfl", rates["pfl"], "rounds/s", detail + "; pfl on its default device")
        ctx.add(f"k{count}_sequential_over_pfl", rates["sequential"] / rates["pfl"], "×", detail)
        ctx.add(f"k{count}_vectorised_over_pfl", rates["vectorised"] / rates["pfl"], "×", detail + "; goal ≥ 1")
        steps.finish()


# ----- stages 5 and 6: federated runs of the experiment files -----

def federated_engine(model: torch.nn.Module, method: str, settings: dict, clients: list, loss: Callable, out: Path,
                     device: torch.device, *, steps: int, fraction: float, lr_schedule: Callable[[int], float],
                     momentum: float, weight_decay: float, input_key: str, n_rounds: int):
    """A sequential engine as step 4 builds one, without evaluation (timed separately) or checkpoints."""
    from network.algorithms import build_algorithm
    from network.engine_sequential import EngineConfig, SequentialEngine

    config = EngineConfig(out_dir=out, n_rounds=n_rounds, lr_schedule=lr_schedule, local_steps=steps,
                          client_fraction=fraction, momentum=momentum, weight_decay=weight_decay, progress=False)
    algorithm, worker = build_algorithm(method, model, {client.client_id: client.num_samples for client in clients},
                                        settings, input_key=input_key)
    return SequentialEngine(prepare_model(worker, device), algorithm, clients, loss, lambda net, loader: {"loss": 0.0},
                            [], config, device)


def in_memory_clients(count: int, dataset_of: Callable[[int], object], batch_size: int) -> list:
    from network.client import ClientData
    from training.loop import make_loader

    return [ClientData(str(index), len(dataset_of(index)), lambda seed, data=dataset_of(index): make_loader(
        data, batch_size, True, seed)) for index in range(count)]


@dataclass(frozen=True)
class PaperSetting:
    """experiments/paper.yaml's federated setting, the dry run's sizes put in where the plan sets them."""

    runs: int
    tasks: int
    algorithms: dict
    encoder: str
    image: int
    n_clients: int
    fraction: float
    per_round: int
    steps: int
    batch: int
    n_rounds: int
    eval_every: int
    init_lr: float
    lr_schedule: str
    momentum: float
    weight_decay: float
    count_text: str

    @property
    def evaluations(self) -> int:
        """Evaluations a run makes: round 0, every ``eval_every``-th round and the last (EngineConfig.eval_every)."""
        return 1 + sum(1 for index in range(1, self.n_rounds + 1)
                       if index % self.eval_every == 0 or index == self.n_rounds)


def paper_setting(plan: Plan) -> PaperSetting:
    from network.sampling import clients_per_round
    from pipeline.experiment import load_experiment
    from pipeline.studies.main_job.config import count_combinations

    config = load_experiment(PAPER_FILE)
    federated, partition = config["federated"], config["partition"]
    n_clients = plan.paper_clients or partition["n_clients"]
    count_text = (f"{len(config['tasks'])} tasks × {len(partition['groupings'])} groupings × "
                  f"{len(partition['alphas'])} alphas × {len(federated['algorithms'])} algorithms × "
                  f"{len(config['seeds'])} seeds"
                  + (" (+ the iid reference)" if partition["iid_reference"] else ""))
    return PaperSetting(
        runs=count_combinations(config), tasks=len(config["tasks"]), algorithms=dict(federated["algorithms"]),
        encoder=plan.paper_encoder or config["model"]["encoder"],
        image=plan.paper_image or config["model"]["image_size"],
        n_clients=n_clients, fraction=federated["client_fraction"],
        per_round=clients_per_round(n_clients, federated["client_fraction"]),
        steps=plan.paper_steps or federated["local_steps"], batch=plan.paper_batch or federated["batch_size"],
        n_rounds=federated["n_rounds"], eval_every=federated["eval_every"], init_lr=federated["init_lr"],
        lr_schedule=federated["lr_schedule"], momentum=federated["momentum"], weight_decay=federated["weight_decay"],
        count_text=count_text)


def paper_stage(ctx: Context) -> None:
    from models import build_task_model, get_task
    from network.client import evaluate_model
    from network.lr_schedule import make_lr_schedule
    from training.loop import evaluate, make_loader

    plan, setting, task = ctx.plan, paper_setting(ctx.plan), get_task(DENSE_TASK)
    ctx.add("runs", setting.runs, "runs", f"{setting.count_text}: count_combinations of experiments/paper.yaml")
    samples = bench_train_loop.rendered_samples(DENSE_TASK, setting.image, *plan.render)
    clients = in_memory_clients(setting.n_clients, lambda index: samples, setting.batch)

    def loss(net, batch, reduction="mean"):
        return task.loss(net(batch["rgb"])[0].float(), batch, reduction)

    detail = (f"{setting.per_round} of {setting.n_clients} clients × {setting.steps} local steps at batch "
              f"{setting.batch}, {setting.encoder} at {setting.image} px, {DENSE_TASK}; median of "
              f"{plan.paper_rounds} timed round(s)")
    round_seconds: dict[str, float] = {}
    steps = Steps(ctx, len(setting.algorithms))
    reset_peak_memory(ctx.device)
    with tempfile.TemporaryDirectory() as folder:
        for method, settings in setting.algorithms.items():
            if not steps.start(method):
                ctx.skip(f"{method}_round", "the stage's time budget is spent; the projection takes FedAvg's round")
                continue
            model = build_task_model(DENSE_TASK, setting.encoder, "none", seed=0)
            engine = federated_engine(
                model, method, settings, clients, loss, Path(folder) / method, ctx.device, steps=setting.steps,
                fraction=setting.fraction, lr_schedule=make_lr_schedule(setting.lr_schedule, setting.init_lr,
                                                                        setting.n_rounds),
                momentum=setting.momentum, weight_decay=setting.weight_decay, input_key="rgb",
                n_rounds=setting.n_rounds)
            # One warm-up round, before the first algorithm only: cuDNN's kernel choices and the allocator's pool
            # then serve the others (the same model), so the budget times every algorithm.
            warm_up = not round_seconds
            if warm_up:
                synced_seconds(lambda: engine.train_round(1), ctx.device)
            first = 2 if warm_up else 1
            round_seconds[method] = statistics.median(
                synced_seconds(lambda index=index: engine.train_round(index), ctx.device)
                for index in range(first, first + plan.paper_rounds))
            ctx.add(f"{method}_round", round_seconds[method], "s",
                    detail + ("; after a warm-up round" if warm_up else "; from its first round, the kernels warm"))
            del engine
            steps.finish()
    ctx.peak_memory(what="the largest algorithm's round")
    if not round_seconds:
        raise TaskHetError("no algorithm's round fitted in the stage's time budget")
    model = prepare_model(build_task_model(DENSE_TASK, setting.encoder, "none", seed=0), ctx.device)
    loader = make_loader(repeated(samples, plan.eval_batches * setting.batch), setting.batch, False, 0)

    def evaluate_fn(net, batches):
        return evaluate(net, batches, task, ctx.device, input_key="rgb", progress=False)

    evaluate_model(model, evaluate_fn, loader)  # warm-up
    eval_rate = len(loader.dataset) / synced_seconds(lambda: evaluate_model(model, evaluate_fn, loader), ctx.device)
    ctx.add("eval_samples_per_s", eval_rate, "samples/s", f"the evaluation's forward passes and metrics, batch "
            f"{setting.batch}, one pass of {len(loader.dataset)} samples after a warm-up pass")
    project_paper_grid(ctx, setting, round_seconds, eval_rate)


def project_paper_grid(ctx: Context, setting: PaperSetting, round_seconds: dict[str, float], eval_rate: float) -> None:
    """The grid's hours from the timed rounds and the evaluation's rate; its assumptions go into the Markdown."""
    fallback = round_seconds.get("fedavg", statistics.mean(round_seconds.values()))
    per_method = setting.runs / len(setting.algorithms)
    eval_hours = setting.evaluations * ctx.eval_samples / eval_rate / 3600
    run_hours = {method: setting.n_rounds * round_seconds.get(method, fallback) / 3600 + eval_hours
                 for method in setting.algorithms}
    for method, hours in run_hours.items():
        ctx.add(f"{method}_run", hours, "h", f"{setting.n_rounds} rounds + {setting.evaluations} evaluations of "
                f"{ctx.eval_samples:,} samples" + ("" if method in round_seconds else "; FedAvg's round, not timed"))
    grid_hours = per_method * sum(run_hours.values())
    ctx.add("grid_1gpu", grid_hours, "h", f"{setting.runs} runs, {per_method:g} per algorithm; goal ≤ 48 h")
    per_gpu = math.ceil(setting.runs / GPUS_IN_PROJECTION)
    ctx.add("grid_8gpu", grid_hours / GPUS_IN_PROJECTION, "h",
            f"{per_gpu} runs per GPU, independent runs shared evenly")
    ctx.report.notes = paper_assumptions(setting, round_seconds, eval_rate, ctx.eval_samples, ctx.report.dry_run)


def paper_assumptions(setting: PaperSetting, round_seconds: dict[str, float], eval_rate: float, eval_samples: int,
                      dry_run: bool) -> list[str]:
    timed = ", ".join(f"{method} {seconds:.3g} s" for method, seconds in round_seconds.items())
    lines = [
        "## The paper-grid projection: its assumptions", "",
        f"- Runs: {setting.runs} = {setting.count_text} "
        "(`count_combinations(load_experiment('experiments/paper.yaml'))`).",
        f"- Each run: {setting.n_rounds} rounds of {setting.per_round} clients (client_fraction "
        f"{setting.fraction:g} of {setting.n_clients}) × {setting.steps} local steps at batch {setting.batch}, "
        f"{setting.encoder} at {setting.image} px, each algorithm's round as timed here ({timed}); an algorithm "
        "the budget left untimed costs FedAvg's round.",
        f"- Every task costs what {DENSE_TASK} costs: {setting.tasks - 1} of the {setting.tasks} tasks are dense "
        "with the same decoder; class_scene's classifier head is cheaper, so the grid's figure is an upper bound "
        "for it.",
        f"- Evaluation: {setting.evaluations} evaluations a run (round 0, every {setting.eval_every}th round and the "
        f"last), each a forward pass over {eval_samples:,} samples (`--eval_samples`: the global test split plus the "
        f"clients' test splits; set it to your manifest's) at the measured {eval_rate:,.0f} samples/s.",
        f"- {GPUS_IN_PROJECTION} GPUs: the runs are independent and shared evenly, "
        f"{math.ceil(setting.runs / GPUS_IN_PROJECTION)} per GPU, with no other overhead.",
        "- Not included: steps 1–3 and step 2's centralized training, checkpoint writes (every round), loading "
        "ImageNet weights, and PNG decoding: the samples here are decoded in memory (the decoded-sample cache's path).",
    ]
    if dry_run:
        lines.append("- Dry run: the rounds were timed at tiny sizes on the CPU, so the hours are not a projection.")
    return lines


def fedloge_stage(ctx: Context) -> None:
    from models import build_task_model, get_task
    from network.lr_schedule import make_lr_schedule
    from network.sampling import clients_per_round
    from pipeline.experiment import load_experiment

    plan, config = ctx.plan, load_experiment(FEDLOGE_FILE)
    federated, grid = config["federated"], config["grid"][0]
    local_steps = grid["local_steps"][0]
    total_rounds = federated["rounds_x_local_steps"] // local_steps
    settings = dict(next(variant.settings for variant in grid["variants"] if variant.algorithm == "fedloge"))
    if plan.fedloge_etf_steps is not None:
        settings["etf_steps"] = plan.fedloge_etf_steps
    steps, n_clients = plan.fedloge_steps or local_steps, plan.fedloge_clients or federated["n_clients"]
    encoder, image = plan.fedloge_encoder or config["model"]["encoder"], config["model"]["image_size"]
    classes, task = CIFAR_CLASSES[config["data"]["source"]], get_task(config["task"])
    generator = torch.Generator().manual_seed(0)
    data = [TensorDicts.of(image=torch.rand(plan.client_samples, 3, image, image, generator=generator),
                           **{task.domain: torch.randint(0, classes, (plan.client_samples,), generator=generator)})
            for _ in range(n_clients)]
    clients = in_memory_clients(n_clients, lambda index: data[index], federated["batch_size"])

    def loss(net, batch, reduction="mean"):
        return task.loss(net(batch["image"])[0].float(), batch, reduction)

    model = build_task_model(config["task"], encoder, "none", num_classes=classes, seed=0)
    per_round = clients_per_round(n_clients, federated["client_fraction"])
    detail = (f"{per_round} of {n_clients} clients × {steps} local steps at batch {federated['batch_size']}, "
              f"{encoder}, {classes} classes at {image} px, random data")
    reset_peak_memory(ctx.device)
    with tempfile.TemporaryDirectory() as folder:
        engine = federated_engine(
            model, "fedloge", settings, clients, loss, Path(folder), ctx.device, steps=steps,
            fraction=federated["client_fraction"],
            lr_schedule=make_lr_schedule(federated["lr_schedule"], federated["init_lr"], total_rounds),
            momentum=federated["momentum"], weight_decay=federated["weight_decay"], input_key="image",
            n_rounds=total_rounds)
        ctx.note(f"SSE-C refinement ({settings.get('etf_steps')} Adam steps)")
        init = synced_seconds(lambda: engine.server, ctx.device)
        ctx.add("sse_c_init", init, "s", f"init_server: the SSE-C refinement, etf_steps {settings.get('etf_steps')}")
        times = []
        rounds = Steps(ctx, plan.fedloge_rounds)
        for index in range(1, plan.fedloge_rounds + 1):
            if not rounds.start(f"round {index}"):
                break
            times.append(synced_seconds(lambda index=index: engine.train_round(index), ctx.device))
            rounds.finish()
    ctx.add("first_round", times[0], "s", detail + "; includes the warm-up")
    if len(times) < 2:
        ctx.skip("round", "only the warm-up round fitted in the stage's time budget")
        return
    round_seconds = statistics.median(times[1:])
    ctx.add("round", round_seconds, "s", detail + f"; median of rounds 2–{len(times)}")
    ctx.add("projected_run", (init + total_rounds * round_seconds) / 3600, "h",
            f"SSE-C + {total_rounds} rounds ({federated['rounds_x_local_steps']:,} rounds × local steps ÷ J = "
            f"{local_steps}); its {federated['evaluations']} evaluations not included")
    ctx.peak_memory(what="FedLoGe's rounds")


# ----- --quick: one training step of every encoder -----

def encoders_stage(ctx: Context) -> None:
    from models import build_task_model, get_task
    from training.loop import train_one_batch

    plan, task = ctx.plan, get_task(DENSE_TASK)
    generator = torch.Generator().manual_seed(0)
    side, size = plan.encoder_image, plan.encoder_batch
    batch = {"rgb": torch.rand(size, 3, side, side, generator=generator),
             task.domain: torch.rand(size, task.out_channels, side, side, generator=generator),
             "mask": torch.ones(size, 1, side, side, dtype=torch.bool)}
    steps = Steps(ctx, len(ctx.encoders))
    for name in ctx.encoders:
        if not steps.start(name):
            ctx.skip(f"{name}_step", "the stage's time budget is spent")
            continue
        try:  # one encoder's failure is its own row: the others still train
            reset_peak_memory(ctx.device)
            model = prepare_model(build_task_model(DENSE_TASK, name, "none", seed=0), ctx.device).train()
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
            losses = []

            def step() -> None:
                losses.append(train_one_batch(model, batch, task, optimizer, ctx.device, input_key="rgb"))

            first, second = synced_seconds(step, ctx.device), synced_seconds(step, ctx.device)
            if not all(math.isfinite(value) for value in losses):
                raise TaskHetError(f"the loss is not finite: {losses}")
            memory = (f", peak {torch.cuda.max_memory_allocated(ctx.device) / 2**20:.0f} MB" if ctx.cuda else "")
            ctx.add(f"{name}_step", second * 1000, "ms", f"{DENSE_TASK} at {side} px, batch {size}, random weights; "
                    f"loss {losses[-1]:.4g}; the first step {first * 1000:.0f} ms{memory}")
        except Exception as error:  # noqa: BLE001 (recorded as the encoder's row, traceback on stderr)
            traceback.print_exc()
            ctx.add(f"{name}_step", FAILED, "", f"{type(error).__name__}: {first_line(error)}")
        finally:
            steps.finish()


STAGES = (
    Stage("device", "the device and a bf16 matmul", 15, device_stage),
    Stage("train_loop", "step 2's loop vs a plain bf16 loop", 60, train_loop_stage),
    Stage("vectorised", "vectorised vs sequential clients", 110, vectorised_stage),
    Stage("pfl", "TaskHet vs pfl-research", 40, pfl_stage),
    Stage("paper_round", "a round of experiments/paper.yaml and the grid's cost", 140, paper_stage),
    Stage("fedloge", "FedLoGe at cifar10_lt_fedloge.yaml's sizes", 85, fedloge_stage),
)
QUICK_STAGES = (STAGES[0], Stage("encoders", "one training step of every encoder", 240, encoders_stage))


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"


def run_stages(stages: tuple[Stage, ...], ctx: Context, deadline: float) -> None:
    """Each stage within min(its budget, what is left of the whole check's); a failure is one ``error`` row."""
    left = sum(stage.budget_s for stage in stages)
    for index, stage in enumerate(stages, 1):
        ctx.stage = stage.name
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            ctx.skip("stage", "the check's whole time budget is spent")
            continue
        ctx.deadline = time.perf_counter() + min(stage.budget_s, remaining)
        ctx.note(f"stage {index}/{len(stages)}, {stage.title}: budget {stage.budget_s:.0f} s; at most "
                 f"{min(left, remaining):.0f} s for this and the later stages")
        left -= stage.budget_s
        began = time.perf_counter()
        try:
            stage.run(ctx)
        except Exception as error:  # noqa: BLE001 (a failed stage must not lose the other stages' figures)
            traceback.print_exc()
            ctx.add("error", FAILED, "", f"{type(error).__name__}: {first_line(error)}")
        finally:
            reset_peak_memory(ctx.device)
        ctx.add("stage_seconds", time.perf_counter() - began, "s", f"budget {stage.budget_s:.0f} s")
        ctx.report.write()  # after every stage: a run cut short keeps the stages it finished


# ----- the command line -----

class HelpFormatter(argparse.RawDescriptionHelpFormatter, cli.DefaultsHelpFormatter):
    """The module docstring as written (its numbered stages), and each flag's default."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("out", nargs="?", type=Path, default=None,
                        help="folder for gpu_check.csv and gpu_check.md (created; required unless --quick)")
    parser.add_argument("--dry-run", dest="dry_run", action="store_true",
                        help="every stage at tiny sizes on the CPU, in seconds: checks the script, measures nothing")
    parser.add_argument("--quick", action="store_true",
                        help="only the device, a bf16 matmul and one training step of every encoder (make gpu-check)")
    parser.add_argument("--stages", default=None,
                        help="comma-separated stages to run (default: all: "
                             f"{', '.join(stage.name for stage in STAGES)})")
    parser.add_argument("--encoders", default=None, help="--quick: comma-separated encoders (default: every one "
                        "registered)")
    parser.add_argument("--budget_s", type=cli.floats(1.0, 86400.0), default=DEFAULT_BUDGET_S,
                        help="seconds for the whole check, imports included; each stage also has its own budget")
    parser.add_argument("--eval_samples", type=cli.ints(1, 10**9), default=DEFAULT_EVAL_SAMPLES,
                        help="samples one evaluation of a paper run reads (an assumption of the grid's projection)")
    parser.add_argument("--threads", type=cli.THREADS, default=None,
                        help="torch CPU threads (default: torch's choice; 1 is faster on a shared CPU)")
    return parser.parse_args(argv)


def chosen_stages(args: argparse.Namespace) -> tuple[Stage, ...]:
    stages = QUICK_STAGES if args.quick else STAGES
    if args.stages is None:
        return stages
    names = [name.strip() for name in args.stages.split(",") if name.strip()]
    known = {stage.name: stage for stage in stages}
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise TaskHetError(f"--stages {args.stages!r}: choose from {', '.join(known)}")
    return tuple(stage for stage in stages if stage.name in names)


def chosen_encoders(args: argparse.Namespace) -> tuple[str, ...]:
    from models import list_encoders

    known = list_encoders()
    if args.encoders is None:
        return tuple(known)
    names = [name.strip() for name in args.encoders.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise TaskHetError(f"--encoders {args.encoders!r}: choose from {', '.join(known)}")
    return tuple(names)


def check_out(args: argparse.Namespace) -> Path | None:
    if args.out is None:
        if not args.quick:
            raise TaskHetError("give the folder for gpu_check.csv and gpu_check.md (bench/gpu_check.py OUT; "
                               "make gpu-bench OUT=folder)")
        return None
    if args.out.exists() and not args.out.is_dir():
        raise TaskHetError(f"{args.out}: is a file, not a folder for gpu_check.csv and gpu_check.md")
    return args.out


def check_device(args: argparse.Namespace) -> torch.device:
    """The CUDA device, or the CPU for a dry run; no CUDA without --dry-run is one error line."""
    if args.dry_run:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        why = ("this torch is a CPU build: run make setup-gpu" if torch.version.cuda is None else
               f"this torch is built for CUDA {torch.version.cuda} but finds no GPU: check nvidia-smi and "
               "CUDA_VISIBLE_DEVICES")
        raise TaskHetError(f"no CUDA device is visible to torch {torch.__version__}: {why} (--dry-run runs the check "
                           "at tiny sizes on the CPU)")
    return pick_device(True)


def header(args: argparse.Namespace, argv: list[str] | None, device: torch.device) -> list[str]:
    command = shlex.join(["bench/gpu_check.py", *(sys.argv[1:] if argv is None else argv)])
    lines = ["# The GPU check", "",
             f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, `{command}`, TaskHet {git_revision()}; device "
             f"{device}, torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}."]
    if args.dry_run:
        lines += ["", "Dry run: every stage at tiny sizes on the CPU. It checks that the script works; its figures "
                      "measure nothing."]
    return lines


def main(argv: list[str] | None = None) -> Report:
    """Run the check (see the module docstring); returns its report (rows, Markdown)."""
    began = time.perf_counter()
    args = parse_args(argv)
    stages, out = chosen_stages(args), check_out(args)
    encoders = chosen_encoders(args) if args.quick else ()
    device = check_device(args)  # before anything is written
    if device.type == "cuda":
        set_deterministic(False)  # as steps 2 and 4 run by default: cuDNN benchmarks and picks its fastest kernels
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    report = Report(out, header(args, argv, device), dry_run=args.dry_run)
    ctx = Context(report, DRY if args.dry_run else FULL, device, args.eval_samples, encoders, began)
    run_stages(stages, ctx, began + args.budget_s)
    report.write()
    progress(f"[{clock(time.perf_counter() - began)}] done: {len(report.rows)} figures"
             + (f" in {out / 'gpu_check.csv'} and {out / 'gpu_check.md'}" if out is not None else ""))
    return report


if __name__ == "__main__":
    cli.run_main(main)
