"""The GPU check's stages that time one piece: the device (1), step 2's training loop (2), vectorised clients (3),
TaskHet against pfl-research (4), and ``--quick``'s one step of every encoder. The stages of whole federated
rounds are in bench/gpu_federated_stages.py; the runner and the command line in bench/gpu_check.py."""

from __future__ import annotations

import math
import subprocess
import traceback

import torch

from bench import bench_train_loop, vectorized_cases, vectorized_pfl
from bench.gpu_report import FAILED
from bench.gpu_stage_kit import (DENSE_TASK, Context, Steps, first_line, repeated, reset_peak_memory,
                                 synced_seconds)
from utils.device import prepare_model
from utils.errors import TaskHetError


# Dense bf16 tensor-core peaks (without sparsity) from NVIDIA's data sheets, matched as substrings of the device
# name in this order (a longer name first: "H100 PCIe" before "H100", "GH200" before "H200", "L40S" before "L4").
BF16_PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("GH200", 989.0), ("H200", 989.0), ("H100", 989.0),
                    ("A100", 312.0), ("L40S", 362.0), ("L4", 121.0))



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
        timing = vectorized_cases.measure(model, count, count, plan.vector_rounds, ctx.device, item_reads=False,
                                          batch_size=plan.vector_batch)
        batch = f"batch {plan.vector_batch}" if plan.vector_batch else "bench_vectorized.py's batch"
        detail = (f"FedAvg, {count} clients × {vectorized_cases.STEPS} local steps, {batch}, whole-round chunks, "
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
    missing = vectorized_pfl.pfl_unavailable()
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
        rates = vectorized_pfl.taskhet_and_pfl(count, count, ctx.plan.pfl_rounds, ctx.device, False)
        detail = (f"tiny MLP, FedAvg, {count} clients × {vectorized_cases.STEPS} local steps, "
                  f"{ctx.plan.pfl_rounds} rounds")
        ctx.add(f"k{count}_pfl", rates["pfl"], "rounds/s", detail + "; pfl on its default device")
        ctx.add(f"k{count}_sequential_over_pfl", rates["sequential"] / rates["pfl"], "×", detail)
        ctx.add(f"k{count}_vectorised_over_pfl", rates["vectorised"] / rates["pfl"], "×", detail + "; goal ≥ 1")
        steps.finish()


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
