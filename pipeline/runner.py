"""run_pipeline.py's engine: steps 1–4 for every combination of an experiment, then the report.

Each step is run by calling the ``main(argv)`` of its ``steps`` module, the same function
the numbered script a user runs by hand calls, so the pipeline and the scripts cannot drift
apart. Every step's
folder name carries a hash of its parameters and inputs (pipeline/stages.py):
finished steps are skipped on a rerun, an unfinished step 4 resumes from its
checkpoint, and a changed setting gets a new folder instead of overwriting.

Layout under ``results/<experiment name>/``::

    data/<key>/                         synthetic buildings (data.source: synthetic; digits needs no data folder)
    step1-<key>/manifest.csv
    centralized/<task>-<key>/           step 2 run folder (best.pt)
    embeddings/<task>-<key>/            step 3 (clusters.csv, diagnostics)
    assignments/<task|labels>/<grouping>-a<α>-s<seed>-<key>/   step 3b
    federated/<task>/<grouping>/a<α>/<algorithm>/s<seed>-<key>/ step 4 run folder
    report.md, report.csv, *.png
"""

from __future__ import annotations

import importlib
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pandas as pd
from tqdm.auto import tqdm

from models.tasks import get_task
from network.algorithms.base import ALGORITHMS
from network.run_outputs import METRICS_COLUMNS
from partitioning.client_tests import TEST_SPLIT
from partitioning.groupings import EMBEDDING_BASED, GROUPINGS, IID_REFERENCE
from pipeline.checks import check_input_files
from pipeline.experiment import DATA_SOURCES, Combination, combinations, split_csv_path, task_federated
from pipeline.pool import PoolStage, pool_summary, run_in_workers
from pipeline.report import write_report
from pipeline.run_results import best_validation_loss, final_personal_loss, global_test_history, personal_test_history
from pipeline.stages import is_done, run_stage, stage_key
from steps import assign as step3b
from steps import embed as step3
from steps import federated as step4
from steps import meter as step3c
from steps.meter import METER_FILE
from steps import render
from steps import select as step1
from steps import train_centralized as step2
from utils.loaders import load_json, read_csv


