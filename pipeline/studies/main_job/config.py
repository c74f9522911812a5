"""The main job's experiment file: every check made before step 0 (errors name the YAML key), the grid of runs and
the stage parameters.

The schema (pipeline/studies/main_job/keys.py) is the complete list of keys with their defaults. A key that is not in it, a task,
algorithm or partition scheme that is not registered, is an error naming the key, so a typo never silently
falls back to a default. The stage parameters of steps 3b and 4 are built here too (:func:`assignment_params`,
:func:`federated_params`), so the runner runs exactly what the validation checked.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partitioning.client_tests import TEST_SPLIT
from partitioning.groupings import ALL_GROUPINGS, EMBEDDING_BASED, GROUPINGS, IID_REFERENCE, PROPERTY_BASED, canonical_grouping
from pipeline import checks
from network.run_config import DP_FLAGS
from pipeline.checks import Entry
from pipeline.schema import LEARNING_RATE, Check, check_types
from pipeline.sections import check_run_count, merge_keys, validate_data, validate_encoder, validate_lr_schedule
from pipeline.studies.main_job.keys import FREE_FORM, HELP, IID_SCHEME, NOT_PER_TASK, SCHEMA, TYPES  # noqa: F401
from utils.errors import TaskHetError


@dataclass(frozen=True)
class Combination:
    """One federated run of the experiment grid."""

    task: str
    grouping: str
    alpha: float
    algorithm: str
    seed: int

    def label(self) -> str:
        partition = self.grouping if self.grouping == IID_REFERENCE else f"{self.grouping} · α={self.alpha:g}"
        return f"{self.task} · {partition} · {self.algorithm} · seed {self.seed}"


def load(raw: dict[str, Any], source: Path) -> dict[str, Any]:
    """Merge, type-check and validate a main-job file (``raw``: its YAML mapping); errors name the key.

    Every key is checked against :data:`TYPES` (type, range, list-ness) before any name is looked up, and all of
    it before step 0 runs; an empty file is an error, not a default run.
    """
    config = merge_keys(copy.deepcopy(SCHEMA), raw, source, FREE_FORM)
    check_types(config, source, TYPES)
    # Old names (class_based) are replaced before anything reads them: folders and the report use one name.
    config["partition"]["groupings"] = [canonical_grouping(name) for name in config["partition"]["groupings"]]
    validate_names(config, source)
    check_run_count(count_combinations(config), source, "tasks × partition.groupings × partition.alphas × "
                    "federated.algorithms × seeds (+ the iid reference)")
    checks.check_model_and_data(config, source)
    checks.check_partitions(config, source, partition_entries(config), config["partition"]["n_clients"])
    checks.check_algorithms(config, source, algorithm_entries(config), config["partition"]["n_clients"],
                            "partition.n_clients", calibration_hint="an experiment file has no calibration split: use "
                            "a study file with federated.calibration_fraction")
    check_alpha_labels(config, source)
    check_stages(config, source)
    return config


def count_combinations(config: dict[str, Any]) -> int:
    """How many runs :func:`combinations` will list, from the list lengths alone (nothing is expanded)."""
    partition = config["partition"]
    per_partition = len(config["federated"]["algorithms"]) * len(config["seeds"])
    grid = len(config["tasks"]) * sum(len(grouping_alphas(config, grouping)) for grouping in partition["groupings"]) \
        * per_partition
    return grid + (len(config["tasks"]) * per_partition if partition["iid_reference"] else 0)


def validate_names(config: dict[str, Any], source: Path) -> None:
    """Check tasks, encoder, algorithms, scheme and groupings against the registries."""
    from models.tasks import list_tasks
    from network.algorithms import list_algorithms
    from partitioning.partition import list_schemes
    from steps.skew_flags import SKEW_FLAGS

    def check(key: str, values: list[str], known: list[str]) -> None:
        for value in values:
            if value not in known:
                raise TaskHetError(f"{source}: {key} {value!r} is unknown; choose from: {', '.join(known)}")

    check("tasks", list(config["tasks"]), list_tasks())
    validate_data(config, source)
    validate_encoder(config, source)
    algorithms = config["federated"]["algorithms"]
    check("federated.algorithms", list(algorithms), list_algorithms())
    checks.check_algorithm_settings(algorithms, source, "federated.algorithms")
    check("partition.scheme", [config["partition"]["scheme"]], list_schemes())
    validate_lr_schedule(config["federated"]["lr_schedule"], "federated.lr_schedule", source)
    check_partition_flags(config, source)
    check("partition.groupings", list(config["partition"]["groupings"]), list(ALL_GROUPINGS))
    check("partition.skews", list(config["partition"]["skews"]), list(SKEW_FLAGS))
    check("federated.privacy", list(config["federated"]["privacy"]), ["dp_clip", *DP_FLAGS])
    if not set(GROUPINGS) <= set(config["partition"]["groupings"]):
        raise TaskHetError(f"{source}: partition.groupings must list both {' and '.join(GROUPINGS)}: the report "
                           f"compares them; got {config['partition']['groupings']}")
    validate_property_groups(config, source)
    validate_per_task(config, source)
    for task, lr in config["federated"]["task_init_lr"].items():
        if task not in config["tasks"]:
            raise TaskHetError(f"{source}: federated.task_init_lr names task {task!r}, which is not in tasks {config['tasks']}")
        LEARNING_RATE(lr, f"{source}: federated.task_init_lr.{task}")


def check_partition_flags(config: dict[str, Any], source: Path) -> None:
    """partition.size_skew and partition.temporal through step 3b's own parsers, their messages naming the key."""
    from partitioning.allocation import parse_size_skew
    from partitioning.temporal import parse_temporal, phase_windows

    def temporal_fits() -> None:
        spec = parse_temporal(config["partition"]["temporal"])
        if spec is not None:
            phase_windows(spec, config["federated"]["n_rounds"])

    for key, flag, parse in (("partition.size_skew", "--size_skew", lambda: parse_size_skew(config["partition"]["size_skew"])),
                             ("partition.temporal", "--temporal", temporal_fits)):
        try:
            parse()
        except TaskHetError as error:
            raise TaskHetError(f"{source}: {str(error).replace(flag, key)}") from None


