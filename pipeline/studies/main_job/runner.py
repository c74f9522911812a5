"""The main job's steps: 1–4 for every combination of the experiment grid, then the gap report.

Layout under ``results/<experiment name>/`` (beside the shared folders of pipeline/runner.py)::

    embeddings/<task>-<key>/            step 3 (clusters.csv, diagnostics)
    property/<task>-<key>/              step 3p (groups.csv: the positive control's bins; partition.groupings
                                        lists property_based)
    assignments/<task|labels>/<grouping>-a<α>-s<seed>-<key>/   step 3b
    heterogeneity/<task>/<grouping>-a<α>-s<seed>-<key>/        step 3c
    federated/<task>/<grouping>/a<α>/<algorithm>/s<seed>-<key>/ step 4 run folder
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from models.tasks import get_task
from network.algorithms.base import ALGORITHMS
from network.run_outputs import METRICS_COLUMNS
from partitioning.groupings import EMBEDDING_BASED, GROUPINGS, IID_REFERENCE, PROPERTY_BASED
from pipeline.argv import flags
from pipeline.fingerprint import fingerprint_line
from pipeline.pool import PoolStage
from pipeline.run_results import (centralized_reference, final_personal_loss, global_test_history, personal_test_history,
                                  trivial_losses)
from pipeline.runner import Pipeline
from pipeline.studies.main_job.config import (Combination, assignment_params, combinations, embedding_params,
                                              federated_params, partition_key)
from pipeline.studies.main_job.meter import partition_distances_row
from pipeline.studies.main_job.report import write_report
from steps import assign as step3b
from steps import embed as step3
from steps import target_groups as step3p
from steps.meter import METER_FILE
from utils.loaders import load_json, read_csv
from utils.stages import stage_key


@dataclass
class MainJob:
    """The main job of one validated experiment, run through the shared step runner ``pipeline``."""

    pipeline: Pipeline
    partitions: dict[tuple, Path] = field(default_factory=dict)  # partition_key -> step 3b's folder

    @property
    def config(self) -> dict:
        return self.pipeline.config

    @property
    def out_dir(self) -> Path:
        return self.pipeline.out_dir

    @property
    def stage_root(self) -> Path:
        return self.pipeline.stage_root

    def run(self) -> pd.DataFrame:
        """Every step for every combination, then the report; returns the report table."""
        pipeline = self.pipeline
        pipeline.check_inputs()
        runs = combinations(self.config)
        with pipeline.progress_bar(self.count_steps(runs), "pipeline") as pipeline.progress:
            root = pipeline.data_root()
            manifest = pipeline.manifest(root)
            # Every seed draws its own centralized model (initialisation, data order) and its own KMeans start, so the
            # intervals over seeds cover the whole chain that an embedding-based partition depends on, not only the
            # Dirichlet draw and the federated run (a model shared by all seeds moved the answer with the CPU).
            references = [(task, seed) for task in self.config["tasks"] for seed in self.config["seeds"]]
            model_dirs = self.centralized_models(references, root, manifest)
            cluster_dirs = {(task, seed): self.clusters(task, seed, root, manifest, model_dirs[task, seed])
                            for task, seed in references}
            # The positive control's groups: the data's own property, with no random choice, so one per task.
            property_dirs = ({task: self.property_groups(task, root, manifest) for task in self.config["tasks"]}
                             if PROPERTY_BASED in self.config["partition"]["groupings"] else {})
            stages, meters = [], {}
            for combination in runs:
                assignments = self.partition_for(combination, manifest, cluster_dirs, property_dirs)
                measured = (combination.task, combination.grouping, combination.alpha, combination.seed)
                model_dir = model_dirs[combination.task, combination.seed]
                if measured in self.metered([combination]) and measured not in meters:
                    meters[measured] = self.meter(*measured, root, manifest, assignments, model_dir)
                stage = self.federated(combination, root, manifest, assignments, model_dir)
                stages.append((combination, stage, assignments))
            pipeline.run_pooled([*meters.values(), *(stage for _, stage, _ in stages)])
        if not pipeline.writes_report:  # a shard: its share of the runs is done; the final call reports
            return pd.DataFrame()
        return self.report([(combination, stage.stage_dir, assignments) for combination, stage, assignments in stages],
                           model_dirs, cluster_dirs, {key: stage.stage_dir for key, stage in meters.items()})

    def count_steps(self, runs: list[Combination]) -> int:
        """Steps the top-level bar counts: one per script call, each shared partition once."""
        n_partitions = len({partition_key(combination) for combination in runs})
        synthetic = self.config["data"]["source"] == "synthetic"
        references = len(self.config["tasks"]) * len(self.config["seeds"])  # step 2 and step 3 for each
        properties = len(self.config["tasks"]) if PROPERTY_BASED in self.config["partition"]["groupings"] else 0
        return synthetic + 1 + 2 * references + properties + n_partitions + len(self.metered(runs)) + len(runs)

    def metered(self, runs: list[Combination]) -> list[tuple]:
        """(task, grouping, α, seed) of every label/embedding partition step 3c measures (none when it is off)."""
        if not self.config["heterogeneity_meter"]:
            return []
        return list(dict.fromkeys((c.task, c.grouping, c.alpha, c.seed) for c in runs if c.grouping in GROUPINGS))

    # ----- steps -----
    def centralized_models(self, references: list[tuple[str, int]], root: Path, manifest: Path) -> dict:
        """Step 2 for every (task, seed): the first here, the rest in the pool, two or more at a time.

        The first model fills the experiment's decoded-sample and feature caches alone; the others then only read
        them (they train at once, where one after another they left the second core idle: 6 models of 40-60
        epochs in the demo)."""
        first, *rest = references
        model_dirs = {first: self.pipeline.centralized(first[0], root, manifest, first[1])}
        stages = {(task, seed): self.pipeline.centralized_stage(task, root, manifest, seed) for task, seed in rest}
        if stages:
            self.pipeline.run_pooled(list(stages.values()))
        return {**model_dirs, **{key: stage.stage_dir for key, stage in stages.items()}}

    def clusters(self, task: str, seed: int, root: Path, manifest: Path, model_dir: Path) -> Path:
        """Step 3: the embeddings of ``task``'s centralized model of ``seed`` and their KMeans clusters (KMeans
        started from ``seed``)."""
        # whether an untrained best.pt is refused changes no output: a flag outside the stage key
        allowed = ["--allow_untrained"] if self.config["embeddings"]["allow_untrained"] else []
        params = embedding_params(self.config, seed, model_dir / "best.pt", manifest, root)
        stage_dir = self.stage_root / "embeddings" / f"{task}-{stage_key(params, [manifest, model_dir / 'best.pt'], self.stage_root)}"
        return self.pipeline.step(f"step 3: embed + cluster {task} seed {seed}", stage_dir, params, step3,
                                  ["--out", str(stage_dir), *flags(params), *allowed])

    def property_groups(self, task: str, root: Path, manifest: Path) -> Path:
        """Step 3p: ``task``'s samples in quantile bins of their mean target, as many bins as KMeans has clusters."""
        params = {"task": task, "manifest": str(manifest), "data_path": str(root),
                  "n_bins": self.config["embeddings"]["n_clusters"], "image_size": self.config["model"]["image_size"]}
        stage_dir = self.stage_root / "property" / f"{task}-{stage_key(params, [manifest], self.stage_root)}"
        return self.pipeline.step(f"step 3p: property bins of {task}", stage_dir, params, step3p,
                                  ["--out", str(stage_dir), *flags(params)])

    def partition_for(self, combination: Combination, manifest: Path, cluster_dirs: dict[tuple[str, int], Path],
                      property_dirs: dict[str, Path]) -> Path:
        """Step 3b's folder of ``combination``'s partition (run once per partition key, shared by its runs)."""
        key = partition_key(combination)
        if key not in self.partitions:
            owner, grouping, alpha, seed = key
            # Label-based and iid: no --groups, so step 3b uses the manifest's family's label column.
            groups = None
            if grouping == EMBEDDING_BASED:
                groups = str(cluster_dirs[combination.task, seed] / "clusters.csv")
            elif grouping == PROPERTY_BASED:
                groups = str(property_dirs[combination.task] / "groups.csv")
            self.partitions[key] = self.assignments(owner, grouping, groups, alpha, seed, manifest)
        return self.partitions[key]

    def assignments(self, owner: str, grouping: str, groups: str | None, alpha: float, seed: int, manifest: Path) -> Path:
        """Step 3b: one partition's assignments.csv."""
        params = assignment_params(self.config, grouping, alpha, seed, manifest, groups)
        inputs = [manifest] + ([Path(groups)] if groups else [])  # a groups file's content is part of the key
        name = f"{grouping}-s{seed}" if grouping == IID_REFERENCE else f"{grouping}-a{alpha:g}-s{seed}"
        stage_dir = self.stage_root / "assignments" / owner / f"{name}-{stage_key(params, inputs, self.stage_root)}"
        return self.pipeline.step(f"step 3b: {name}", stage_dir, params, step3b, ["--out", str(stage_dir), *flags(params)])

    def meter(self, task: str, grouping: str, alpha: float, seed: int, root: Path, manifest: Path, assignments: Path,
              model_dir: Path) -> PoolStage:
        """Step 3c's stage: G² and B² of one partition's clients at the task's centralized model (run later in the
        pool, beside the federated runs: 48 readings one after another were a minute of one core)."""
        return self.pipeline.meter_stage(f"meter {task} {grouping} α={alpha:g} seed {seed}",
                                         self.stage_root / "heterogeneity" / task / f"{grouping}-a{alpha:g}-s{seed}",
                                         root, manifest, assignments, model_dir)

    def federated(self, combination: Combination, root: Path, manifest: Path, assignments: Path,
                  model_dir: Path) -> PoolStage:
        """Step 4's stage of one combination (run later in the pool)."""
        params = federated_params(self.config, combination, root, manifest, assignments / "assignments.csv",
                                  model_dir / "best.pt")
        c = combination
        partition = c.grouping if c.grouping == IID_REFERENCE else Path(c.grouping, f"a{c.alpha:g}")
        stage_dir = (self.stage_root / "federated" / c.task / partition / c.algorithm
                     / f"s{c.seed}-{stage_key(params, [manifest, assignments / 'assignments.csv'], self.stage_root)}")
        argv = ["--out", str(stage_dir), "--resume", *flags(params)]
        return PoolStage(f"step 4: {c.label()}", stage_dir, params, argv)

    # ----- the report -----
    def report(self, runs: list[tuple[Combination, Path, Path]], model_dirs: dict[tuple[str, int], Path],
               cluster_dirs: dict[tuple[str, int], Path], meters: dict[tuple, Path]) -> pd.DataFrame:
        """Read every finished run folder and write the gap report."""
        finals, curves, heatmaps, distances = [], [], {}, {}
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
            partition = (combination.task, combination.grouping, combination.alpha, combination.seed)
            if combination.grouping in GROUPINGS and partition not in distances:
                distances[partition] = partition_distances_row(
                    assignments, cluster_dirs[combination.task, combination.seed] / "clusters.csv")
        references = {key: centralized_reference(model_dir / "metrics.csv") for key, model_dir in model_dirs.items()}
        per_seed_agreement = {key: load_json(cluster_dir / "agreement.json", "step-3 agreement", finished=True)
                              for key, cluster_dir in cluster_dirs.items()}
        centralized, selected_on, agreement = seed_means(references, per_seed_agreement)
        # The trivial predictors see only the data, not the model: every seed's step 2 measures the same numbers.
        first_seed = self.config["seeds"][0]
        trivial = {task: trivial_losses(model_dirs[task, first_seed] / "metrics.csv") for task in centralized}
        meter_rows = [{"task": task, "grouping": grouping, "alpha": alpha, "seed": seed,
                       **load_json(stage_dir / METER_FILE, "step-3c meter", finished=True)}
                      for (task, grouping, alpha, seed), stage_dir in meters.items()]
        return write_report(self.out_dir, pd.DataFrame(finals), pd.DataFrame(curves), centralized, agreement,
                            heatmaps, self.pipeline.command, pd.DataFrame(meter_rows), selected_on,
                            pd.DataFrame([{"task": task, "grouping": grouping, "alpha": alpha, "seed": seed, **row}
                                          for (task, grouping, alpha, seed), row in distances.items()]),
                            trivial, fingerprint_line(self.config))


def seed_means(references: dict[tuple[str, int], tuple[float, str]],
               agreement: dict[tuple[str, int], dict[str, float]]) -> tuple[dict, dict, dict]:
    """Per task, over its seeds' centralized models and clusterings: the mean reference test loss, what chose the
    references' epochs (``last`` if any seed's was not chosen on validation rows, else ``val``), and the mean of each
    agreement score."""
    centralized, selected_on, scores = {}, {}, {}
    for task in sorted({task for task, _ in references}):
        chosen = [value for (name, _), value in references.items() if name == task]
        centralized[task] = sum(loss for loss, _ in chosen) / len(chosen)
        selected_on[task] = "val" if all(split == "val" for _, split in chosen) else "last"
        readings = [value for (name, _), value in agreement.items() if name == task]
        scores[task] = {key: sum(reading[key] for reading in readings) / len(readings) for key in readings[0]}
    return centralized, selected_on, scores


def run(pipeline: Pipeline) -> pd.DataFrame:
    """The study kind's ``run``: the main job of ``pipeline.config``."""
    return MainJob(pipeline).run()