@dataclass
class Pipeline:
    """Runs one experiment (a validated config from pipeline.experiment.load_experiment)."""

    config: dict[str, Any]
    out_dir: Path
    command: str
    progress: tqdm | None = None
    jobs: int = 1  # step-4 runs at once (separate processes); 1 runs them in this process
    threads: int | None = None  # torch threads of every step (passed as --threads, so config.json records it)
    show_progress: bool = True  # the top-level bar (run_pipeline.py --no-progress, or stdout not a terminal: off)

    def step(self, name: str, stage_dir: Path, params: dict[str, Any], script: Callable, argv: list[str]) -> Path:
        """Run one script unless its stage is done; advances the top-level progress bar."""
        if self.progress is not None:
            self.progress.set_description(name)
        run_stage(stage_dir, params, lambda: script.main(argv + self.shared_flags(script)))
        if self.progress is not None:
            self.progress.update(1)
        return stage_dir

    def shared_flags(self, script: Callable) -> list[str]:
        """Flags that change speed or console output, not results (so not part of any stage key).

        Every step runs without its own bars (the pipeline's bar counts steps); step 4 keeps its per-round
        lines in run.log and prints one line per run, so a grid of hundreds of runs prints hundreds of lines,
        not one per round.
        """
        shared = ["--no-progress"] + ([] if self.threads is None else ["--threads", str(self.threads)])
        if script in (step2, step3, step3c, step4):
            # One decoded-sample cache for the experiment: PNGs are decoded once, not once per run.
            shared += ["--cache_dir", str(self.out_dir / "cache")]
        if script is step4:
            shared.append("--no-round_lines")
        return shared

    # ----- steps -----
    def data_root(self) -> Path:
        data = self.config["data"]
        if data["source"] != "synthetic":
            return Path(data["root"])
        params = dict(data["synthetic"])
        stage_dir = Path(data["root"]) / stage_key(params, [])
        argv = ["--out", str(stage_dir), *flags(params)]
        return self.step("render synthetic buildings", stage_dir, params, render, argv)

    def manifest(self, root: Path) -> Path:
        data = self.config["data"]
        family = DATA_SOURCES[data["source"]]
        params = {"family": family, "test_fraction": data["test_fraction"], "seed": self.config["seeds"][0]}
        if family == "cifar":  # CIFAR's test set is fixed: no test_fraction; the validation part comes from train
            params = {"family": family, "dataset": data["source"], "data_path": str(root), "seed": params["seed"],
                      **{key: data[key] for key in ("imbalance_factor", "val_fraction", "verify_checksums")
                         if data[key] is not None}}
        elif family == "digits":
            params["n_samples"] = data["n_samples"]
            if data["imbalance_factor"] is not None:
                params["imbalance_factor"] = data["imbalance_factor"]
        else:
            params.update(data_path=str(root), tasks=self.config["tasks"], top_k_classes=data["top_k_classes"],
                          split_by=data["split_by"])
        inputs = []
        if data["source"] == "taskonomy":
            # Step 1's --client_file_name has data.split_csv's meaning: relative to the data root unless absolute.
            params["client_file_name"] = data["split_csv"]
            inputs.append(split_csv_path(data))
        if data["buildings"]:
            params["taskonomy_clients_to_include"] = ",".join(data["buildings"])
        stage_dir = self.out_dir / f"step1-{stage_key(params, inputs, self.out_dir)}"
        self.step("step 1: select samples", stage_dir, params, step1, ["--out", str(stage_dir), *flags(params)])
        return stage_dir / "manifest.csv"

    def centralized(self, task: str, root: Path, manifest: Path, seed: int | None = None) -> Path:
        """Step 2 for ``task`` with ``seed`` (default: the experiment's first seed)."""
        params = {
            "task": task, "data_path": str(root), "manifest": str(manifest),
            "seed": self.config["seeds"][0] if seed is None else seed,
            "use_accelerator": self.config["use_accelerator"], **self.config["model"], **self.config["centralized"],
        }
        stage_dir = self.out_dir / "centralized" / f"{task}-{stage_key(params, [manifest], self.out_dir)}"
        self.step(f"step 2: train {task}", stage_dir, params, step2, ["--out", str(stage_dir), *flags(params)])
        return stage_dir

    def clusters(self, task: str, root: Path, manifest: Path, model_dir: Path) -> Path:
        params = {
            "checkpoint": str(model_dir / "best.pt"), "manifest": str(manifest), "data_path": str(root),
            "seed": self.config["seeds"][0], **self.config["embeddings"],
        }
        stage_dir = self.out_dir / "embeddings" / f"{task}-{stage_key(params, [manifest, model_dir / 'best.pt'], self.out_dir)}"
        self.step(f"step 3: embed + cluster {task}", stage_dir, params, step3, ["--out", str(stage_dir), *flags(params)])
        return stage_dir

    def assignments(self, owner: str, grouping: str, groups: str | None, alpha: float, seed: int, manifest: Path) -> Path:
        partition = self.config["partition"]
        iid = grouping == IID_REFERENCE
        params = {
            "manifest": str(manifest), "groups": groups, "scheme": "iid" if iid else partition["scheme"],
            "alpha": None if iid else alpha, "n_clients": partition["n_clients"],
            "size_skew": partition["size_skew"], "seed": seed,
            **partition["skews"],  # per-client feature skew / concept shift (partitioning/skews.py), iid reference too
        }
        # Only a test_split run names --client_tests: the stage keys of held-out runs stay as they were.
        params.update({"client_tests": TEST_SPLIT} if partition["client_tests"] == TEST_SPLIT
                      else {"client_test_fraction": partition["client_test_fraction"]})
        if partition.get("temporal") and not iid:  # only then: the stage keys of static partitions stay as they were
            params.update(temporal=partition["temporal"], n_rounds=self.config["federated"]["n_rounds"])
        inputs = [manifest] + ([Path(groups)] if grouping == EMBEDDING_BASED else [])
        name = f"{grouping}-s{seed}" if iid else f"{grouping}-a{alpha:g}-s{seed}"
        stage_dir = self.out_dir / "assignments" / owner / f"{name}-{stage_key(params, inputs, self.out_dir)}"
        self.step(f"step 3b: {name}", stage_dir, params, step3b, ["--out", str(stage_dir), *flags(params)])
        return stage_dir

    def meter(self, task: str, grouping: str, alpha: float, seed: int, root: Path, manifest: Path, assignments: Path,
              model_dir: Path) -> PoolStage:
        """Step 3c's stage: G² and B² of one partition's clients at the task's centralized model (run later by
        :meth:`run_pooled`, beside the federated runs: 48 readings one after another were a minute of one core)."""
        return self.meter_stage(f"meter {task} {grouping} α={alpha:g} seed {seed}",
                                self.out_dir / "heterogeneity" / task / f"{grouping}-a{alpha:g}-s{seed}",
                                root, manifest, assignments, model_dir)

    def meter_stage(self, label: str, stage_prefix: Path, root: Path, manifest: Path, assignments: Path,
                    model_dir: Path) -> PoolStage:
        """Step 3c's stage of one partition (``assignments``) at one step-2 model; its folder is ``stage_prefix``
        plus ``-<stage key>`` (the main job's and a study's meters differ in label and folder only)."""
        params = {"checkpoint": str(model_dir / "best.pt"), "manifest": str(manifest),
                  "assignments": str(assignments / "assignments.csv"), "data_path": str(root),
                  "use_accelerator": self.config["use_accelerator"], "cache_features": self.config["model"]["cache_features"]}
        inputs = [manifest, assignments / "assignments.csv", model_dir / "best.pt"]
        stage_dir = stage_prefix.with_name(f"{stage_prefix.name}-{stage_key(params, inputs, self.out_dir)}")
        return PoolStage(f"step 3c: {label}", stage_dir, params, ["--out", str(stage_dir), *flags(params)],
                         script=step3c.__name__)

    def federated(self, combination: Combination, root: Path, manifest: Path, assignments: Path,
                  model_dir: Path) -> PoolStage:
        """Step 4's stage of one combination (run later by :meth:`run_pooled`)."""
        federated = task_federated(self.config, combination.task)
        hyper = self.config["federated"]["algorithms"][combination.algorithm] or {}
        params = {
            "task": combination.task, "method": combination.algorithm, "rand_seed": combination.seed,
            "alpha": None if combination.grouping == IID_REFERENCE else combination.alpha,
            "data_path": str(root), "manifest": str(manifest),
            "assignments": str(assignments / "assignments.csv"), "encoder": self.config["model"]["encoder"],
            # the same pretrained weights and decoder as step 2's model, for runs that start from scratch
            "weights": self.config["model"]["weights"], "decoder_width": self.config["model"]["decoder_width"],
            "freeze_encoder": self.config["model"]["freeze_encoder"], "cache_features": self.config["model"]["cache_features"],
            "image_size": self.config["model"]["image_size"], "use_accelerator": self.config["use_accelerator"],
            **federated, **hyper,
        }
        if federated["init_from"] == "centralized":
            params["centralized_checkpoint"] = str(model_dir / "best.pt")
        c = combination
        partition = c.grouping if c.grouping == IID_REFERENCE else Path(c.grouping, f"a{c.alpha:g}")
        stage_dir = (self.out_dir / "federated" / c.task / partition / c.algorithm
                     / f"s{c.seed}-{stage_key(params, [manifest, assignments / 'assignments.csv'], self.out_dir)}")
        argv = ["--out", str(stage_dir), "--resume", *flags(params)]
        return PoolStage(f"step 4: {c.label()}", stage_dir, params, argv)

    def run_pooled(self, stages: list[PoolStage]) -> None:
        """Every step-3c reading and step-4 run: here one after another, or ``jobs`` at a time in worker processes.

        Stages are independent (each has its own seed-derived draws), so the order changes nothing but
        the floating-point rounding of a different thread count. The first failure stops the rest.
        """
        if self.jobs == 1:
            for stage in stages:
                self.step(stage.name, stage.stage_dir, stage.params, importlib.import_module(stage.script), stage.argv)
            return
        pending = [stage for stage in stages if not is_done(stage.stage_dir)]
        # Said once on the console too: with no bars (--no-progress, or stdout not a terminal) nothing else shows it.
        print(pool_summary(pending, self.jobs))
        if self.progress is not None:
            self.progress.update(len(stages) - len(pending))
            self.progress.set_description(pool_summary(pending, self.jobs))
        run_in_workers(pending, self.jobs, self.threads, self.shared_flags, self.progress)

    # ----- the whole experiment -----
    def count_steps(self) -> int:
        """Steps the top-level bar counts: one per script call, each shared partition once."""
        runs = combinations(self.config)
        n_partitions = len({partition_key(combination) for combination in runs})
        synthetic = self.config["data"]["source"] == "synthetic"
        return synthetic + 1 + 2 * len(self.config["tasks"]) + n_partitions + len(self.metered(runs)) + len(runs)

    def metered(self, runs: list[Combination]) -> list[tuple]:
        """(task, grouping, α, seed) of every label/embedding partition step 3c measures (none when it is off)."""
        if not self.config["heterogeneity_meter"]:
            return []
        return list(dict.fromkeys((c.task, c.grouping, c.alpha, c.seed) for c in runs if c.grouping in GROUPINGS))

    def check_inputs(self) -> None:
        """Inputs the experiment names but no step makes: checked before any step runs, errors name the key
        (pipeline/checks.py; the file's other checks ran when it was loaded)."""
        check_input_files(self.config)

    def run(self) -> pd.DataFrame:
        """Every step for every combination, then the report; returns the report table."""
        self.check_inputs()
        with tqdm(total=self.count_steps(), desc="pipeline", unit="step", file=sys.stdout,
                  disable=not self.show_progress) as self.progress:
            root = self.data_root()
            manifest = self.manifest(root)
            model_dirs = {task: self.centralized(task, root, manifest) for task in self.config["tasks"]}
            cluster_dirs = {task: self.clusters(task, root, manifest, model_dirs[task]) for task in self.config["tasks"]}
            runs, partitions, meters = [], {}, {}
            for combination in combinations(self.config):
                key = partition_key(combination)
                if key not in partitions:
                    partitions[key] = self.partition_for(combination, manifest, cluster_dirs)
                assignments = partitions[key]
                measured = (combination.task, combination.grouping, combination.alpha, combination.seed)
                if measured in self.metered([combination]) and measured not in meters:
                    meters[measured] = self.meter(*measured, root, manifest, assignments, model_dirs[combination.task])
                stage = self.federated(combination, root, manifest, assignments, model_dirs[combination.task])
                runs.append((combination, stage, assignments))
            self.run_pooled([*meters.values(), *(stage for _, stage, _ in runs)])
        return self.report([(combination, stage.stage_dir, assignments) for combination, stage, assignments in runs],
                           model_dirs, cluster_dirs, {key: stage.stage_dir for key, stage in meters.items()})

    def partition_for(self, combination: Combination, manifest: Path, cluster_dirs: dict[str, Path]) -> Path:
        owner, grouping, alpha, seed = partition_key(combination)
        # Label-based and iid: no --groups, so step 3b uses the manifest's family's label column.
        groups = str(cluster_dirs[combination.task] / "clusters.csv") if grouping == EMBEDDING_BASED else None
        return self.assignments(owner, grouping, groups, alpha, seed, manifest)

    def report(self, runs: list[tuple[Combination, Path, Path]], model_dirs: dict[str, Path],
               cluster_dirs: dict[str, Path], meters: dict[tuple, Path]) -> pd.DataFrame:
        finals, curves, heatmaps = [], [], {}
        for combination, run_dir, assignments in runs:
            keys = {"task": combination.task, "grouping": combination.grouping, "alpha": combination.alpha,
                    "algorithm": combination.algorithm, "seed": combination.seed}
            metric = get_task(combination.task).primary_metric
            metrics = read_csv(run_dir / "metrics.csv", "step-4 metrics", METRICS_COLUMNS, finished=True)
            history = global_test_history(metrics)
            last = history[history["round"] == history["round"].max()].set_index("metric").value
            personal = ALGORITHMS.get(combination.algorithm).result_is_personal
            finals.append({**keys, "loss": last["loss"], "metric": metric, "metric_value": last[metric],
                           "personal_loss": final_personal_loss(metrics),
                           "personal_metric_value": final_personal_loss(metrics, metric), "result_is_personal": personal})
            # The curve of what the algorithm delivers: for FedRep its clients' own models (its global head is untrained).
            curve = personal_test_history(metrics) if personal else history
            for round_index, loss in curve[curve.metric == "loss"][["round", "value"]].itertuples(index=False):
                curves.append({**keys, "round": round_index, "loss": loss, "model": "personal" if personal else "global"})
            if combination.seed == self.config["seeds"][0] and combination.grouping in GROUPINGS:
                heatmaps[(combination.task, combination.grouping, combination.alpha)] = assignments / "client_group_heatmap.png"
        centralized = {task: best_validation_loss(model_dir / "metrics.csv") for task, model_dir in model_dirs.items()}
        agreement = {task: load_json(cluster_dir / "agreement.json", "step-3 agreement", finished=True)
                     for task, cluster_dir in cluster_dirs.items()}
        meter_rows = [{"task": task, "grouping": grouping, "alpha": alpha, "seed": seed,
                       **load_json(stage_dir / METER_FILE, "step-3c meter", finished=True)}
                      for (task, grouping, alpha, seed), stage_dir in meters.items()]
        return write_report(self.out_dir, pd.DataFrame(finals), pd.DataFrame(curves), centralized, agreement,
                            heatmaps, self.command, pd.DataFrame(meter_rows))


def partition_key(combination: Combination) -> tuple:
    """Combinations with the same key share one assignments file (label and iid partitions are task-free)."""
    owner = combination.task if combination.grouping == EMBEDDING_BASED else "labels"
    return owner, combination.grouping, combination.alpha, combination.seed


def flags(params: dict[str, Any]) -> list[str]:
    """argparse flags from a dict: booleans as --x / --no-x, lists comma-joined, None left out."""
    argv = []
    for key, value in params.items():
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(f"--{key}" if value else f"--no-{key}")
        elif isinstance(value, (list, tuple)):
            argv += [f"--{key}", ",".join(map(str, value))]
        else:
            argv += [f"--{key}", str(value)]
    return argv


def command_line(argv: list[str]) -> str:
    return "python run_pipeline.py " + " ".join(shlex.quote(arg) for arg in argv)