def validate_property_groups(config: dict[str, Any], source: Path) -> None:
    """The positive control (partition.groupings holds property_based) bins a dense target: every task must be dense."""
    from models.tasks import get_task

    chosen = config["partition"].get("property_alphas")
    if chosen is not None:
        strays = [alpha for alpha in chosen if alpha not in config["partition"]["alphas"]]
        if strays or not chosen:
            raise TaskHetError(f"{source}: partition.property_alphas must list some of partition.alphas "
                               f"{config['partition']['alphas']} (the control is compared at the question's α); got "
                               f"{chosen}")
    if PROPERTY_BASED not in config["partition"]["groupings"]:
        return
    for task in config["tasks"]:
        if get_task(task).kind != "dense":
            raise TaskHetError(f"{source}: partition.groupings lists {PROPERTY_BASED}, which bins each sample's dense "
                               f"target, but task {task!r} is a {get_task(task).kind} task (its target is its label): "
                               "drop the task or the grouping")


def validate_per_task(config: dict[str, Any], source: Path) -> None:
    """federated.per_task: each task one of ``tasks``, each key a federated key, each value of that key's type."""
    allowed = [key for key in config["federated"] if key not in NOT_PER_TASK]
    for task, changes in config["federated"]["per_task"].items():
        where = f"federated.per_task.{task}"
        if task not in config["tasks"]:
            raise TaskHetError(f"{source}: {where} names task {task!r}, which is not in tasks {config['tasks']}")
        if not isinstance(changes, dict) or not changes:
            raise TaskHetError(f"{source}: {where} must map federated keys to this task's values, e.g. "
                               f"{{batch_size: 64, lr_schedule: cosine}}, got {changes!r}")
        for key, value in changes.items():
            if key not in allowed:
                raise TaskHetError(f"{source}: {where}.{key} is not a federated key a task may change; allowed: "
                                   f"{', '.join(allowed)}")
            try:
                changes[key] = TYPES[f"federated.{key}"](value, f"{where}.{key}")
            except TaskHetError as error:
                raise TaskHetError(f"{source}: {error}") from None
            if key == "lr_schedule":
                validate_lr_schedule(value, f"{where}.lr_schedule", source)


def task_federated(config: dict[str, Any], task: str) -> dict[str, Any]:
    """The federated keys of ``task``'s runs: the shared ones, its task_init_lr, then its per_task changes."""
    federated = {key: value for key, value in config["federated"].items() if key not in NOT_PER_TASK}
    federated["init_lr"] = config["federated"]["task_init_lr"].get(task, federated["init_lr"])
    return {**federated, **config["federated"]["per_task"].get(task, {})}


def check_alpha_labels(config: dict[str, Any], source: Path) -> None:
    """Two α that print alike (``a{α:g}``) would share folder names and report rows: refuse them."""
    seen: dict[str, float] = {}
    for alpha in config["partition"]["alphas"]:
        label = f"{float(alpha):g}"
        if label in seen:
            raise TaskHetError(f"{source}: partition.alphas {seen[label]!r} and {alpha!r} both print as α={label} (folder "
                               f"a{label}, the report's rows); give values that differ in 6 significant digits")
        seen[label] = alpha


