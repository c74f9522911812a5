"""Step 3b's and step 4's parameters for one stage of a grid study: what the runner
(pipeline/studies/grid/runner.py) passes to the steps, and what the study's validation
(pipeline/studies/grid/config.py, ``check_stages``) checks before any work, so both build them one way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.studies.grid.runs import Partition, StudyRun, rounds_for


def assignment_params(config: dict[str, Any], partition: Partition, seed: int, manifest: Path | str,
                      groups: Path | str | None = None) -> dict[str, Any]:
    """Step 3b's parameters for one partition and seed (``groups``: its class-groups file, if any)."""
    federated = config["federated"]
    params = {"manifest": str(manifest), "scheme": partition.scheme, **dict(partition.params),
              "n_clients": federated["n_clients"], "client_test_fraction": federated["client_test_fraction"],
              "seed": seed}
    if groups is not None:
        params["groups"] = str(groups)
    return params


def federated_params(config: dict[str, Any], run: StudyRun, root: Path | str, manifest: Path | str,
                     assignments_csv: Path | str, start_checkpoint: Path | str) -> dict[str, Any]:
    """Step 4's parameters for one run of the grid (``start_checkpoint``: the model it starts from, unless scratch)."""
    federated, model = config["federated"], config["model"]
    rounds = rounds_for(config, run.local_steps)
    params = {
        "task": config["task"], "method": run.variant.algorithm, "rand_seed": run.seed,
        "data_path": str(root), "manifest": str(manifest), "assignments": str(assignments_csv),
        "encoder": model["encoder"], "weights": model["weights"],
        "freeze_encoder": model["freeze_encoder"] and federated["init_from"] != "head",
        "image_size": model["image_size"], "use_accelerator": config["use_accelerator"],
        "n_rounds": rounds, "local_steps": run.local_steps, "eval_every": max(1, rounds // federated["evaluations"]),
        **{key: federated[key] for key in ("batch_size", "init_lr", "lr_schedule", "momentum", "weight_decay",
                                           "client_fraction", "init_from")},
        **dict(run.variant.settings), **dict(run.partition.work),
    }
    if federated["init_from"] != "scratch":
        params.update(init_from="centralized", centralized_checkpoint=str(start_checkpoint))
    if federated["calibration_fraction"]:
        params["calibration_fraction"] = federated["calibration_fraction"]
    if federated["local_test"] != "assigned":
        params["local_test"] = federated["local_test"]
    if federated["finetune_steps"]:
        params["finetune_steps"] = federated["finetune_steps"]
    return params
