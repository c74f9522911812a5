"""The shared step runner of run_pipeline.py: the steps every study kind calls, and the worker pool.

Each step is run by calling the ``main(argv)`` of its ``steps`` module, the same function the numbered
script a user runs by hand calls, so the pipeline and the scripts cannot drift apart. Every step's folder
name carries a hash of its parameters and inputs (utils/stages.py): finished steps are skipped on a rerun,
an unfinished step 4 resumes from its checkpoint, and a changed setting gets a new folder instead of
overwriting. A study kind (pipeline/studies/) decides which steps run for which grid, and writes its report.

Layout under ``results/<experiment name>/`` (the shared part; each kind adds its own folders)::

    data/<key>/                         synthetic buildings (data.source: synthetic; digits needs no data folder)
    step1-<key>/manifest.csv
    centralized/<task>-<key>/           step 2 run folder (best.pt)
    heterogeneity/...                   step 3c readings
    report.md, report.csv, *.png        the kind's report
"""

from __future__ import annotations

import importlib
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from tqdm.auto import tqdm

from datasets.family import DEFAULT_VAL_FRACTION
from datasets.synthetic import FORMAT_VERSION as RENDER_FORMAT_VERSION
from pipeline.argv import flags
from pipeline.checks import check_input_files
from pipeline.executors import Executor, ExecutorSettings, GridProgress, open_local
from pipeline.pool import PoolStage, placement, stage_counts
from pipeline.sections import DATA_SOURCES, FOLDER_SOURCES, split_csv_path
from pipeline.shards import Shard
from steps import assign as step3b
from steps import embed as step3
from steps import federated as step4
from steps import meter as step3c
from steps import render
from steps import select as step1
from steps import target_groups as step3p
from steps import train_centralized as step2
from utils.interrupts import interrupted, message_of
from utils.progress import StepLines
from utils.run_dir import RUN_LOG, write_config
from utils.stages import is_done, run_stage, stage_key


# Steps 2 (training), 3c (clients' gradients) and 4 (training) sum gradients over a batch, and torch splits such a
# sum over its threads, so another thread count rounds otherwise: measured, step 2 at 2 threads ended at another
# keypoints model (weights differing from epoch 1, best epoch 46 against 50), 5 of the demo's 6 clusterings followed
# it, and one headline row moved from "no effect" to "undecided". The pipeline therefore runs them on one thread
# whatever --threads says (its parallelism is --jobs), so an experiment's answer is the same at any --threads.
# Steps 1, 3 and 3p take --threads: their outputs are bit-identical at 1 and 2 threads (each output element is
# one thread's sum); tests/test_pipeline.py checks both at the level of the report.
SUMS_GRADIENTS = (step2, step3c, step4)
GRADIENT_THREADS = 1


def centralized_params(config: dict[str, Any], task: str, root: Path | str, manifest: Path | str,
                       seed: int) -> dict[str, Any]:
    """Step 2's parameters for ``task`` with ``seed`` (the disk projection, pipeline/disk_projection.py, matches a
    finished step 2 on them too)."""
    return {"task": task, "data_path": str(root), "manifest": str(manifest), "seed": seed,
            "use_accelerator": config["use_accelerator"], **config["model"], **config["centralized"]}


