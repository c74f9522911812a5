"""Issue 13's bad-input campaign as one table: every bad input stops its step as a user would see it.

Each case runs a step's ``main(argv)`` through ``utils.cli.run_main`` (a few run as subprocesses)
and must end with exit code 2 and exactly one stderr line, beginning ``error:`` and naming the
file, row, key or flag; no traceback; and every watched folder unchanged (or, where a run had
begun, marked ``INCOMPLETE``). The roots: 1 files that are not what they claim, 2 numbers from
files, 3 experiment files, 4 folders (ownership, unfinished runs, non-finite losses), 6 paths
escaping their roots, 7 ``--out`` an existing file.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

import run_pipeline
from datasets.taskonomy import TaskonomyDataset, read_manifest
from network.flower import app as flower_app
from steps import assign, embed, federated, render, select, train_centralized
from tests.fixtures import render_tiny_dataset, tiny_data_root, tiny_manifest  # noqa: F401  (session fixtures)
from utils.cli import run_main
from utils.errors import TaskHetError
from utils.loaders import INCOMPLETE

ROOT = Path(__file__).resolve().parent.parent


# ----- a finished tiny chain of steps 2, 3, 3b and 4, made once -----
@dataclass
class Chain:
    data: Path
    manifest: Path
    step2: Path
    step3: Path
    step3b: Path
    step4: Path


def step2_argv(chain: Chain, out: Path, *extra: str) -> list[str]:
    return ["--task", "depth_euclidean", "--encoder", "small_cnn", "--weights", "none", "--data_path", str(chain.data),
            "--manifest", str(chain.manifest), "--image_size", "32", "--batch_size", "8", "--n_epochs", "1",
            "--optimizer", "adamw", "--no-use_accelerator", "--out", str(out), *extra]


def step3_argv(chain: Chain, out: Path, *extra: str, checkpoint: Path | None = None) -> list[str]:
    # --allow_untrained: the chain's one epoch of step 2 may keep the untrained epoch 0, and these cases test inputs,
    # not embeddings (tests/test_step3.py tests the refusal)
    return ["--checkpoint", str(checkpoint or chain.step2 / "best.pt"), "--manifest", str(chain.manifest),
            "--data_path", str(chain.data), "--n_clusters", "2", "--n_init", "1", "--no-use_accelerator",
            "--allow_untrained", "--out", str(out), *extra]


def step3b_argv(chain: Chain, out: Path, *extra: str, manifest: Path | None = None) -> list[str]:
    return ["--manifest", str(manifest or chain.manifest), "--n_clients", "2", "--alpha", "1.0", "--out", str(out),
            *extra]


def step4_argv(chain: Chain, out: Path, *extra: str, assignments: Path | None = None,
               manifest: Path | None = None) -> list[str]:
    return ["--task", "depth_euclidean", "--data_path", str(chain.data), "--manifest", str(manifest or chain.manifest),
            "--assignments", str(assignments or chain.step3b / "assignments.csv"), "--encoder", "small_cnn",
            "--image_size", "32", "--n_rounds", "1", "--local_steps", "1", "--batch_size", "4", "--no-use_accelerator",
            "--no-progress", "--rand_seed", "1", "--out", str(out), *extra]


@pytest.fixture(scope="module")
def chain(tiny_data_root, tiny_manifest, tmp_path_factory) -> Chain:  # noqa: F811
    base = tmp_path_factory.mktemp("chain")
    made = Chain(tiny_data_root, tiny_manifest, base / "step2", base / "step3", base / "step3b", base / "step4")
    train_centralized.main(step2_argv(made, made.step2))
    embed.main(step3_argv(made, made.step3))
    assign.main(step3b_argv(made, made.step3b))
    federated.main(step4_argv(made, made.step4))
    return made


# ----- file edits the cases use -----
def copy(folder: Path, tmp: Path, name: str) -> Path:
    return Path(shutil.copytree(folder, tmp / name))


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    return path


def edited_csv(source: Path, target: Path, row: int, column: str, value: str) -> Path:
    """``source`` with one cell replaced (``row``: 0-based data row), written to ``target`` (its sidecar too)."""
    table = pd.read_csv(source, dtype=str, keep_default_na=False)
    table.loc[row, column] = value
    target.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(target, index=False)
    if source.with_suffix(".json").is_file() and source.name == "assignments.csv":
        shutil.copy(source.with_suffix(".json"), target.with_suffix(".json"))
    return target


def data_copy(chain: Chain, tmp: Path) -> Path:
    return copy(chain.data, tmp, "data")


def first_file(root: Path, domain: str) -> Path:
    return sorted((root / domain).rglob("*.*"))[0]


def first_train_row(chain: Chain) -> int:
    return int(np.flatnonzero(pd.read_csv(chain.manifest)["split"].to_numpy() == "train")[0])


def experiment(tmp: Path, edit: Callable[[dict], None] | None = None, text: str | None = None) -> list[str]:
    config = {
        "name": "tiny", "data": {"source": "synthetic", "root": str(tmp / "data"),
                                 "synthetic": {"n_buildings": 4, "n_views": 6, "image_size": 32, "seed": 0},
                                 "top_k_classes": 3, "test_fraction": 0.25, "split_by": "sample"},
        "tasks": ["depth_euclidean"], "model": {"encoder": "small_cnn", "weights": "none", "image_size": 32},
        "centralized": {"n_epochs": 1, "batch_size": 8}, "embeddings": {"n_clusters": 3},
        "partition": {"alphas": [1.0], "n_clients": 2},
        "federated": {"algorithms": {"fedavg": {}}, "n_rounds": 2, "local_steps": 2, "batch_size": 4},
        "seeds": [0], "use_accelerator": False,
    }
    if edit is not None:
        edit(config)
    path = write(tmp / "experiment.yaml", yaml.safe_dump(config) if text is None else text)
    return [str(path), "--results", str(tmp / "results")]


# ----- the table -----
@dataclass
class Case:
    """``main(argv)`` must fail naming every string of ``names``; ``watch`` folders stay as they were."""

    main: Callable | str  # a step's main, or "subprocess" for a command run as a user would
    argv: list[str]
    names: tuple[str, ...]
    watch: list[Path] = field(default_factory=list)


def pipeline_case(tmp: Path, names: tuple[str, ...], edit=None, text=None) -> Case:
    return Case(run_pipeline.main, experiment(tmp, edit, text), names, [tmp / "results", tmp / "data"])


def set_key(section: str | None, key: str, value) -> Callable[[dict], None]:
    def edit(config: dict) -> None:
        (config if section is None else config[section])[key] = value
    return edit


def case_step2_resume(chain, tmp, content: bytes) -> Case:
    out = copy(chain.step2, tmp, "run")
    write(out / "last.pt", content)
    return Case(train_centralized.main, step2_argv(chain, out), ("last.pt",), [out])


def case_step4_resume(chain, tmp, content: bytes | None = None, obj=None) -> Case:
    out = copy(chain.step4, tmp, "run")
    if obj is not None:
        torch.save(obj, out / "checkpoint.pt")
    else:
        write(out / "checkpoint.pt", content)
    return Case(federated.main, step4_argv(chain, out), ("checkpoint.pt",), [out])


def case_step3_checkpoint(chain, tmp, content: bytes | None) -> Case:
    checkpoint = tmp / "model" / "best.pt"
    if content is not None:
        write(checkpoint, content)
    return Case(embed.main, step3_argv(chain, tmp / "out", "--image_size", "32", checkpoint=checkpoint),
                ("--checkpoint", "best.pt"), [tmp / "out"])


def case_centralized(chain, tmp, content: bytes | None) -> Case:
    checkpoint = tmp / "model" / "best.pt"
    if content is not None:
        write(checkpoint, content)
    return Case(federated.main, step4_argv(chain, tmp / "out", "--init_from", "centralized", "--centralized_checkpoint",
                                           str(checkpoint)), ("--centralized_checkpoint", "best.pt"), [tmp / "out"])


def case_step1_data(chain, tmp, domain: str, content: bytes | np.ndarray) -> Case:
    root = data_copy(chain, tmp)
    target = first_file(root, domain)
    if isinstance(content, np.ndarray):
        np.save(target, content)
    else:
        write(target, content)
    argv = ["--data_path", str(root), "--top_k_classes", "3", "--test_fraction", "0.25", "--out", str(tmp / "out"),
            "--no-progress"]
    return Case(select.main, argv, (target.name,), [tmp / "out"])


def case_step2_weights(chain, tmp, name: str, content: bytes, names: tuple[str, ...]) -> Case:
    path = write(tmp / "weights" / name, content)
    return Case(train_centralized.main, step2_argv(chain, tmp / "out", "--weights", str(path)), ("--weights", name, *names),
                [tmp / "out", path])


def truncated_pth() -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save({"weight": torch.ones(64, 8)}, buffer)
    return buffer.getvalue()[: len(buffer.getvalue()) // 2]


def case_step2_png(chain, tmp) -> Case:
    root = data_copy(chain, tmp)
    target = root / pd.read_csv(chain.manifest)["rgb_path"].iloc[0]
    write(target, b"\x89PNG\r\n\x1a\n")
    return Case(train_centralized.main, step2_argv(chain, tmp / "out", "--data_path", str(root)), (target.name,),
                [tmp / "out"])


def case_assignments(chain, tmp, column: str, value: str, names: tuple[str, ...]) -> Case:
    path = edited_csv(chain.step3b / "assignments.csv", tmp / "a" / "assignments.csv", 0, column, value)
    return Case(federated.main, step4_argv(chain, tmp / "out", assignments=path), ("assignments.csv", *names),
                [tmp / "out"])


def case_assignments_file(chain, tmp, content: str, names: tuple[str, ...] = ()) -> Case:
    path = write(tmp / "a" / "assignments.csv", content)
    return Case(federated.main, step4_argv(chain, tmp / "out", assignments=path), ("assignments.csv", *names),
                [tmp / "out"])


def case_sidecar(chain, tmp, content: str, names: tuple[str, ...]) -> Case:
    path = tmp / "a" / "assignments.csv"
    write(path, (chain.step3b / "assignments.csv").read_text())
    write(path.with_suffix(".json"), content)
    return Case(federated.main, step4_argv(chain, tmp / "out", assignments=path), ("assignments.json", *names),
                [tmp / "out"])


def case_manifest(chain, tmp, column: str, value: str, names: tuple[str, ...], step: str = "2") -> Case:
    path = edited_csv(chain.manifest, tmp / "m" / "manifest.csv", first_train_row(chain), column, value)
    if step == "2":
        argv = step2_argv(chain, tmp / "out", "--manifest", str(path))
        return Case(train_centralized.main, argv, names, [tmp / "out"])
    return Case(assign.main, step3b_argv(chain, tmp / "out", manifest=path), names, [tmp / "out"])


def case_clusters(chain, tmp, row_edit: Callable[[pd.DataFrame], pd.DataFrame], names: tuple[str, ...]) -> Case:
    table = pd.read_csv(chain.step3 / "clusters.csv", dtype=str, keep_default_na=False)
    path = tmp / "c" / "clusters.csv"
    path.parent.mkdir(parents=True)
    row_edit(table).to_csv(path, index=False)
    return Case(assign.main, step3b_argv(chain, tmp / "out", "--groups", str(path)), ("clusters.csv", *names),
                [tmp / "out"])


def case_foreign_out(chain, tmp, main, argv_of, names=("is a folder of step 2",)) -> Case:
    out = copy(chain.step2, tmp, "step2")
    return Case(main, argv_of(chain, out), (str(out), *names), [out])


def case_unfinished_step2(chain, tmp, consumer: str) -> Case:
    folder = copy(chain.step2, tmp, "step2")
    write(folder / INCOMPLETE, "step 2 started and has not finished\n")
    if consumer == "step3":
        return Case(embed.main, step3_argv(chain, tmp / "out", checkpoint=folder / "best.pt"),
                    ("--checkpoint", "did not finish"), [tmp / "out", folder])
    return Case(federated.main, step4_argv(chain, tmp / "out", "--init_from", "centralized", "--centralized_checkpoint",
                                           str(folder / "best.pt")), ("--centralized_checkpoint", "did not finish"),
                [tmp / "out", folder])


def case_other_resume(chain, tmp, step: str) -> Case:
    if step == "2":
        out = copy(chain.step2, tmp, "run")
        return Case(train_centralized.main, step2_argv(chain, out, "--init_lr", "0.5"), ("last.pt", "init_lr"), [out])
    out = copy(chain.step4, tmp, "run")
    return Case(federated.main, step4_argv(chain, out, "--method", "fedprox"), ("checkpoint.pt", "different run"), [out])


def case_render_other_sizes(chain, tmp) -> Case:
    out = render_tiny_dataset(tmp / "render", n_buildings=2, n_views=3)
    argv = ["--out", str(out), "--n_buildings", "3", "--n_views", "3", "--views_per_point", "3", "--image_size", "32",
            "--workers", "1", "--no-progress"]
    return Case(render.main, argv, (str(out), "num_buildings 2 -> 3"), [out])


def case_out_is_a_file(chain, tmp, step: str) -> Case:
    out = write(tmp / "taken", "a file the user keeps\n")
    argv = {"2": lambda: step2_argv(chain, out), "3": lambda: step3_argv(chain, out),
            "3b": lambda: step3b_argv(chain, out), "4": lambda: step4_argv(chain, out)}[step]()
    main = {"2": train_centralized.main, "3": embed.main, "3b": assign.main, "4": federated.main}[step]
    return Case(main, argv, ("--out", str(out), "is a file"), [tmp])


def case_subprocess(args: list[str], names: tuple[str, ...]) -> Case:
    return Case("subprocess", [sys.executable, *args], names)


CASES = {
    # root 1: files that are not what they claim
    "1 step2 --resume: zero-byte last.pt": lambda c, t: case_step2_resume(c, t, b""),
    "1 step2 --resume: last.pt is text": lambda c, t: case_step2_resume(c, t, b"not a checkpoint\n"),
    "1 step4 --resume: zero-byte checkpoint.pt": lambda c, t: case_step4_resume(c, t, b""),
    "1 step4 --resume: checkpoint.pt of something else": lambda c, t: case_step4_resume(c, t, obj=[1, 2, 3]),
    "1 step3 --checkpoint missing": lambda c, t: case_step3_checkpoint(c, t, None),
    "1 step3 --checkpoint zero bytes": lambda c, t: case_step3_checkpoint(c, t, b""),
    "1 step3 --checkpoint is text": lambda c, t: case_step3_checkpoint(c, t, b"PK\x03\x04 garbage"),
    "1 step4 --centralized_checkpoint missing": lambda c, t: case_centralized(c, t, None),
    "1 step4 --centralized_checkpoint zero bytes": lambda c, t: case_centralized(c, t, b""),
    "1 step1 zero-byte class_scene .npy": lambda c, t: case_step1_data(c, t, "class_scene", b""),
    "1 step1 class_scene .npy of the wrong shape": lambda c, t: case_step1_data(c, t, "class_scene", np.zeros(3)),
    "1 step2 truncated rgb PNG": lambda c, t: case_step2_png(c, t),
    "1 step2 --weights zero-byte .safetensors": lambda c, t: case_step2_weights(c, t, "w.safetensors", b"", ("empty",)),
    "1 step2 --weights garbage .safetensors": lambda c, t: case_step2_weights(
        c, t, "w.safetensors", b"\x00not weights" * 20, ("not a readable safetensors file",)),
    "1 step2 --weights truncated .pth": lambda c, t: case_step2_weights(c, t, "w.pth", truncated_pth(),
                                                                         ("weights_only=True",)),
    "1 step4 empty assignments.csv": lambda c, t: case_assignments_file(c, t, "", ("empty",)),
    "1 step4 assignments.csv header only": lambda c, t: case_assignments_file(c, t, "sample_id,client_id,group,subset\n",
                                                                                ("no rows",)),
    "1 step4 assignments.json not JSON": lambda c, t: case_sidecar(c, t, "{not json", ("not valid JSON",)),
    "1 step2 empty manifest": lambda c, t: Case(train_centralized.main, step2_argv(c, t / "out", "--manifest",
                                                                                    str(write(t / "manifest.csv", ""))),
                                                 ("manifest.csv", "empty"), [t / "out"]),
    "1 step3b empty clusters.csv": lambda c, t: Case(
        assign.main, step3b_argv(c, t / "out", "--groups", str(write(t / "clusters.csv", ""))), ("clusters.csv", "empty"),
        [t / "out"]),
    "1 pipeline experiment not YAML": lambda c, t: pipeline_case(t, ("experiment.yaml", "not valid YAML"),
                                                                  text="tasks: [a\n  b: {"),
    # root 2: numbers from files
    "2 assignments client_id inf": lambda c, t: case_assignments(c, t, "client_id", "inf", ("row 2", "client_id")),
    "2 assignments client_id 1e30": lambda c, t: case_assignments(c, t, "client_id", "1e30", ("row 2", "client_id")),
    "2 assignments client_id 2.5": lambda c, t: case_assignments(c, t, "client_id", "2.5", ("row 2", "client_id")),
    "2 assignments client_id -1": lambda c, t: case_assignments(c, t, "client_id", "-1", ("row 2", "client_id")),
    "2 assignments.json n_clients 1e30": lambda c, t: case_sidecar(c, t, json.dumps({"n_clients": 1e30}), ("n_clients",)),
    "2 class_scene scores NaN": lambda c, t: case_step1_data(c, t, "class_scene", np.full(365, np.nan, np.float32)),
    "2 clusters.csv unknown sample_id": lambda c, t: case_clusters(
        c, t, lambda table: pd.concat([table, pd.DataFrame({"sample_id": ["nobody"], "cluster": ["0"]})]),
        ("nobody", "not in the manifest")),
    "2 clusters.csv cluster nan": lambda c, t: case_clusters(c, t, lambda table: table.assign(
        cluster=["nan"] + list(table["cluster"][1:])), ("row 2", "cluster")),
    "2 manifest point inf": lambda c, t: case_manifest(c, t, "point", "inf", ("manifest.csv", "point")),
    "2 manifest scene_class 1e30": lambda c, t: case_manifest(c, t, "scene_class", "1e30", ("manifest.csv", "scene_class")),
    "2 step2 --init_lr nan": lambda c, t: Case(train_centralized.main, step2_argv(c, t / "out", "--init_lr", "nan"),
                                               ("--init_lr",), [t / "out"]),
    "2 step4 --momentum inf": lambda c, t: Case(federated.main, step4_argv(c, t / "out", "--momentum", "inf"),
                                                ("--momentum",), [t / "out"]),
    # issue 21's settings: each refused before anything is written, naming the setting
    **{f"2 step4 --method {method} {' '.join(flags)}": (
        lambda c, t, method=method, flags=flags, names=names: Case(
            federated.main, step4_argv(c, t / "out", "--method", method, *flags), names, [t / "out"]))
       for method, flags, names in [
           ("fedem", ("--n_components", "0"), ("n_components",)),
           ("qfedavg", ("--q", "-1"), ("setting q ",)),
           ("fedavg", ("--weighting", "capped", "--cap", "0.01"), ("setting cap", "1/N")),
           ("cfl", ("--eps1", "2", "--eps2", "1"), ("eps1", "eps2")),
           ("pfedme", ("--lam", "-1"), ("setting lam",)),
           ("fedamp", ("--sigma", "0"), ("setting sigma",)),
           ("cfl", ("--min_size", "1"), ("min_size",)),
           ("fedem", ("--mix", "probabilities"), ("mix probabilities", "classifier head"))]},
    # root 3: experiment files, all checked before step 0
    "3 n_rounds: ten": lambda c, t: pipeline_case(t, ("federated.n_rounds",), set_key("federated", "n_rounds", "ten")),
    "3 n_rounds: 0": lambda c, t: pipeline_case(t, ("federated.n_rounds",), set_key("federated", "n_rounds", 0)),
    "3 n_clients: 0": lambda c, t: pipeline_case(t, ("partition.n_clients",), set_key("partition", "n_clients", 0)),
    "3 use_accelerator: 'no'": lambda c, t: pipeline_case(t, ("use_accelerator",), set_key(None, "use_accelerator", "no")),
    "3 hyperparameter typo": lambda c, t: pipeline_case(t, ("centralized.init_lrr",), set_key("centralized", "init_lrr", 1)),
    "3 alphas: [inf]": lambda c, t: pipeline_case(t, ("partition.alphas",), set_key("partition", "alphas", [float("inf")])),
    "3 alphas: 0.5": lambda c, t: pipeline_case(t, ("partition.alphas", "a list"), set_key("partition", "alphas", 0.5)),
    "3 alphas: ['abc']": lambda c, t: pipeline_case(t, ("partition.alphas",), set_key("partition", "alphas", ["abc"])),
    "3 seeds: ['a']": lambda c, t: pipeline_case(t, ("seeds",), set_key(None, "seeds", ["a"])),
    "3 tasks: a string": lambda c, t: pipeline_case(t, ("tasks", "a list"), set_key(None, "tasks", "depth_euclidean")),
    "3 empty experiment file": lambda c, t: pipeline_case(t, ("experiment.yaml", "empty"), text=""),
    "3 lr_schedule unknown": lambda c, t: pipeline_case(t, ("federated.lr_schedule",),
                                                         set_key("federated", "lr_schedule", "warm")),
    "3 algorithm setting of the wrong type": lambda c, t: pipeline_case(
        t, ("federated.algorithms.fedprox", "mu"), set_key("federated", "algorithms", {"fedprox": {"mu": "lots"}})),
    # root 4: folders are their step's own; unfinished runs are refused
    "4 step3 --out is step 2's folder": lambda c, t: case_foreign_out(c, t, embed.main, lambda c2, out: step3_argv(c2, out)),
    "4 step3b --out is step 2's folder": lambda c, t: case_foreign_out(c, t, assign.main, lambda c2, out: step3b_argv(c2, out)),
    "4 step4 --out is step 2's folder": lambda c, t: case_foreign_out(c, t, federated.main, lambda c2, out: step4_argv(c2, out)),
    "4 step0 over a render with other sizes": case_render_other_sizes,
    "4 step2 resume of another run": lambda c, t: case_other_resume(c, t, "2"),
    "4 step4 resume of another run": lambda c, t: case_other_resume(c, t, "4"),
    "4 step3 uses an unfinished step-2 best.pt": lambda c, t: case_unfinished_step2(c, t, "step3"),
    "4 step4 --init_from centralized, unfinished": lambda c, t: case_unfinished_step2(c, t, "step4"),
    "4 step2 loss becomes infinite": lambda c, t: Case(
        train_centralized.main, step2_argv(c, t / "out", "--init_lr", "1e6", "--optimizer", "sgd", "--momentum", "0"),
        ("loss is", "(the weights diverged", "lower --init_lr"), [t / "out"]),
    # root 6: paths escape their roots
    "6 manifest rgb_path ../../../../etc/passwd": lambda c, t: case_manifest(
        c, t, "rgb_path", "../../../../etc/passwd", ("rgb_path", "../../../../etc/passwd")),
    "6 manifest rgb_path absolute": lambda c, t: case_manifest(c, t, "rgb_path", "/etc/passwd", ("rgb_path", "/etc/passwd")),
    "6 manifest rgb_path ../x.png": lambda c, t: case_manifest(c, t, "rgb_path", "../x.png", ("rgb_path", "../x.png")),
    "6 manifest building ../x": lambda c, t: case_manifest(c, t, "building", "../x", ("building", "row"), step="3b"),
    "6 assignments sample_id ../x": lambda c, t: case_assignments(c, t, "sample_id", "../x", ("'../x'", "unknown sample id")),
    "6 assignments sample_id absolute": lambda c, t: case_assignments(c, t, "sample_id", "/etc/passwd",
                                                                      ("'/etc/passwd'", "unknown sample id")),
    "6 experiment name ../../x": lambda c, t: pipeline_case(t, ("name", "plain name"), set_key(None, "name", "../../x")),
    "6 experiment name absolute": lambda c, t: pipeline_case(t, ("name", "plain name"), set_key(None, "name", "/tmp/x")),
    "6 split CSV building ../..": lambda c, t: case_split_csv(c, t),
    # root 7: --out an existing file
    "7 step2 --out a file": lambda c, t: case_out_is_a_file(c, t, "2"),
    "7 step3 --out a file": lambda c, t: case_out_is_a_file(c, t, "3"),
    "7 step3b --out a file": lambda c, t: case_out_is_a_file(c, t, "3b"),
    "7 step4 --out a file": lambda c, t: case_out_is_a_file(c, t, "4"),
    # the Flower entry point and the scripts, as a user runs them
    "flower app: --n_rounds 0": lambda c, t: case_subprocess(["-m", "network.flower.app", "--task", "normal",
                                                               "--n_rounds", "0"], ("--n_rounds",)),
    # in this process: the case above runs the app's command as a user would (imports included) once
    "flower app: a setting of another method": lambda c, t: Case(
        flower_app.main, ["--task", "normal", "--method", "fedavg", "--mu", "0.1"], ("--mu",)),
    "flower app: --client_fraction nan": lambda c, t: Case(flower_app.main, ["--task", "normal", "--client_fraction", "nan"],
                                                           ("--client_fraction",)),
    # issue 20: Fed-LT settings and methods
    "2 step4 fedloge --tau 0": lambda c, t: Case(federated.main, step4_argv(c, t / "out", "--method", "fedloge", "--tau", "0"),
                                                 ("setting tau must be > 0",), [t / "out"]),
    "2 step4 fedloge --beta 1": lambda c, t: Case(federated.main, step4_argv(c, t / "out", "--method", "fedloge", "--beta",
                                                                             "1"), ("setting beta must be in [0, 1)",), [t / "out"]),
    **{f"3 step4 {method} on a dense task": (lambda method: lambda c, t: Case(
        federated.main, step4_argv(c, t / "out", "--method", method),
        (f"{method} trains classifier heads", "depth_euclidean is a dense task"), [t / "out"]))(method)
       for method in ("fedloge", "fedrod", "fedbabu")},
    "3 step4 --local_test proportional on a dense task": lambda c, t: Case(
        federated.main, step4_argv(c, t / "out", "--local_test", "proportional"), ("--local_test proportional",),
        [t / "out"]),
    "2 step1 cifar --imbalance_factor 0": lambda c, t: Case(
        select.main, ["--family", "cifar", "--dataset", "cifar10", "--data_path", str(t / "cifar"), "--imbalance_factor",
                      "0", "--out", str(t / "out")], ("--imbalance_factor", "(0, 1]"), [t / "out"]),
    "2 step1 cifar --imbalance_factor 1.5": lambda c, t: Case(
        select.main, ["--family", "cifar", "--dataset", "cifar10", "--data_path", str(t / "cifar"), "--imbalance_factor",
                      "1.5", "--out", str(t / "out")], ("--imbalance_factor", "(0, 1]"), [t / "out"]),
    "run_pipeline.py: experiment file missing": lambda c, t: case_subprocess(
        ["run_pipeline.py", str(t / "none.yaml"), "--results", str(t / "results")], ("none.yaml", "does not exist")),
}


def case_split_csv(chain, tmp) -> Case:
    root = data_copy(chain, tmp)
    split = root / "train_val_test_synthetic.csv"
    edited_csv(split, split, 0, "id", "../..")
    argv = ["--data_path", str(root), "--top_k_classes", "3", "--out", str(tmp / "out"), "--no-progress"]
    return Case(select.main, argv, ("split CSV", "row 2", "'../..'"), [tmp / "out"])


def snapshot(folder: Path) -> dict[str, tuple[int, int]] | None:
    if not folder.exists():
        return None
    if folder.is_file():
        return {"": (folder.stat().st_size, folder.stat().st_mtime_ns)}
    return {str(path.relative_to(folder)): (path.stat().st_size, path.stat().st_mtime_ns)
            for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_error_line(name, chain, tmp_path, capsys):
    case = CASES[name](chain, tmp_path)
    before = {path: snapshot(path) for path in case.watch}
    if case.main == "subprocess":
        result = subprocess.run(case.argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
        code, err = result.returncode, result.stderr
    else:
        with pytest.raises(SystemExit) as exit_info:
            run_main(case.main, case.argv)
        code, err = exit_info.value.code, capsys.readouterr().err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("error:")]
    assert code == 2, err
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    for expected in case.names:
        assert expected in lines[0], (expected, lines[0])
    for path, earlier in before.items():
        assert snapshot(path) == earlier or (path / INCOMPLETE).is_file(), f"{path} changed and is not marked incomplete"


def test_the_table_covers_every_root():
    roots = {name.split()[0] for name in CASES}
    assert {"1", "2", "3", "4", "6", "7"} <= roots and len(CASES) >= 40


# ----- beyond the table: what a refused or failed run leaves, and the symlink decision -----
def test_a_step2_run_that_fails_stays_incomplete_and_step3_refuses_it(chain, tmp_path):
    out = tmp_path / "diverged"
    with pytest.raises(TaskHetError, match=r"epoch 1: the val loss is nan \(the weights diverged"):
        train_centralized.main(step2_argv(chain, out, "--init_lr", "1e6", "--optimizer", "sgd", "--momentum", "0"))
    assert (out / INCOMPLETE).is_file() and (out / "best.pt").is_file()  # epoch 0's model, not to be used
    with pytest.raises(TaskHetError, match="did not finish"):
        embed.main(step3_argv(chain, tmp_path / "embed", checkpoint=out / "best.pt"))
    assert not (chain.step2 / INCOMPLETE).exists() and not (chain.step4 / INCOMPLETE).exists()


def test_a_refused_resume_leaves_config_json_as_it_was(chain, tmp_path):
    out = copy(chain.step2, tmp_path, "run")
    before = (out / "config.json").read_bytes()
    with pytest.raises(TaskHetError, match="other arguments"):
        train_centralized.main(step2_argv(chain, out, "--task", "normal"))
    assert (out / "config.json").read_bytes() == before


def test_a_symlink_inside_the_data_root_is_followed(chain, tmp_path):
    """Decision (README, "What TaskHet guarantees"): paths written in files must stay inside the root as
    written, but a symbolic link the owner put inside the data root (a domain on another disk) is followed."""
    elsewhere = copy(chain.data / "rgb", tmp_path, "other_disk_rgb")
    root = tmp_path / "root"
    root.mkdir()
    for entry in chain.data.iterdir():
        (root / entry.name).symlink_to(elsewhere if entry.name == "rgb" else entry)
    manifest = read_manifest(chain.manifest)
    dataset = TaskonomyDataset(root, manifest.head(2), ["depth_euclidean"], 32)
    assert dataset[0]["rgb"].shape == (3, 32, 32)
    escaped = manifest.head(1).assign(rgb_path="rgb/../../" + str(elsewhere.name) + "/x.png")
    with pytest.raises(TaskHetError, match="without '..'"):
        TaskonomyDataset(root, escaped, ["depth_euclidean"], 32)


def test_every_experiment_key_has_a_type():
    from pipeline.studies.main_job.config import FREE_FORM, SCHEMA
    from pipeline.studies.main_job.config import TYPES

    def leaves(section: dict, prefix: str = "") -> set[str]:
        keys = set()
        for key, value in section.items():
            dotted = prefix + key
            keys |= leaves(value, dotted + ".") if isinstance(value, dict) and dotted not in FREE_FORM else {dotted}
        return keys

    assert leaves(SCHEMA) == set(TYPES)
