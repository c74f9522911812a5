"""Experiment files for run_pipeline.py: one YAML file, validated before any work starts.

The schema below is the complete list of keys with their defaults. A key that is
not in it, a task, algorithm or partition scheme that is not registered, is an
error naming the key, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partitioning.client_tests import DEFAULT_TEST_FRACTION, HELD_OUT
from partitioning.groupings import GROUPINGS, IID_REFERENCE, canonical_grouping
from pipeline.checks import check_config
from pipeline.schema import check_types
from utils.errors import TaskHetError
from utils.loaders import load_yaml

# data.source -> the data family that reads it (synthetic buildings are written in the Taskonomy layout).
DATA_SOURCES = {"synthetic": "taskonomy", "taskonomy": "taskonomy", "digits": "digits", "cifar10": "cifar", "cifar100": "cifar"}
# Keys of the data section that only some sources read (a key set for another source is an error).
SOURCE_KEYS = {"imbalance_factor": ("cifar10", "cifar100", "digits"), "val_fraction": ("cifar10", "cifar100"),
               "verify_checksums": ("cifar10", "cifar100")}

# Every key an experiment file may set, with its default. Nested dicts are sections;
# a value of None means "no default: the file must set it" only where noted in README.
SCHEMA: dict[str, Any] = {
    "name": "experiment",
    "data": {
        "source": "synthetic",  # synthetic | taskonomy | digits | cifar10 | cifar100 (see DATA_SOURCES)
        "root": "data/synthetic",  # ignored by digits (scikit-learn ships the images); cifar: torchvision's folders' parent
        "synthetic": {"n_buildings": 24, "n_views": 50, "image_size": 64, "seed": 0},
        "split_csv": None,  # taskonomy only, required: the split CSV (id,train,val,test), relative to root unless absolute
        "buildings": None,  # taskonomy only: list of buildings to include (None: all on disk)
        "top_k_classes": 16,  # taskonomy/synthetic only
        "test_fraction": 0.2,
        "split_by": "building",  # taskonomy/synthetic only
        "n_samples": None,  # digits only: samples kept, stratified by digit (None: all 1,797)
        "imbalance_factor": None,  # cifar and digits: n_min / n_max of the long-tailed training set (None: 1.0, balanced)
        "val_fraction": None,  # cifar only: stratified share of the training set kept for validation (None: 0.1)
        "verify_checksums": None,  # cifar only: torchvision's md5 check (None: on; off only for hand-made files)
    },
    "tasks": ["depth_euclidean", "normal", "segment_semantic", "class_scene"],
    # cache_features: with freeze_encoder, the encoder's maps are computed once per sample (steps 2, 3c, 4)
    # decoder_width: channels of the dense decoder (None: the encoder's default)
    "model": {"encoder": "resnet50", "weights": "none", "image_size": 64, "embedding_grid": 0, "freeze_encoder": False,
              "cache_features": False, "decoder_width": None},
    "centralized": {
        "n_epochs": 10,
        "batch_size": 32,
        "init_lr": 1e-3,
        "optimizer": "adamw",
        "scheduler": "cosine",
        "weight_decay": 1e-4,
        "early_stopping_patience": 0,
        "warmup_epochs": 0,  # linear warmup epochs (step 2's --warmup_epochs)
        "step_size": 10,  # scheduler step: epochs between decays
        "gamma": 0.1,  # scheduler step: decay factor
        "momentum": 0.9,  # SGD momentum
        "lr_decay_rate": 0.95,  # scheduler exponential: factor per epoch
    },
    "embeddings": {"n_clusters": 10, "pca_dim": None},
    "partition": {
        "groupings": list(GROUPINGS),
        "scheme": "dirichlet_mixture",
        "alphas": [0.1, 1.0],
        "n_clients": 10,
        "client_test_fraction": DEFAULT_TEST_FRACTION,  # client_tests held_out: share of each client's rows held out as its test set
        "client_tests": HELD_OUT,  # or test_split: the manifest's test rows, dealt to clients (step 3b --client_tests)
        "size_skew": None,
        "temporal": None,  # temporal skew (step 3b's --temporal, scheduled up to federated.n_rounds)
        "skews": {},  # step 3b's per-client skews by flag name, e.g. {feature_noise: 0.2, label_swap: 1, concept_fraction: 0.3}
        "iid_reference": False,  # also run every algorithm and seed on an iid partition (the report's reference)
    },
    "heterogeneity_meter": True,  # step 3c: G² and B² of every label/embedding partition at the centralized model
    "federated": {
        "algorithms": {"fedavg": {}, "fedprox": {"mu": 0.01}, "scaffold": {}, "fedrep": {}},
        "n_rounds": 10,
        "local_steps": 5,
        "batch_size": 16,
        "init_lr": 0.01,
        "task_init_lr": {},  # task -> its own local learning rate (tasks not listed use init_lr)
        "per_task": {},  # task -> {federated key: value} for that task's runs (e.g. a cheap head trains longer)
        "momentum": 0.0,  # local SGD momentum (a fresh buffer each round)
        "weight_decay": 0.0,  # local SGD weight decay
        "lr_schedule": "constant",
        "client_fraction": 1.0,
        "eval_every": 1,
        "checkpoint_every": 1,  # step 4 writes checkpoint.pt every this many rounds (a killed run redoes the rest)
        "init_from": "scratch",
    },
    "seeds": [0, 1],
    "use_accelerator": True,
}

# The most federated runs one experiment or study file may ask for. The grid is counted from its list lengths
# before anything expands it, so a typo such as five 60-value lists (7.8e8 runs) is one error line, not a
# MemoryError; 10,000 is 12 times paper.yaml's 840 runs, and at ~2 s per tiny digits run already 5.5 hours.
MAX_RUNS = 10_000

# Sections whose values are free-form mappings (algorithm name -> its hyperparameters).
FREE_FORM = {"federated.algorithms", "federated.task_init_lr", "federated.per_task", "partition.skews",
             "practitioners_table"}
# federated keys that federated.per_task may not change: the grid and the other per-task mappings.
NOT_PER_TASK = ("algorithms", "task_init_lr", "per_task")


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


def load_experiment(path: Path) -> dict[str, Any]:
    """Read, type-check, merge with defaults and validate an experiment file (errors name the key).

    A file with a top-level ``study`` key is a study (pipeline/study.py: its own keys and grid).

    Every key is checked against :data:`TYPES` (type, range, list-ness) before any name is looked
    up, and all of it before step 0 runs; an empty file is an error, not a default run.
    """
    path = Path(path)
    raw = load_yaml(path, "experiment file")
    if isinstance(raw, dict) and "study" in raw:  # a study file has its own keys (pipeline/study.py)
        from pipeline.study_validation import load_study

        return load_study(path)
    if not isinstance(raw, dict):
        raise TaskHetError(f"{path}: expected a mapping of keys at the top level, got {type(raw).__name__}")
    config = _merge(copy.deepcopy(SCHEMA), raw, prefix="", source=path)
    check_types(config, path)
    # Old names (class_based) are replaced before anything reads them: folders and the report use one name.
    config["partition"]["groupings"] = [canonical_grouping(name) for name in config["partition"]["groupings"]]
    validate_names(config, path)
    check_run_count(count_combinations(config), path, "tasks × partition.groupings × partition.alphas × "
                    "federated.algorithms × seeds (+ the iid reference)")
    check_config(config, path)  # what steps 1-4 would refuse from their arguments, before step 0 (pipeline/checks.py)
    return config


def check_run_count(count: int, source: Path, product: str) -> None:
    """Refuse a grid of more than :data:`MAX_RUNS` federated runs, printing the count (issue 19)."""
    if count > MAX_RUNS:
        raise TaskHetError(f"{source}: the grid asks for {count:,} federated runs ({product}), above the limit of "
                           f"{MAX_RUNS:,} runs per file (pipeline/experiment.py MAX_RUNS); split it into several files")


def count_combinations(config: dict[str, Any]) -> int:
    """How many runs :func:`combinations` will list, from the list lengths alone (nothing is expanded)."""
    partition = config["partition"]
    per_partition = len(config["federated"]["algorithms"]) * len(config["seeds"])
    grid = len(config["tasks"]) * len(partition["groupings"]) * len(partition["alphas"]) * per_partition
    return grid + (len(config["tasks"]) * per_partition if partition["iid_reference"] else 0)


def _merge(defaults: dict[str, Any], given: dict[str, Any], prefix: str, source: Path) -> dict[str, Any]:
    for key, value in given.items():
        dotted = f"{prefix}{key}"
        if key not in defaults:
            allowed = ", ".join(sorted(defaults))
            raise TaskHetError(f"{source}: unknown key {dotted!r}; allowed here: {allowed}")
        if isinstance(defaults[key], dict) and dotted not in FREE_FORM:
            if not isinstance(value, dict):
                raise TaskHetError(f"{source}: key {dotted!r} must be a mapping")
            defaults[key] = _merge(defaults[key], value, prefix=f"{dotted}.", source=source)
        else:
            defaults[key] = value
    return defaults


def validate_names(config: dict[str, Any], source: Path) -> None:
    """Check tasks, encoder, algorithms, scheme and groupings against the registries."""
    from models import list_encoders
    from models.tasks import list_tasks
    from network.algorithms import list_algorithms
    from network.lr_schedule import make_lr_schedule
    from partitioning.allocation import parse_size_skew
    from partitioning.temporal import parse_temporal, phase_windows

    def temporal_fits(config: dict[str, Any]) -> None:
        spec = parse_temporal(config["partition"]["temporal"])
        if spec is not None:
            phase_windows(spec, config["federated"]["n_rounds"])
    from partitioning.partition import list_schemes
    from steps.skew_flags import SKEW_FLAGS

    def check(key: str, values: list[str], known: list[str]) -> None:
        for value in values:
            if value not in known:
                raise TaskHetError(f"{source}: {key} {value!r} is unknown; choose from: {', '.join(known)}")

    check("data.source", [config["data"]["source"]], list(DATA_SOURCES))
    validate_split_csv(config["data"], source)
    validate_source_keys(config["data"], source)
    check("tasks", list(config["tasks"]), list_tasks())
    validate_family_tasks(config, source)
    check("model.encoder", [config["model"]["encoder"]], list_encoders())
    algorithms = config["federated"]["algorithms"]
    if not isinstance(algorithms, dict):
        raise TaskHetError(f"{source}: federated.algorithms must map algorithm names to their settings, e.g. "
                           "{fedavg: {}, fedprox: {mu: 0.01}}")
    check("federated.algorithms", list(algorithms), list_algorithms())
    validate_algorithm_settings(algorithms, source)
    check("partition.scheme", [config["partition"]["scheme"]], list_schemes())
    flag_checks = (("federated.lr_schedule", "--lr_schedule", lambda: make_lr_schedule(config["federated"]["lr_schedule"], 1.0, 1)),
                   ("partition.size_skew", "--size_skew", lambda: parse_size_skew(config["partition"]["size_skew"])),
                   ("partition.temporal", "--temporal", lambda: temporal_fits(config)))
    for key, flag, parse in flag_checks:  # the step's own parser, its message re-addressed to the YAML key
        try:
            parse()
        except TaskHetError as error:
            raise TaskHetError(f"{source}: {str(error).replace(flag, key)}") from None
    check("partition.groupings", list(config["partition"]["groupings"]), list(GROUPINGS))
    check("partition.skews", list(config["partition"]["skews"]), list(SKEW_FLAGS))  # values: step 3b checks them
    if sorted(set(config["partition"]["groupings"])) != sorted(GROUPINGS):
        raise TaskHetError(f"{source}: partition.groupings must list both {' and '.join(GROUPINGS)}: the report "
                           f"compares them; got {config['partition']['groupings']}")
    validate_per_task(config, source)
    for task, lr in config["federated"]["task_init_lr"].items():
        if task not in config["tasks"]:
            raise TaskHetError(f"{source}: federated.task_init_lr names task {task!r}, which is not in tasks {config['tasks']}")
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
            raise TaskHetError(f"{source}: federated.task_init_lr.{task} must be a number > 0, got {lr!r}")


def validate_per_task(config: dict[str, Any], source: Path) -> None:
    """federated.per_task: each task one of ``tasks``, each key a federated key, each value of that key's type."""
    from network.lr_schedule import make_lr_schedule
    from pipeline.schema import TYPES

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
                if key == "lr_schedule":
                    make_lr_schedule(value, 1.0, 1)
            except TaskHetError as error:
                raise TaskHetError(f"{source}: {str(error).replace('--lr_schedule', f'{where}.lr_schedule')}") from None


