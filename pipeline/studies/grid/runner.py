"""The runner of every grid study: centralized → a federated grid → the kind's report.

A grid study is the main job's machinery (pipeline/runner.py's ``Pipeline`` for data, step 1 and
step 2; utils/stages.py's skip-if-done stages; step 3b and step 4 through their ``main(argv)``)
over a different grid: a list of *blocks*, each the product

    partitions × local steps J × algorithm variants × seeds

where a partition is a registered scheme with its parameters (``{scheme: nc_shards,
groups_per_client: 5}``), J sets the rounds through the fixed budget
``federated.rounds_x_local_steps`` (rounds = budget / J, so every run does the same local
work), and an algorithm's setting given as a list expands into one variant per value
(``sparse_ft: {density: [0.01, 0.1]}``), so a new kind reuses the grid and only adds a report
(pipeline/studies/<kind>.py). The grid's classes live in pipeline/studies/grid/runs.py and the
study file's checks in pipeline/studies/grid/config.py.

``federated.init_from: head``: step 2 runs with ``model.freeze_encoder`` (a linear head on the
frozen pretrained features), the study copies its ``best.pt`` with the encoder unfrozen into
``head/s<seed>-<key>/``, and every federated run (dense or sparse) fine-tunes the whole model
from there (``sparse_ft`` keeps the head frozen, as TaLoS does).

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

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.argv import flags
from pipeline.pool import PoolStage
from steps import assign as step3b
from pipeline.studies.grid.params import assignment_params, federated_params
from pipeline.studies.grid.runs import Partition, StudyRun, study_runs
from utils.stages import run_stage, stage_key

if TYPE_CHECKING:
    from pipeline.runner import Pipeline


@dataclass(frozen=True)
class GridResult:
    """The finished folders of a grid study, for its kind's report.

    Attributes:
        run_dirs: each :class:`StudyRun` -> its step-4 folder.
        centralized: each seed -> its step-2 folder.
        meters: (partition, seed) -> step 3c's folder (empty without ``heterogeneity_meter``).
    """

    run_dirs: dict[StudyRun, Path]
    centralized: dict[int, Path]
    meters: dict[tuple[Partition, int], Path]


class GridStudy:
    """The steps of one grid study (a validated config) through the shared step runner ``pipeline``."""

    def __init__(self, pipeline: "Pipeline") -> None:
        self.pipeline, self.config, self.out_dir = pipeline, pipeline.config, pipeline.out_dir

    def run(self) -> GridResult:
        """Step 1, step 2 per seed, step 3b (and 3c) per partition and seed, step 4 per run (``--jobs`` at a time)."""
        self.pipeline.check_inputs()  # every input file the study names, before step 0
        runs = study_runs(self.config)
        seeds = [int(seed) for seed in self.config["seeds"]]
        partitions = list(dict.fromkeys((run.partition, run.seed) for run in runs))
        metered = partitions if self.config["heterogeneity_meter"] else []
        grouped = list(dict.fromkeys(partition for partition, _ in partitions if partition.class_groups))
        total = ((self.config["data"]["source"] == "synthetic") + 1 + len(seeds) + len(grouped) + len(partitions)
                 + len(metered) + len(runs))
        with self.pipeline.progress_bar(total, "study") as self.pipeline.progress:
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
        return GridResult({run: stage.stage_dir for run, stage in stages.items()}, centralized,
                          {key: stage.stage_dir for key, stage in meters.items()})

    def start_model(self, seed: int, model_dir: Path) -> Path:
        """The folder whose ``best.pt`` the federated runs start from: step 2's, or (init_from head) a copy with
        the encoder unfrozen, since a checkpoint's model config keeps step 2's ``freeze_encoder``."""
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
        """Step 3b: one partition's assignments.csv for one seed (``groups``: its class-groups file, if any)."""
        params = assignment_params(self.config, partition, seed, manifest, groups)
        inputs = [manifest] + ([groups] if groups is not None else [])
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
        params = federated_params(self.config, run, root, manifest, assignments / "assignments.csv",
                                  model_dir / "best.pt")
        inputs = [manifest, assignments / "assignments.csv"]
        stage_dir = (self.out_dir / "federated" / run.partition.label / f"J{run.local_steps}" / run.variant.label
                     / f"s{run.seed}-{stage_key(params, inputs, self.out_dir)}")
        label = f"step 4: {run.partition.label} · J={run.local_steps} · {run.variant.label} · seed {run.seed}"
        return PoolStage(label, stage_dir, params, ["--out", str(stage_dir), "--resume", *flags(params)])


def unfrozen_copy(checkpoint: Path, out: Path) -> None:
    """Write step 2's checkpoint whole (its frozen encoder put back) with ``freeze_encoder`` off in its model config."""
    from models.frozen_encoder import write_unfrozen_copy

    write_unfrozen_copy(checkpoint, out)
