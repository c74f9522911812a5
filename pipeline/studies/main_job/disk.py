"""The main job's disk plan (pipeline/disk_projection.py): every stage of the grid with what it will keep, built from
the same parameters the runner passes to the steps (config.py), so a finished stage is recognised by them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from partitioning.groupings import EMBEDDING_BASED, IID_REFERENCE, PROPERTY_BASED
from pipeline.disk_plans import (CSV_ROW_BYTES, STAGE_FILES, RunSizes, caches, centralized_stages, embedding_bytes,
                                 federated_stage, model_spec, sample_count)
from pipeline.disk_projection import Bytes, DiskPlan, PlannedStage
from pipeline.studies.main_job.config import (assignment_params, combinations, embedding_params, federated_params,
                                              partition_key)


def disk_plan(config: dict[str, Any], out_dir: Path) -> DiskPlan:
    """Steps 2, 3, 3b and 4 of every combination, and the caches they fill (step 3c's and 3p's files: kilobytes)."""
    samples, samples_from = sample_count(config, out_dir)
    sizes = RunSizes(config)
    references = [(task, seed) for task in config["tasks"] for seed in config["seeds"]]
    stages = centralized_stages(config, references)
    widths = {task: embedding_bytes(model_spec(config, task), sizes.notes) for task in config["tasks"]}
    stages += [PlannedStage("step 3", f"embeddings/{task}-*", embedding_params(config, seed, "", "", ""), widths[task])
               for task, seed in references]
    runs = combinations(config)
    partitions: dict[tuple, PlannedStage] = {}
    decoded_sets = {task: 1 + (PROPERTY_BASED in config["partition"]["groupings"]) for task in config["tasks"]}
    for combination in runs:
        owner, grouping, alpha, seed = key = partition_key(combination)
        if key not in partitions:
            groups = "clusters.csv" if grouping in (EMBEDDING_BASED, PROPERTY_BASED) else None
            name = f"{grouping}-s{seed}" if grouping == IID_REFERENCE else f"{grouping}-a{alpha:g}-s{seed}"
            partitions[key] = PlannedStage("step 3b", f"assignments/{owner}/{name}-*",
                                           assignment_params(config, grouping, alpha, seed, "", groups),
                                           Bytes(STAGE_FILES, CSV_ROW_BYTES))
    # every partition's clients are a set of rows of each task that trains on it: their own decoded cache
    for task in config["tasks"]:
        decoded_sets[task] += len({partition_key(c) for c in runs if c.task == task})
    stages += list(partitions.values())
    n_clients = config["partition"]["n_clients"]
    for combination in runs:
        settings = config["federated"]["algorithms"][combination.algorithm] or {}
        size = sizes.of(combination.task, combination.algorithm, settings, n_clients, config["model"]["freeze_encoder"])
        partition = (combination.grouping if combination.grouping == IID_REFERENCE
                     else f"{combination.grouping}/a{combination.alpha:g}")
        folder = f"federated/{combination.task}/{partition}/{combination.algorithm}/s{combination.seed}-*"
        stages.append(federated_stage(folder, federated_params(config, combination, "", "", "", ""), size, n_clients))
    return DiskPlan(stages, caches(config, decoded_sets, sizes.notes), samples, samples_from, sizes.notes)