def task_federated(config: dict[str, Any], task: str) -> dict[str, Any]:
    """The federated section one task's runs use: the shared keys, then task_init_lr, then federated.per_task."""
    federated = {key: value for key, value in config["federated"].items() if key not in NOT_PER_TASK}
    federated["init_lr"] = config["federated"]["task_init_lr"].get(task, federated["init_lr"])
    return {**federated, **config["federated"]["per_task"].get(task, {})}


def validate_split_csv(data: dict[str, Any], source: Path) -> None:
    """Real Taskonomy needs its split CSV named (the renderer writes its own; digits has none)."""
    split_csv = data["split_csv"]
    if data["source"] == "taskonomy":
        if not isinstance(split_csv, str) or not split_csv.strip():
            raise TaskHetError(f"{source}: data.split_csv is required for data.source taskonomy: the split CSV "
                               "(id,train,val,test) download_taskonomy.py wrote, e.g. train_val_test_tiny.csv, "
                               "relative to data.root unless absolute")
    elif split_csv is not None:
        raise TaskHetError(f"{source}: data.split_csv is only for data.source taskonomy (data.source is {data['source']!r})")


def validate_source_keys(data: dict[str, Any], source: Path) -> None:
    """A data key that only other sources read is an error, not silently ignored."""
    for key, sources in SOURCE_KEYS.items():
        if data[key] is not None and data["source"] not in sources:
            raise TaskHetError(f"{source}: data.{key} is only for data.source {' or '.join(sources)} "
                               f"(data.source is {data['source']!r})")


