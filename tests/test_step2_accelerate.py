"""Step 2 through accelerate: --mixed_precision, and data-parallel processes under `accelerate launch`.

The two-process runs are real: `accelerate launch --multi_gpu --num_processes 2` starts two processes
through torchrun, and `--no-use_accelerator` makes accelerate join them on the CPU with gloo
(`accelerate launch --cpu --num_processes 2` would start one process: accelerate's CPU multi-process
launch needs MPI). The model is small_cnn, whose only normalisation is GroupNorm (per sample): its
training in two processes of 4 samples computes what one process does on the 8 samples, so the two
runs agree within float rounding. A model with BatchNorm would not: each process normalises with its own
slice's statistics (README, "Several GPUs and mixed precision").

The runs use SGD with momentum 0.9: the largest weight difference between one and two processes was
1.6e-7. With AdamW it was 2e-5 on a weight of 1e-4 whose gradient is at rounding level: Adam divides
by sqrt(v), so such entries move by about the learning rate whatever the rounding (seen, not a bug).
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

import training.fit
from datasets.digits import select_digits
from steps import train_centralized as step2
from utils.errors import TaskHetError
from utils.run_dir import load_checkpoint
from tests.fixtures import Killed, die_after_saving

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def digits88(tmp_path_factory):
    """88 digits: 56 train rows outside the validation part (7 global batches of 8, no short last batch), 10 val, 22 test."""
    manifest = tmp_path_factory.mktemp("digits88") / "manifest.csv"
    select_digits(0.25, seed=0, n_samples=88).to_csv(manifest, index=False)
    return manifest


def argv(manifest, out, *extra):
    return ["--task", "digit_class", "--encoder", "small_cnn", "--weights", "none", "--manifest", str(manifest),
            "--image_size", "16", "--batch_size", "8", "--optimizer", "sgd", "--init_lr", "0.1", "--n_epochs", "2",
            "--seed", "3", "--no-use_accelerator", "--no-progress", "--no-plots", "--out", str(out), *extra]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch_two_processes(args: list[str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), str(ROOT / "train_centralized_task_model.py"), *args, "--threads", "1"]
    # faulthandler prints each rank's Python stack on SIGABRT: a rank aborted rarely under load ("terminate called
    # without an active exception"), and its stack is what the next occurrence must show (docs/BENCHMARKS.md).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def both_ends(text: str, keep: int = 3000) -> str:
    """The start and the end of a long stderr: torchrun's summary of a failed rank would push the rank's own
    traceback out of a tail alone."""
    return text if len(text) <= 2 * keep else f"{text[:keep]}\n[...]\n{text[-keep:]}"


def assert_same_run(expected: Path, actual: Path) -> None:
    """Same model, momentum buffers, loader RNG and state in last.pt, and metrics.csv equal within float rounding."""
    want, got = load_checkpoint(expected / "last.pt"), load_checkpoint(actual / "last.pt")
    assert torch.equal(got["rng"]["train_loader"], want["rng"]["train_loader"])  # integers: the same draws exactly
    # The state's counters must agree exactly; its float fields (best_val_loss) come from a loss summed over one
    # process or gathered from two, a different order of additions, so they agree within the rounding of float32
    # sums of a few dozen terms (rel 1e-6 covers it; AVX-512 and AVX2 kernels differ in the last bits).
    assert got["state"].keys() == want["state"].keys()
    for key, value in want["state"].items():
        if isinstance(value, float):
            assert got["state"][key] == pytest.approx(value, rel=1e-6), key
        else:
            assert got["state"][key] == value, key
    assert got["model"].keys() == want["model"].keys()  # the unwrapped model: no DDP "module." prefix
    for key, value in want["model"].items():
        torch.testing.assert_close(got["model"][key], value, rtol=1e-4, atol=1e-5, msg=key)
    for index, moments in want["optimizer"]["state"].items():
        torch.testing.assert_close(got["optimizer"]["state"][index]["momentum_buffer"], moments["momentum_buffer"],
                                   rtol=1e-4, atol=1e-6)
    want_rows, got_rows = pd.read_csv(expected / "metrics.csv"), pd.read_csv(actual / "metrics.csv")
    assert got_rows[["epoch", "split", "metric"]].equals(want_rows[["epoch", "split", "metric"]])  # one writer: no duplicates
    assert got_rows.value.to_numpy() == pytest.approx(want_rows.value.to_numpy(), rel=1e-5, abs=1e-6)


@pytest.fixture(scope="module")
def one_process(digits88, tmp_path_factory):
    """The reference: step 2 in this process, global batch 8."""
    out = tmp_path_factory.mktemp("one_process") / "run"
    step2.main(argv(digits88, out))
    losses = pd.read_csv(out / "metrics.csv").query("split == 'train' and metric == 'loss'").value
    assert losses.iloc[-1] < losses.iloc[0]  # the run trains: equal runs that never moved would prove nothing
    return out


@pytest.mark.slow
def test_two_processes_train_what_one_process_trains(digits88, one_process, tmp_path):
    out = tmp_path / "two"
    result = launch_two_processes(argv(digits88, out))
    assert result.returncode == 0, both_ends(result.stderr)
    assert_same_run(one_process, out)
    config = json.loads((out / "config.json").read_text())
    assert config["args"]["num_processes"] == 2 and config["args"]["mixed_precision"] == "no"
    log = (out / "run.log").read_text()
    assert log.count("epoch 2/2") == 1 and "2 process(es)" in log  # only the main process logs
    assert load_checkpoint(out / "best.pt")["epoch"] == load_checkpoint(one_process / "best.pt")["epoch"]



@pytest.mark.slow
def test_run_stopped_in_one_process_resumes_in_two(digits88, one_process, tmp_path, monkeypatch):
    out = tmp_path / "resumed"
    die_after_saving(monkeypatch, training.fit)
    with pytest.raises(Killed):
        step2.main(argv(digits88, out))
    assert load_checkpoint(out / "last.pt")["state"]["epoch"] == 1
    result = launch_two_processes(argv(digits88, out))
    assert result.returncode == 0, both_ends(result.stderr)
    assert "resuming from" in (out / "run.log").read_text()
    assert_same_run(one_process, out)


def test_global_batch_not_divisible_by_the_processes_is_refused(digits88, tmp_path, monkeypatch):
    """Each rank refuses before it joins the process group (so none waits for the others): in this process, as torchrun
    would have started it (WORLD_SIZE=2, what `accelerate launch --num_processes 2` sets)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "odd"
    with pytest.raises(TaskHetError, match=r"^--batch_size 7 is the global batch: it must be a multiple of the 2 "
                                           r"processes$"):
        step2.main(argv(digits88, out) + ["--batch_size", "7"])
    assert not out.exists()


