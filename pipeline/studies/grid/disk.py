"""A grid study's disk plan (pipeline/disk_projection.py): step 2 per seed, step 3b per partition and seed, step 4
per run, built from the parameters the runner passes (params.py), so a finished stage is recognised by them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.disk_plans import (CSV_ROW_BYTES, STAGE_FILES, RunSizes, caches, centralized_stages, federated_stage,
                                 model_spec, sample_count)
from pipeline.disk_projection import Bytes, DiskPlan, PlannedStage
from pipeline.disk_sizes import model_bytes
from pipeline.studies.grid.params import assignment_params, federated_params
from pipeline.studies.grid.runs import study_runs


def disk_plan(config: dict[str, Any], out_dir: Path) -> DiskPlan:
    """Every stage of the study's grid with what it keeps, and the caches (the calibration manifests, class-groups
    files and step-3c readings: kilobytes, not counted)."""
    samples, samples_from = sample_count(config, out_dir)
    task, seeds, federated = config["task"], [int(seed) for seed in config["seeds"]], config["federated"]
    sizes = RunSizes(config)
    stages = centralized_stages(config, [(task, seed) for seed in seeds])
    if federated["init_from"] == "head":  # step 2's model copied whole, its encoder unfrozen (runner.start_model)
        whole = model_bytes(model_spec(config, task, freeze_encoder=False))
        stages += [PlannedStage("step 2", f"head/s{seed}-*", {}, Bytes(whole + STAGE_FILES)) for seed in seeds]
    runs = study_runs(config)
    partitions = list(dict.fromkeys((run.partition, run.seed) for run in runs))
    stages += [PlannedStage("step 3b", f"assignments/{partition.label}-s{seed}-*",
                            assignment_params(config, partition, seed, ""), Bytes(STAGE_FILES, CSV_ROW_BYTES))
               for partition, seed in partitions]
    freeze = config["model"]["freeze_encoder"] and federated["init_from"] != "head"
    for run in runs:
        size = sizes.of(task, run.variant.algorithm, dict(run.variant.settings), federated["n_clients"], freeze)
        folder = f"federated/{run.partition.label}/J{run.local_steps}/{run.variant.label}/s{run.seed}-*"
        stages.append(federated_stage(folder, federated_params(config, run, "", "", "", ""), size,
                                      federated["n_clients"]))
    # step 2's splits make one set of decoded rows, every partition's clients another
    return DiskPlan(stages, caches(config, {task: 1 + len(partitions)}, sizes.notes), samples, samples_from,
                    sizes.notes)