def combinations(config: dict[str, Any]) -> list[Combination]:
    """Every federated run of the grid, in the order the pipeline runs them (the iid reference runs last; α = inf)."""
    algorithms = list(config["federated"]["algorithms"])
    grid = [
        Combination(task, grouping, float(alpha), algorithm, int(seed))
        for task in config["tasks"] for grouping in config["partition"]["groupings"]
        for alpha in grouping_alphas(config, grouping) for algorithm in algorithms for seed in config["seeds"]
    ]
    if config["partition"]["iid_reference"]:
        grid += [Combination(task, IID_REFERENCE, math.inf, algorithm, int(seed))
                 for task, algorithm, seed in itertools.product(config["tasks"], algorithms, config["seeds"])]
    return grid


def grouping_alphas(config: dict[str, Any], grouping: str) -> list[float]:
    """The α values ``grouping``'s partitions are drawn at: partition.property_alphas for the positive control where
    given, partition.alphas otherwise."""
    partition = config["partition"]
    if grouping == PROPERTY_BASED and partition.get("property_alphas") is not None:
        return list(partition["property_alphas"])
    return list(partition["alphas"])


def partition_key(combination: Combination) -> tuple:
    """Combinations with the same key share one assignments file (label and iid partitions are task-free)."""
    owner = combination.task if combination.grouping in (EMBEDDING_BASED, PROPERTY_BASED) else "labels"
    return owner, combination.grouping, combination.alpha, combination.seed


# ----- stage parameters: what the runner passes to steps 3b and 4, and what the validation checks -----
def assignment_params(config: dict[str, Any], grouping: str, alpha: float, seed: int, manifest: Path | str,
                      groups: str | None) -> dict[str, Any]:
    """Step 3b's parameters for one partition (``groups``: the clusters file of an embedding-based one, the property
    bins of a property-based one)."""
    partition = config["partition"]
    iid = grouping == IID_REFERENCE
    params = {
        "manifest": str(manifest), "groups": groups, "scheme": IID_SCHEME if iid else partition["scheme"],
        "alpha": None if iid else alpha, "n_clients": partition["n_clients"],
        "size_skew": partition["size_skew"], "seed": seed,
        **partition["skews"],  # per-client feature skew / concept shift (partitioning/skews.py), iid reference too
    }
    # Only a test_split run names --client_tests: the stage keys of held-out runs stay as they were.
    params.update({"client_tests": TEST_SPLIT} if partition["client_tests"] == TEST_SPLIT
                  else {"client_test_fraction": partition["client_test_fraction"]})
    if partition.get("temporal") and not iid:  # only then: the stage keys of static partitions stay as they were
        params.update(temporal=partition["temporal"], n_rounds=config["federated"]["n_rounds"])
    return params


def embedding_params(config: dict[str, Any], seed: int, checkpoint: Path | str, manifest: Path | str,
                     root: Path | str) -> dict[str, Any]:
    """Step 3's parameters for the step-2 model ``checkpoint`` of ``seed`` (``allow_untrained`` is a flag outside
    them: it changes no output)."""
    embeddings = {key: value for key, value in config["embeddings"].items() if key != "allow_untrained"}
    return {"checkpoint": str(checkpoint), "manifest": str(manifest), "data_path": str(root), "seed": seed,
            **embeddings}


def federated_params(config: dict[str, Any], combination: Combination, root: Path | str, manifest: Path | str,
                     assignments_csv: Path | str, centralized_checkpoint: Path | str) -> dict[str, Any]:
    """Step 4's parameters for one combination."""
    federated = task_federated(config, combination.task)
    model = config["model"]
    hyper = config["federated"]["algorithms"][combination.algorithm] or {}
    params = {
        "task": combination.task, "method": combination.algorithm, "rand_seed": combination.seed,
        "alpha": None if combination.grouping == IID_REFERENCE else combination.alpha,
        "data_path": str(root), "manifest": str(manifest), "assignments": str(assignments_csv),
        "encoder": model["encoder"],
        # the same pretrained weights and decoder as step 2's model, for runs that start from scratch
        "weights": model["weights"], "decoder_width": model["decoder_width"],
        "freeze_encoder": model["freeze_encoder"], "cache_features": model["cache_features"],
        "image_size": model["image_size"], "use_accelerator": config["use_accelerator"],
        **federated, **config["federated"]["privacy"], **hyper,
    }
    if federated["init_from"] == "centralized":
        params["centralized_checkpoint"] = str(centralized_checkpoint)
    return params