def forward_dtypes(mixed_precision: str, digits88, tmp_path, monkeypatch) -> set:
    """The dtypes of small_cnn's first convolution outputs over a 1-epoch step-2 run (training and evaluation)."""
    seen = set()
    real_build = step2.build_task_model

    def build_and_watch(*args, **kwargs):
        model = real_build(*args, **kwargs)
        first_conv = next(module for module in model.modules() if isinstance(module, torch.nn.Conv2d))
        first_conv.register_forward_hook(lambda module, inputs, output: seen.add(output.dtype))
        return model

    monkeypatch.setattr(step2, "build_task_model", build_and_watch)
    out = tmp_path / mixed_precision
    summary = step2.main(argv(digits88, out, "--n_epochs", "1", "--mixed_precision", mixed_precision))
    assert json.loads((out / "config.json").read_text())["args"]["mixed_precision"] == mixed_precision
    assert summary["epochs_done"] == 1 and pd.read_csv(out / "metrics.csv").value.notna().all()
    return seen


def test_bf16_on_the_cpu_runs_the_forward_in_bf16(digits88, tmp_path, monkeypatch):
    assert forward_dtypes("bf16", digits88, tmp_path, monkeypatch) == {torch.bfloat16}
    assert forward_dtypes("no", digits88, tmp_path, monkeypatch) == {torch.float32}


def test_default_precision_and_refusals(digits88, tmp_path, monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    args = step2.resolve(step2.build_parser().parse_args(argv(digits88, tmp_path / "a")))
    assert args.mixed_precision == "no"  # --no-use_accelerator: the CPU, where bf16 is slower than float32
    with pytest.raises(TaskHetError, match="--mixed_precision fp16 needs a GPU .*use bf16 or no"):
        step2.main(argv(digits88, tmp_path / "b", "--mixed_precision", "fp16"))
    assert not (tmp_path / "b").exists()
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # what `accelerate launch --mixed_precision bf16` sets
    args = step2.resolve(step2.build_parser().parse_args(argv(digits88, tmp_path / "c")))
    assert args.mixed_precision == "bf16"
    with pytest.raises(TaskHetError, match="--mixed_precision no contradicts accelerate launch --mixed_precision bf16"):
        step2.main(argv(digits88, tmp_path / "d", "--mixed_precision", "no"))
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    monkeypatch.setenv("WORLD_SIZE", "2")  # launched by torchrun, but accelerate left on a GPU that is not there
    with pytest.raises(TaskHetError, match="launched as 2 processes, but accelerate sees 1: .*--no-use_accelerator"):
        step2.main(argv(digits88, tmp_path / "e")[:-3] + ["--use_accelerator", "--out", str(tmp_path / "e")])


def test_the_search_and_the_pipeline_refuse_several_processes(digits88, tmp_path, monkeypatch):
    import run_pipeline
    from steps import search_centralized

    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun sets in each process of `accelerate launch --num_processes 2`
    with pytest.raises(TaskHetError, match="search_centralized_hparams.py runs in one process: accelerate launch "
                                           r"\(several processes\) is for train_centralized_task_model.py"):
        search_centralized.main(["--task", "digit_class", "--encoder", "small_cnn", "--weights", "none", "--manifest",
                                 str(digits88), "--lrs", "0.1", "--out", str(tmp_path / "search")])
    assert not (tmp_path / "search").exists()
    with pytest.raises(TaskHetError, match="run_pipeline.py runs in one process"):
        run_pipeline.main([str(ROOT / "experiments" / "digits.yaml"), "--results", str(tmp_path / "results")])
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("world_size, printed", [("2", ""), ("1", "after\nfinalized\n"), ("", "after\nfinalized\n")])
def test_a_launched_rank_leaves_without_finalizing(world_size, printed):
    """Ranks of a multi-process launch end at once (no atexit, no native teardown); a plain run goes on and exits."""
    code = ("import atexit; from utils.cli import leave_launched_process; "
            "atexit.register(lambda: print('finalized')); leave_launched_process(); print('after')")
    env = {key: value for key, value in os.environ.items() if key != "WORLD_SIZE"}
    if world_size:
        env["WORLD_SIZE"] = world_size
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout) == (0, printed), result.stderr
