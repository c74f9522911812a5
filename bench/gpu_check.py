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
import shlex
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import torch

# `make gpu-bench` runs this file as a script, so the repository root is not on sys.path by itself.
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gpu_federated_stages import fedloge_stage, paper_stage  # noqa: E402
from bench.gpu_report import FAILED, Report, progress  # noqa: E402
from bench.gpu_stage_kit import DRY, FULL, Context, Stage, clock, first_line, reset_peak_memory  # noqa: E402
from bench.gpu_stages import (device_stage, encoders_stage, pfl_stage, train_loop_stage,  # noqa: E402
                              vectorised_stage)
from utils import cli  # noqa: E402
from utils.device import pick_device  # noqa: E402
from utils.errors import TaskHetError  # noqa: E402
from utils.run_dir import git_revision  # noqa: E402
from utils.seeding import set_deterministic  # noqa: E402

DEFAULT_BUDGET_S = 480.0  # the goal's 8 minutes on one H100, imports included
DEFAULT_EVAL_SAMPLES = 10_000
DEFAULT_TRAIN_SAMPLES = 40_000


STAGES = (
    Stage("device", "the device and a bf16 matmul", 15, device_stage),
    Stage("train_loop", "step 2's loop vs a plain bf16 loop", 60, train_loop_stage),
    Stage("vectorised", "vectorised vs sequential clients", 110, vectorised_stage),
    Stage("pfl", "TaskHet vs pfl-research", 40, pfl_stage),
    Stage("paper_round", "a round of experiments/paper.yaml and the grid's cost", 140, paper_stage),
    Stage("fedloge", "FedLoGe at cifar10_lt_fedloge.yaml's sizes", 85, fedloge_stage),
)
QUICK_STAGES = (STAGES[0], Stage("encoders", "one training step of every encoder", 240, encoders_stage))


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
    parser.add_argument("--train_samples", type=cli.ints(1, 10**9), default=DEFAULT_TRAIN_SAMPLES,
                        help="train rows of the paper's manifest, read by each step-2 epoch, step-3 embedding and "
                             "step-3c reading (an assumption of the grid's projection; step 1 prints yours)")
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
    ctx = Context(report, DRY if args.dry_run else FULL, device, args.eval_samples, encoders, began,
                  train_samples=args.train_samples)
    run_stages(stages, ctx, began + args.budget_s)
    report.write()
    progress(f"[{clock(time.perf_counter() - began)}] done: {len(report.rows)} figures"
             + (f" in {out / 'gpu_check.csv'} and {out / 'gpu_check.md'}" if out is not None else ""))
    return report


if __name__ == "__main__":
    cli.run_main(main)