def split_csv_path(data: dict[str, Any]) -> Path:
    """The split CSV of a taskonomy experiment: ``data.split_csv``, relative to ``data.root`` unless absolute."""
    path = Path(data["split_csv"])
    return path if path.is_absolute() else Path(data["root"]) / path


def validate_family_tasks(config: dict[str, Any], source: Path) -> None:
    """Every task must be one the data source's family can feed (digits has digit_class, Taskonomy the rest)."""
    from datasets.family import get_family

    family = get_family(DATA_SOURCES[config["data"]["source"]])
    for task in config["tasks"]:
        family.check_task(task, f"{source}: tasks (data.source {config['data']['source']})")


def validate_algorithm_settings(algorithms: dict[str, Any], source: Path) -> None:
    """Each algorithm's settings against its own ``Settings`` (types, ranges, no foreign keys)."""
    from network.algorithms.base import get_settings_class
    from network.settings import build_settings

    for name, settings in algorithms.items():
        if settings is not None and not isinstance(settings, dict):
            raise TaskHetError(f"{source}: federated.algorithms.{name} must be a mapping of its settings")
        try:
            build_settings(get_settings_class(name), settings or {}, name)
        except TaskHetError as error:
            raise TaskHetError(f"{source}: federated.algorithms.{name}: {error}") from None


def combinations(config: dict[str, Any]) -> list[Combination]:
    """Every federated run of the grid, in the order the pipeline runs them (the iid reference runs last; α = inf)."""
    algorithms = list(config["federated"]["algorithms"])
    grid = [
        Combination(task, grouping, float(alpha), algorithm, int(seed))
        for task, grouping, alpha, algorithm, seed in itertools.product(
            config["tasks"], config["partition"]["groupings"], config["partition"]["alphas"], algorithms,
            config["seeds"])
    ]
    if config["partition"]["iid_reference"]:
        grid += [Combination(task, IID_REFERENCE, math.inf, algorithm, int(seed))
                 for task, algorithm, seed in itertools.product(config["tasks"], algorithms, config["seeds"])]
    return grid
