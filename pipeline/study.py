"""Studies: one experiment file with a ``study:`` key runs centralized → a federated grid → a study report.

A study is the main job's machinery (pipeline/runner.py's ``Pipeline`` for data, step 1 and
step 2; pipeline/stages.py's skip-if-done stages; step 3b and step 4 through their
``main(argv)``) over a different grid: a list of *blocks*, each the product

    partitions × local steps J × algorithm variants × seeds

where a partition is a registered scheme with its parameters (``{scheme: nc_shards,
groups_per_client: 5}``), J sets the rounds through the fixed budget
``federated.rounds_x_local_steps`` (rounds = budget / J, so every run does the same local
work), and an algorithm's setting given as a list expands into one variant per value
(``sparse_ft: {density: [0.01, 0.1]}``), so a later study (dense FedAvg against sparse
fine-tuning over its settings) reuses the grid and only adds a report. ``study:`` names
the report (:data:`STUDY_REPORTS`): ``fedavg_sharding`` (pipeline/study_report.py) or
``sparse_finetuning`` (pipeline/sparse_report.py: dense FedAvg against ``sparse_ft`` per
sparsity, calibration rounds and mask rule), ``fed_lt`` (pipeline/fedlt_report.py) or
``heterogeneity_toolbox`` (pipeline/toolbox_report.py: which method for which heterogeneity,
each partition a named *situation*).

This module is the runner; the grid's classes live in pipeline/study_grid.py and the study
file's checks in pipeline/study_validation.py.

``federated.init_from: head`` is issue 15's step 0: step 2 runs with ``model.freeze_encoder``
(a linear head on the frozen pretrained features), the study copies its ``best.pt`` with the
encoder unfrozen into ``head/s<seed>-<key>/``, and every federated run (dense or sparse)
fine-tunes the whole model from there (``sparse_ft`` keeps the head frozen, as TaLoS does).

Layout under ``results/<name>/``::

    step1-<key>/manifest.csv
    centralized/<task>-<key>/                             step 2, one per seed
    head/s<seed>-<key>/best.pt                            init_from head: step 2's model, encoder unfrozen
    calibration/s<seed>-<key>/manifest.csv                calibration_fraction: the manifest without the server's rows
    groups/<partition>-<key>/groups.csv                   class_groups: each sample's class group (step 3b's --groups)
    assignments/<partition>-s<seed>-<key>/                step 3b, shared by every J and algorithm
    heterogeneity/<partition>-s<seed>-<key>/meter.json    heterogeneity_meter: step 3c's G², B² at step 2's model
    federated/<partition>/J<j>/<variant>/s<seed>-<key>/   step 4 (resumes from its checkpoint)
    report.md, report.csv, *.png
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from pipeline.stages import stage_key
from pipeline.study_grid import Partition, StudyRun, rounds_for, study_runs
from pipeline.study_validation import STUDY_REPORTS


class Study:
    """Runs one study (a config from :func:`load_study`) into ``out_dir``, reusing the main job's steps."""

    def __init__(self, config: dict[str, Any], out_dir: Path, command: str, jobs: int = 1,
                 threads: int | None = None, show_progress: bool = True) -> None:
        from pipeline.runner import Pipeline

        self.config, self.out_dir, self.command = config, Path(out_dir), command
        # jobs > 1: the grid's federated runs go through the main job's worker pool (Pipeline.run_pooled)
        self.pipeline = Pipeline(config, self.out_dir, command, jobs=jobs, threads=threads, show_progress=show_progress)

    def run(self):
        """Step 1, step 2 per seed, step 3b (and 3c) per partition and seed, step 4 per run, then the report; returns
        its table."""
        import importlib

        self.pipeline.check_inputs()  # every input file the study names, before step 0
        runs = study_runs(self.config)
        seeds = [int(seed) for seed in self.config["seeds"]]
        partitions = list(dict.fromkeys((run.partition, run.seed) for run in runs))
        metered = partitions if self.config["heterogeneity_meter"] else []
        grouped = list(dict.fromkeys(partition for partition, _ in partitions if partition.class_groups))
        total = ((self.config["data"]["source"] == "synthetic") + 1 + len(seeds) + len(grouped) + len(partitions)
                 + len(metered) + len(runs))
        with tqdm(total=total, desc="study", unit="step", file=sys.stdout,
                  disable=not self.pipeline.show_progress) as self.pipeline.progress:
            root = self.pipeline.data_root()
            manifest = self.pipeline.manifest(root)
            centralized = {seed: self.pipeline.centralized(self.config["task"], root, manifest, seed) for seed in seeds}
            starts = {seed: self.start_model(seed, centralized[seed]) for seed in seeds}
            clients = {seed: self.client_manifest(seed, manifest) for seed in seeds}
            groups = {partition: self.class_groups_file(partition, manifest) for partition in grouped}
            assignments = {key: self.assignments(*key, clients[key[1]], groups.get(key[0])) for key in partitions}
            meters = {key: self.meter(*key, root, manifest, assignments[key], centralized[key[1]]) for key in metered}
            stages = {run: self.federated(run, root, manifest, assignments[(run.partition, run.seed)],
                                          starts[run.seed]) for run in runs}
            self.pipeline.run_pooled([*meters.values(), *stages.values()])  # one by one, or --jobs at a time
            run_dirs = {run: stage.stage_dir for run, stage in stages.items()}
            meters = {key: stage.stage_dir for key, stage in meters.items()}
        report = importlib.import_module(STUDY_REPORTS[self.config["study"]])
        extra = {"meters": meters} if metered else {}  # only the toolbox report reads step 3c
        return report.write_report(self.config, self.out_dir, run_dirs, centralized, self.command, **extra)

    def start_model(self, seed: int, model_dir: Path) -> Path:
        """The folder whose ``best.pt`` the federated runs start from: step 2's, or (init_from head) a copy with
        the encoder unfrozen, since a checkpoint's model config keeps step 2's ``freeze_encoder``."""
        from pipeline.stages import run_stage

        if self.config["federated"]["init_from"] != "head":
            return model_dir
        params = {"checkpoint": str(model_dir / "best.pt")}
        stage_dir = self.out_dir / "head" / f"s{seed}-{stage_key(params, [model_dir / 'best.pt'], self.out_dir)}"
        run_stage(stage_dir, params, lambda: unfrozen_copy(model_dir / "best.pt", stage_dir / "best.pt"))
        return stage_dir

    def client_manifest(self, seed: int, manifest: Path) -> Path:
        """The manifest step 3b partitions: without the server's calibration rows when
        ``federated.calibration_fraction`` is set (network/calibration_split.py draws them from train rows no
        client holds, and partitions such as nc_shards and iid hand out every row).

        The rows held out are the draw that split makes for this seed with no client rows, so step 4's own
        draw (same size, among rows no client holds) finds at least these free.
        """
        import pandas as pd

        from datasets.family import load_manifest
        from network.calibration_split import calibration_ids
        from pipeline.stages import run_stage

        fraction = self.config["federated"]["calibration_fraction"]
        if not fraction:
            return manifest
        params = {"manifest": str(manifest), "calibration_fraction": fraction, "seed": seed}
        stage_dir = self.out_dir / "calibration" / f"s{seed}-{stage_key(params, [manifest], self.out_dir)}"

        def write() -> None:
            _, rows = load_manifest(manifest)
            held_out = set(calibration_ids(rows, rows.iloc[:0], fraction, seed))
            raw = pd.read_csv(manifest, dtype=str, keep_default_na=False)  # every other row exactly as step 1 wrote it
            raw[~raw["sample_id"].isin(held_out)].to_csv(stage_dir / "manifest.csv", index=False)

        run_stage(stage_dir, params, write)
        return stage_dir / "manifest.csv"

    def class_groups_file(self, partition: Partition, manifest: Path) -> Path:
        """``groups.csv`` (sample_id, cluster) mapping every manifest row to the index of its class's group in
        ``partition.class_groups``: step 3b's ``--groups`` for clients drawn from groups of classes."""
        import pandas as pd

        from datasets.family import load_manifest
        from pipeline.stages import run_stage

        params = {"manifest": str(manifest), "class_groups": [list(group) for group in partition.class_groups]}
        stage_dir = self.out_dir / "groups" / f"{partition.label}-{stage_key(params, [manifest], self.out_dir)}"

        def write() -> None:
            family, rows = load_manifest(manifest)
            group_of = {label: index for index, group in enumerate(partition.class_groups) for label in group}
            labels = pd.to_numeric(rows[family.label_column])
            pd.DataFrame({"sample_id": rows["sample_id"], "cluster": labels.map(group_of).astype(int)}).to_csv(
                stage_dir / "groups.csv", index=False)

        run_stage(stage_dir, params, write)
        return stage_dir / "groups.csv"

    def assignments(self, partition: Partition, seed: int, manifest: Path, groups: Path | None = None) -> Path:
        from pipeline.runner import flags
        from steps import assign as step3b

        federated = self.config["federated"]
        params = {"manifest": str(manifest), "scheme": partition.scheme, **dict(partition.params),
                  "n_clients": federated["n_clients"], "client_test_fraction": federated["client_test_fraction"],
                  "seed": seed}
        inputs = [manifest]
        if groups is not None:
            params["groups"] = str(groups)
            inputs.append(groups)
        stage_dir = (self.out_dir / "assignments"
                     / f"{partition.label}-s{seed}-{stage_key(params, inputs, self.out_dir)}")
        return self.pipeline.step(f"step 3b: {partition.label} seed {seed}", stage_dir, params, step3b,
                                  ["--out", str(stage_dir), *flags(params)])

    def meter(self, partition: Partition, seed: int, root: Path, manifest: Path, assignments: Path,
              model_dir: Path):
        """Step 3c's stage: G² and B² of one partition's clients at the seed's step-2 model (meter.json; a
        ``pipeline.pool.PoolStage``, run by ``Pipeline.run_pooled`` beside the federated runs)."""
        return self.pipeline.meter_stage(f"meter {partition.label} seed {seed}",
                                         self.out_dir / "heterogeneity" / f"{partition.label}-s{seed}",
                                         root, manifest, assignments, model_dir)

    def federated(self, run: StudyRun, root: Path, manifest: Path, assignments: Path, model_dir: Path):
        """Step 4's stage of one run (a ``pipeline.pool.PoolStage``, run by ``Pipeline.run_pooled``)."""
        from pipeline.pool import PoolStage
        from pipeline.runner import flags

        federated, model = dict(self.config["federated"]), self.config["model"]
        rounds = rounds_for(self.config, run.local_steps)
        params = {
            "task": self.config["task"], "method": run.variant.algorithm, "rand_seed": run.seed,
            "data_path": str(root), "manifest": str(manifest), "assignments": str(assignments / "assignments.csv"),
            "encoder": model["encoder"], "weights": model["weights"],
            "freeze_encoder": model["freeze_encoder"] and federated["init_from"] != "head",
            "image_size": model["image_size"], "use_accelerator": self.config["use_accelerator"],
            "n_rounds": rounds, "local_steps": run.local_steps, "eval_every": max(1, rounds // federated["evaluations"]),
            **{key: federated[key] for key in ("batch_size", "init_lr", "lr_schedule", "momentum", "weight_decay",
                                               "client_fraction", "init_from")},
            **dict(run.variant.settings),
        }
        if federated["init_from"] != "scratch":
            params.update(init_from="centralized", centralized_checkpoint=str(model_dir / "best.pt"))
        if federated["calibration_fraction"]:
            params["calibration_fraction"] = federated["calibration_fraction"]
        if federated["local_test"] != "assigned":
            params["local_test"] = federated["local_test"]
        if federated["finetune_steps"]:
            params["finetune_steps"] = federated["finetune_steps"]
        inputs = [manifest, assignments / "assignments.csv"]
        stage_dir = (self.out_dir / "federated" / run.partition.label / f"J{run.local_steps}" / run.variant.label
                     / f"s{run.seed}-{stage_key(params, inputs, self.out_dir)}")
        label = f"step 4: {run.partition.label} · J={run.local_steps} · {run.variant.label} · seed {run.seed}"
        return PoolStage(label, stage_dir, params, ["--out", str(stage_dir), "--resume", *flags(params)])


def unfrozen_copy(checkpoint: Path, out: Path) -> None:
    """Write step 2's checkpoint with ``freeze_encoder`` off in its model config (the weights unchanged)."""
    from utils.loaders import load_checkpoint
    from utils.run_dir import atomic_torch_save

    loaded = load_checkpoint(checkpoint, "step-2 best.pt", keys=("model", "model_config"), finished=True)
    # atomic and content-only bytes: the federated runs' stage keys hash this file
    atomic_torch_save({"model": loaded["model"], "model_config": {**loaded["model_config"], "freeze_encoder": False}}, out)