# Step 3b's parameters -> the key of the main job's file that sets them (a skew flag is partition.skews.<flag>).
PARTITION_ORIGINS = {"alpha": "partition.alphas", "scheme": "partition.scheme", "n_clients": "partition.n_clients",
                     "size_skew": "partition.size_skew", "temporal": "partition.temporal", "n_rounds": "federated.n_rounds",
                     "client_tests": "partition.client_tests", "client_test_fraction": "partition.client_test_fraction"}


def partition_entries(config: dict[str, Any]) -> list[Entry]:
    """Every partition step 3b will be asked for, with the keys that set its parameters."""
    partition = config["partition"]
    origins = {**PARTITION_ORIGINS, **{flag: f"partition.skews.{flag}" for flag in partition["skews"]}}
    found = [Entry("partition", partition["scheme"], {"alpha": alpha, "size_skew": partition["size_skew"]}, origins)
             for alpha in partition["alphas"]]
    if partition["iid_reference"]:
        found.append(Entry("partition.iid_reference", IID_SCHEME, {"size_skew": partition["size_skew"]}, origins))
    return found


def algorithm_entries(config: dict[str, Any]) -> list[Entry]:
    """Every algorithm configuration step 4 will run."""
    return [Entry(f"federated.algorithms.{name}", name, settings or {})
            for name, settings in config["federated"]["algorithms"].items()]


def check_stages(config: dict[str, Any], source: Path) -> None:
    """Steps 3b and 4's own argument checks on every partition and every kind of run the grid will ask for, and
    each task's rounds against a temporal schedule, before step 0 (errors name the YAML key)."""
    from steps import federated as step4

    partition, seed = config["partition"], config["seeds"][0]
    for entry in partition_entries(config):
        groupings = [IID_REFERENCE] if entry.name == IID_SCHEME else partition["groupings"]
        for grouping in groupings:
            groups = "clusters.csv" if grouping == EMBEDDING_BASED else None
            params = assignment_params(config, grouping, entry.params.get("alpha", math.inf), seed, "manifest.csv", groups)
            checks.check_partition_stage(config, Entry(entry.key, params["scheme"], params, entry.origins), params, source)
    references = [IID_REFERENCE] if partition["iid_reference"] else []
    n_clients, parsers = partition["n_clients"], {}  # parsers: one per method for every run checked
    for task, algorithm, grouping in itertools.product(config["tasks"], config["federated"]["algorithms"],
                                                       [partition["groupings"][0], *references]):
        combination = Combination(task, grouping, float(partition["alphas"][0]), algorithm, seed)
        params = federated_params(config, combination, "data", "manifest.csv", "assignments.csv", "best.pt")
        entry = Entry(f"federated ({task}, {algorithm})", algorithm, params, run_origins(config, task, algorithm))
        checks.check_stage(entry, lambda argv: step4.check_arguments(argv, n_clients=n_clients, parsers=parsers), params,
                           source)
    for task in config["tasks"]:
        rounds = task_federated(config, task)["n_rounds"]
        rounds_key = f"federated.per_task.{task}.n_rounds" if "n_rounds" in config["federated"]["per_task"].get(task, {}) \
            else "federated.n_rounds"
        checks.check_schedule_fits(Entry("partition.temporal", partition["scheme"], {}), partition["temporal"],
                                   config["federated"]["n_rounds"], rounds, rounds_key, source)


def run_origins(config: dict[str, Any], task: str, algorithm: str) -> dict[str, str]:
    """Step 4's parameters of ``task``'s ``algorithm`` runs -> the key of the file that sets each."""
    federated = config["federated"]
    origins = {key: f"federated.{key}" for key in federated if key not in NOT_PER_TASK}
    origins.update({key: f"federated.per_task.{task}.{key}" for key in federated["per_task"].get(task, {})})
    if task in federated["task_init_lr"]:
        origins["init_lr"] = f"federated.task_init_lr.{task}"
    origins.update({key: f"federated.privacy.{key}" for key in federated["privacy"]})
    origins.update({key: f"federated.algorithms.{algorithm}.{key}" for key in federated["algorithms"][algorithm] or {}})
    origins.update({"task": "tasks", "method": "federated.algorithms", "rand_seed": "seeds", "alpha": "partition.alphas",
                    "image_size": "model.image_size", "encoder": "model.encoder", "weights": "model.weights",
                    "decoder_width": "model.decoder_width", "freeze_encoder": "model.freeze_encoder",
                    "cache_features": "model.cache_features", "use_accelerator": "use_accelerator"})
    return origins