@dataclass
class Pipeline:
    """The steps of one experiment (a validated config from ``pipeline.experiment.load_experiment``), skip-if-done,
    with a top-level progress bar (``progress``, set by the kind's runner while it runs)."""

    config: dict[str, Any]
    out_dir: Path
    command: str
    progress: tqdm | None = None
    jobs: int = 1  # step-4 runs at once (separate processes); 1 runs them in this process
    threads: int | None = None  # torch threads of the steps that do not sum gradients (see SUMS_GRADIENTS)
    show_progress: bool = True  # the top-level bar (run_pipeline.py --no-progress, or stdout not a terminal: off)
    executor: Executor | None = None  # where pooled stages run (pipeline/executors.py); None: the local pool of jobs
    record: dict[str, Any] | None = None  # written to out_dir/config.json once the inputs are checked (None: not)
    # Where the stage folders go (None: out_dir). A study running several main jobs (pipeline/studies/main_job/mechanism.py)
    # gives them one, so the stages their settings share (same parameters, same stage key) run once.
    stages_dir: Path | None = None
    # run_pipeline.py --shard i/n: this process runs its share of the step-4 runs and writes no report
    # (pipeline/shards.py); None: every run, then the report.
    shard: Shard | None = None

    @property
    def writes_report(self) -> bool:
        """Whether this process writes the kind's report (not a shard: it has only its share of the runs)."""
        return self.shard is None

    @property
    def stage_root(self) -> Path:
        """The parent of the experiment's stage folders and decoded-sample cache: ``stages_dir``, else ``out_dir``."""
        return self.out_dir if self.stages_dir is None else self.stages_dir

    def step(self, name: str, stage_dir: Path, params: dict[str, Any], script: Callable, argv: list[str]) -> Path:
        """Run one script unless its stage is done; advances the top-level progress bar (without a bar: a line
        ``step k of N: <name>, <s> s`` for a step that ran, utils/progress.py).

        Raises:
            utils.interrupts.Interrupted: Ctrl-C or SIGTERM inside the step: its own line (step 4 names the round
                and its last checkpoint) after the step's name.
        """
        began = time.perf_counter()
        ran = self.run_named(name, stage_dir, params, lambda: script.main(argv + self.shared_flags(script)))
        seconds = time.perf_counter() - began
        if self.progress is not None:
            self.progress.update(1)
            if ran and isinstance(self.progress, StepLines):
                self.progress.finished(name, seconds)
        if ran:
            self.log(f"{name}: {seconds:.0f} s")
        return stage_dir

    def run_named(self, name: str, stage_dir: Path, params: dict[str, Any], work: Callable[[], None]) -> bool:
        """``work`` as the stage ``name`` (skipped if done; True if it ran), shown on the bar; an interrupt inside
        it gets the stage's name in front of its own line."""
        if self.progress is not None:
            self.progress.set_description(name)
        try:
            return run_stage(stage_dir, params, work)
        except KeyboardInterrupt as error:  # Ctrl-C, or SIGTERM (utils/interrupts.py)
            raise interrupted(error, f"{name}: {message_of(error)}") from None

    def run_here(self, stage: PoolStage) -> dict[str, Any]:
        """One pooled stage in this process (``--jobs 1``; ``argv`` complete): its placement record, as a worker
        returns it (pipeline/pool.py), for the same ``run k of N`` line; no placement.json is written."""
        script = importlib.import_module(stage.script)
        record = {**placement(), "started": time.time()}
        ran = self.run_named(stage.name, stage.stage_dir, stage.params, lambda: script.main(stage.argv))
        return {**record, "finished": time.time(), "ran": ran}

    def log(self, line: str) -> None:
        """Append ``line``, timestamped, to the experiment's run.log (every step that ran and every finished run of
        the grid: the record a log-reading user or a later look at the folder finds, whatever the console did)."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with open(self.out_dir / RUN_LOG, "a") as file:
            file.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")

    def shared_flags(self, script: Callable) -> list[str]:
        """Flags that change speed or console output, not results (so not part of any stage key).

        Every step runs without its own bars (the pipeline's bar counts steps); step 4 keeps its per-round
        lines in run.log and prints one line per run, so a grid of hundreds of runs prints hundreds of lines,
        not one per round.
        """
        shared = ["--no-progress"] + self.thread_flags(script)
        if script in (step2, step3, step3p, step3c, step4):
            # One decoded-sample cache for the experiment: PNGs are decoded once, not once per run.
            shared += ["--cache_dir", str(self.stage_root / "cache")]
        if script is step4:
            shared.append("--no-round_lines")
        if script in (step2, step4) and self.config.get("tensorboard"):
            shared.append("--tensorboard")  # <run>/tensorboard: `tensorboard --logdir results/<name>` shows every run
        if script in (step2, step3b, step4) and not self.config.get("run_plots", True):
            shared.append("--no-plots")
        return shared

    def thread_flags(self, script: Callable) -> list[str]:
        """``--threads`` for ``script``: the pipeline's own for the steps whose outputs are the same at any count,
        and one thread for those that sum gradients (:data:`SUMS_GRADIENTS`), whatever ``--threads`` says."""
        if script in SUMS_GRADIENTS:
            return ["--threads", str(GRADIENT_THREADS)]
        return [] if self.threads is None else ["--threads", str(self.threads)]

    # ----- steps -----
    def data_root(self) -> Path:
        data = self.config["data"]
        if data["source"] != "synthetic":
            return Path(data["root"])
        params = dict(data["synthetic"])
        # The format version is in the folder's name, so a render of another format is a new folder, and every later
        # stage (their keys name the data folder) and the decoded-sample cache are made again rather than reused.
        stage_dir = Path(data["root"]) / stage_key({**params, "format_version": RENDER_FORMAT_VERSION}, [])
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
        elif family in FOLDER_SOURCES:  # a user's folder: its split CSV relative to data.root, as Taskonomy's
            params.update(data_path=str(root), split_csv=data["split_csv"], val_fraction=data["val_fraction"])
            if family == "paired_folders":  # the main job compares label- with embedding-based partitions
                params["require_labels"] = True
        else:
            params.update(data_path=str(root), tasks=self.config["tasks"], top_k_classes=data["top_k_classes"],
                          split_by=data["split_by"])
        if family == "taskonomy":  # always named: a manifest of the older split (no validation part) is not reused
            params["val_fraction"] = DEFAULT_VAL_FRACTION if data["val_fraction"] is None else data["val_fraction"]
        elif family == "digits" and data["val_fraction"] is not None:
            params["val_fraction"] = data["val_fraction"]
        inputs = []
        if data["source"] == "taskonomy":
            # Step 1's --client_file_name has data.split_csv's meaning: relative to the data root unless absolute.
            params["client_file_name"] = data["split_csv"]
            inputs.append(split_csv_path(data))
        if data["source"] in FOLDER_SOURCES:  # files that change step 1's rows: an edit makes a new manifest
            inputs += [path for path in (split_csv_path(data) if data["split_csv"] else None, root / "targets.yaml",
                                         root / "groups.csv") if path is not None and path.is_file()]
        if data["buildings"]:
            params["taskonomy_clients_to_include"] = ",".join(data["buildings"])
        stage_dir = self.stage_root / f"step1-{stage_key(params, inputs, self.stage_root)}"
        self.step("step 1: select samples", stage_dir, params, step1, ["--out", str(stage_dir), *flags(params)])
        return stage_dir / "manifest.csv"

    def centralized(self, task: str, root: Path, manifest: Path, seed: int | None = None) -> Path:
        """Step 2 for ``task`` with ``seed`` (default: the experiment's first seed), in this process."""
        stage = self.centralized_stage(task, root, manifest, seed)
        self.step(stage.name, stage.stage_dir, stage.params, step2, stage.argv)
        return stage.stage_dir

    def centralized_stage(self, task: str, root: Path, manifest: Path, seed: int | None = None) -> PoolStage:
        """Step 2's stage for ``task`` with ``seed`` (default: the experiment's first seed), to run here
        (:meth:`centralized`) or in the pool beside other seeds' (:meth:`run_pooled`)."""
        chosen = self.config["seeds"][0] if seed is None else seed
        params = centralized_params(self.config, task, root, manifest, chosen)
        stage_dir = self.stage_root / "centralized" / f"{task}-{stage_key(params, [manifest], self.stage_root)}"
        name = f"step 2: train {task}" + ("" if seed is None else f" seed {params['seed']}")
        return PoolStage(name, stage_dir, params, ["--out", str(stage_dir), *flags(params)], script=step2.__name__)

    def meter_stage(self, label: str, stage_prefix: Path, root: Path, manifest: Path, assignments: Path,
                    model_dir: Path) -> PoolStage:
        """Step 3c's stage of one partition (``assignments``) at one step-2 model; its folder is ``stage_prefix``
        plus ``-<stage key>`` (the main job's and a study's meters differ in label and folder only)."""
        params = {"checkpoint": str(model_dir / "best.pt"), "manifest": str(manifest),
                  "assignments": str(assignments / "assignments.csv"), "data_path": str(root),
                  "use_accelerator": self.config["use_accelerator"], "cache_features": self.config["model"]["cache_features"]}
        inputs = [manifest, assignments / "assignments.csv", model_dir / "best.pt"]
        stage_dir = stage_prefix.with_name(f"{stage_prefix.name}-{stage_key(params, inputs, self.stage_root)}")
        return PoolStage(f"step 3c: {label}", stage_dir, params, ["--out", str(stage_dir), *flags(params)],
                         script=step3c.__name__)

    def run_pooled(self, stages: list[PoolStage]) -> None:
        """Pooled stages (step-2 models of a study's later seeds, step-3c readings, step-4 runs): here one after another, or through the executor (``jobs`` local
        worker processes, or Ray tasks; pipeline/executors.py), with a ``run k of N`` line and its ETA per finished
        stage either way (:class:`pipeline.executors.GridProgress`).

        Stages are independent (each has its own seed-derived draws), so the order and the place change nothing
        but the floating-point rounding of a different thread count. The first failure stops the rest.
        """
        executor = self.executor
        if executor is None:
            executor = open_local(ExecutorSettings(jobs=self.jobs, threads=self.threads), None,
                                  self.config["use_accelerator"])
        if self.shard is not None:
            stages = self.shard.share(stages)
        pending = [stage for stage in stages if not is_done(stage.stage_dir)]
        summary = f"{stage_counts(pending)}, {executor.describe()}"
        # Said once on the console too: with no bars (--no-progress, or stdout not a terminal) nothing else shows it.
        print(summary)
        self.log(summary)
        if self.progress is not None:
            self.progress.update(len(stages) - len(pending))
            self.progress.set_description(summary)
        complete = [replace(stage, argv=[*stage.argv, *self.shared_flags(importlib.import_module(stage.script))])
                    for stage in pending]
        progress = GridProgress(len(pending), self.progress, log=self.log)
        if executor.in_process:
            for stage in complete:
                progress.done(stage, self.run_here(stage))
        else:
            executor.run(complete, progress.done)

    def check_inputs(self) -> None:
        """Inputs the experiment names but no step makes: checked before any step runs, errors name the key
        (pipeline/checks.py; the file's other checks ran when it was loaded)."""
        check_input_files(self.config)
        if self.record is not None:  # only a file that passed every check leaves a folder behind
            write_config(self.out_dir, self.record)
            self.log(f"started: {self.command}")
            if self.record.get("disk"):  # run_pipeline.py's projection (pipeline/disk_projection.py)
                self.log(self.record["disk"]["line"])

    def progress_bar(self, total: int, desc: str) -> tqdm | StepLines:
        """The top-level bar over ``total`` steps; without ``show_progress`` (``--no-progress``, or stdout not a
        terminal) a :class:`utils.progress.StepLines`, which prints a line per finished step instead. The kind's
        runner enters it as ``self.progress``."""
        if not self.show_progress:
            return StepLines(total)
        return tqdm(total=total, desc=desc, unit="step", file=sys.stdout)
