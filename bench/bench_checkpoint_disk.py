"""Benchmark: disk use of the demo's run folders, with checkpoints that name the frozen encoder vs hold it.

The demo's model settings (EfficientNet-Lite0, ImageNet weights, frozen, cached features, 32 px,
decoder width 32) on a small synthetic render: step 2 per task (one epoch), then step 4 per task and
algorithm (the demo's fedavg, fedprox, scaffold and fedrep; 10 clients, every one sampled so that every
client state exists, as after the demo's 55 rounds) for a few rounds. For every run folder it prints its
bytes on disk and what its checkpoints would take written whole (each read back with its frozen encoder
put back and saved again), and projects both to the demo's grid: 2 step-2 runs and 216 step-4 runs
(108 per task, 27 per task and algorithm).

Run from an older checkout (no ``models.frozen_encoder``) it measures the files that code writes, whole.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

# `make bench` runs this file as a script, so the repository root is not on sys.path by itself.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pandas as pd  # noqa: E402
import torch  # noqa: E402

import test_fed  # noqa: E402
from partitioning.assignments import write_assignments  # noqa: E402
from steps import train_centralized as step2  # noqa: E402
from tests.fixtures import make_tiny_manifest, render_tiny_dataset  # noqa: E402
from utils.cli import positive_int, run_main  # noqa: E402
from utils.run_dir import atomic_torch_save, load_checkpoint  # noqa: E402

try:
    from models.frozen_encoder import load_full_checkpoint  # noqa: E402
except ImportError:  # a checkout from before: its checkpoints are whole already
    load_full_checkpoint = load_checkpoint

MODEL = ["--encoder", "efficientnet_lite0", "--weights", "imagenet", "--freeze_encoder", "--cache_features",
         "--image_size", "32", "--decoder_width", "32"]
TASKS = ("normal", "class_scene")
METHODS = ("fedavg", "fedprox", "scaffold", "fedrep")
DEMO_STEP2_RUNS, DEMO_STEP4_RUNS = 2, 216


def folder_bytes(folder: Path) -> int:
    """Bytes of every file under ``folder`` (apparent sizes)."""
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def whole_bytes(folder: Path) -> int:
    """``folder``'s bytes with each checkpoint (*.pt) written whole instead."""
    total = folder_bytes(folder)
    with tempfile.TemporaryDirectory() as scratch:
        for path in folder.rglob("*.pt"):
            again = Path(scratch) / path.name
            atomic_torch_save(load_full_checkpoint(path), again)
            total += again.stat().st_size - path.stat().st_size
    return total


def assignments(manifest: Path, out: Path, n_clients: int) -> Path:
    """Round-robin clients over the manifest's train rows; every third row of a client is client-test."""
    train = pd.read_csv(manifest).query("split == 'train'").sort_values("sample_id").reset_index(drop=True)
    table = pd.DataFrame({"sample_id": train["sample_id"], "client_id": train.index % n_clients,
                          "group": train["scene_class"],
                          "subset": ["test" if (index // n_clients) % 3 == 2 else "train" for index in train.index]})
    path = out / "assignments.csv"
    write_assignments(path, table, {"scheme": "round_robin", "alpha": 1.0, "n_clients": n_clients, "groups": "scene_class"})
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="work folder (default: a temporary one, removed)")
    parser.add_argument("--rounds", type=positive_int, default=2, help="step-4 rounds (default: 2)")
    parser.add_argument("--n_clients", type=positive_int, default=10, help="clients (default: 10, the demo's)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads (default: 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    work = Path(args.out or tempfile.mkdtemp(prefix="bench_checkpoint_disk_"))
    try:
        root = render_tiny_dataset(work / "data", n_buildings=12, n_views=10, image_size=32)
        manifest = make_tiny_manifest(root, work / "step1", top_k=12)
        table = assignments(manifest, work / "assignments", args.n_clients)
        common = ["--data_path", str(root), "--manifest", str(manifest), "--cache_dir", str(work / "cache"),
                  "--no-use_accelerator", *MODEL]
        rows = []
        for task in TASKS:
            out = work / "step2" / task
            step2.main(["--task", task, "--n_epochs", "1", "--batch_size", "32", "--out", str(out), "--no-progress",
                        *common])
            rows.append(("step 2", task, "-", folder_bytes(out), whole_bytes(out), DEMO_STEP2_RUNS / len(TASKS)))
            for method in METHODS:
                out = work / "step4" / task / method
                test_fed.main(["--task", task, "--method", method, "--assignments", str(table), "--out", str(out),
                               "--n_rounds", str(args.rounds), "--local_steps", "10", "--batch_size", "16",
                               "--client_fraction", "1", "--no-progress", *common])
                rows.append(("step 4", task, method, folder_bytes(out), whole_bytes(out),
                             DEMO_STEP4_RUNS / len(TASKS) / len(METHODS)))
        print(f"{'step':<7}{'task':<12}{'method':<10}{'now MB':>10}{'whole MB':>10}{'ratio':>8}{'demo runs':>11}")
        now_total = whole_total = 0.0
        for step, task, method, now, whole, runs in rows:
            print(f"{step:<7}{task:<12}{method:<10}{now / 1e6:>10.2f}{whole / 1e6:>10.2f}{whole / now:>8.1f}{runs:>11.0f}")
            now_total += now * runs
            whole_total += whole * runs
        print(f"demo projection ({DEMO_STEP2_RUNS} step-2 + {DEMO_STEP4_RUNS} step-4 run folders): "
              f"{now_total / 1e9:.3f} GB now, {whole_total / 1e9:.3f} GB whole ({whole_total / now_total:.1f}x)")
    finally:
        if args.out is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")
    run_main(main)
