"""The keys, types and grid of a grid study (fedavg_sharding, sparse_finetuning, fed_lt,
heterogeneity_toolbox), checked before any work (errors name the key).

:func:`load_grid_study` merges a study file with its kind's schema (:func:`grid_schema`: the shared keys of
every grid study plus the kind's own), type-checks every key, checks the names against the registries and
turns the ``grid`` into the validated blocks of pipeline/studies/grid/runs.py (a partition entry is checked in
pipeline/studies/grid/partition_entry.py). A partition entry of a block is
a registered scheme with *its step-3b options*: the scheme's parameters (``alpha``, ``groups_per_client``,
``size_skew``, ``min_client_size``) and any other option of step 3b's command line (so a partition option
step 3b gains is a study option with no change here), plus two study keys: ``situation`` (the entry's name in
reports and folders) and ``class_groups`` (clients drawn from groups of classes; see
:class:`pipeline.studies.grid.runs.Partition`). The options the study sets itself (manifest, output folder,
clients, seed, client-test share, groups) and the runtime flags are refused with the key named.
"""

from __future__ import annotations

import copy
import itertools
import math
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable

from pipeline import checks
from pipeline.checks import Entry
from partitioning.assignments import MAX_CLIENTS
from partitioning.temporal import MAX_ROUNDS
from pipeline.schema import LEARNING_RATE, MOMENTUM, SHARED_TYPES, Bool, Check, Float, Int, ListOf, Str, check_types
from pipeline.sections import (LOCAL_TRAINING_HELP, SHARED_HELP, check_run_count, merge_keys, most_label_groups,
                               shared_sections, validate_data, validate_encoder, validate_lr_schedule)
from pipeline.studies.grid.params import assignment_params, federated_params
from pipeline.studies.grid.partition_entry import PartitionCheck
from pipeline.studies.grid.runs import Partition, StudyRun, Variant
from steps.federated import MAX_LOCAL_STEPS
from utils.cli import MAX_BATCH_SIZE
from utils.errors import TaskHetError

INIT_FROM = ("scratch", "centralized", "head")

# Every key of a grid study with its default (the sections shared with the main job have its defaults); a kind
# adds its own keys (grid_schema).
GRID_SCHEMA: dict[str, Any] = {
    "name": "study",
    "study": "fedavg_sharding",
    **shared_sections(),
    "task": "digit_class",  # one classification task of the data family
    "federated": {
        "n_clients": 100,  # K
        "client_fraction": 0.1,  # C
        "rounds_x_local_steps": 2000,  # rounds × J, the same for every J (rounds = this / J)
        "evaluations": 10,  # evaluations of the global model per run, spread evenly over its rounds
        "batch_size": 32,
        "init_lr": 0.01,
        "lr_schedule": "constant",
        "momentum": 0.0,
        "weight_decay": 0.0,
        "client_test_fraction": 0.0,  # the study reads the global test and validation splits only
        "init_from": "scratch",  # scratch | centralized (step 2's model) | head (step 2's head, encoder unfrozen)
        "calibration_fraction": 0.0,  # held-out train rows for sparse_ft's server masks (step 4's --calibration_fraction)
        "local_test": "assigned",  # client test sets: assigned | proportional (Fed-LT; step 4's --local_test)
        "finetune_steps": 0,  # evaluation-time fine-tuning of every client's model (step 4's --finetune_steps)
    },
    "grid": [],  # blocks: {partitions: [{scheme, ...}], local_steps: [J, ...], algorithms: {name: settings}}
    "seeds": [0, 1, 2],
    "use_accelerator": True,
    "heterogeneity_meter": False,  # step 3c per partition and seed: G², B² at step 2's model
}
GRID_TYPES: dict[str, Check] = {
    **SHARED_TYPES, "study": Str(), "task": Str(),
    "federated.n_clients": Int(1, MAX_CLIENTS), "federated.client_fraction": Float(0, 1, low_open=True),
    # rounds = this / J, at most MAX_ROUNDS for every J (step 4's --n_rounds checks each run before step 0)
    "federated.rounds_x_local_steps": Int(1, MAX_ROUNDS * MAX_LOCAL_STEPS), "federated.evaluations": Int(1, MAX_ROUNDS),
    "federated.batch_size": Int(1, MAX_BATCH_SIZE), "federated.init_lr": LEARNING_RATE,
    "federated.lr_schedule": Str(), "federated.momentum": MOMENTUM, "federated.weight_decay": Float(0, 1),
    "federated.client_test_fraction": Float(0, 1, high_open=True),
    "federated.init_from": Str(INIT_FROM), "federated.calibration_fraction": Float(0, 1, high_open=True),
    "federated.local_test": Str(("assigned", "proportional")), "federated.finetune_steps": Int(0, MAX_LOCAL_STEPS),
    "heterogeneity_meter": Bool(),
}
# What each key of a grid study does (the reference page prints it; a test requires one for every key of GRID_TYPES).
GRID_HELP = MappingProxyType({
    **SHARED_HELP, **LOCAL_TRAINING_HELP,
    "study": "the kind of study this file is (a file without the key is the main job)",
    "task": "the one classification task of the data family that every run trains",
    "federated.n_clients": "clients K of every partition",
    "federated.rounds_x_local_steps": "rounds × local steps J, the same for every J of the grid (a run's rounds: this "
                                      "/ J)",
    "federated.evaluations": "evaluations of the global model per run, spread evenly over its rounds",
    "federated.client_test_fraction": "share of each client's rows held out as its test set (0: the study reads the "
                                      "global test and validation splits only)",
    "federated.init_from": "the federated runs' starting model: scratch (untrained), centralized (step 2's model) or "
                           "head (step 2's head, trained on the frozen encoder's features; the encoder then trains too)",
    "federated.calibration_fraction": "share of the train rows held out from every client as the server's "
                                      "calibration split (sparse_ft's server masks; 0: none)",
    "federated.local_test": "client test sets: assigned (each client's own test rows) or proportional (Fed-LT: drawn "
                            "from the test split in the client's class proportions)",
    "federated.finetune_steps": "also evaluate each client's model after this many local SGD steps on its own rows "
                                "(0: off)",
    "heterogeneity_meter": "step 3c per partition and seed: G² and B² at step 2's model",
})
BLOCK_KEYS = ("partitions", "local_steps", "algorithms")
Extra = Callable[[dict[str, Any], Path], None]  # a kind's own check of a merged, validated study config


def grid_schema(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The schema of a grid-study kind: :data:`GRID_SCHEMA` and the kind's own top-level keys (``extra``)."""
    return {**copy.deepcopy(GRID_SCHEMA), **copy.deepcopy(extra or {})}


def load_grid_study(raw: dict[str, Any], source: Path, schema: dict[str, Any], types: dict[str, Check],
                    extra_checks: tuple[Extra, ...] = (), free_form: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Merge ``raw`` (a study file's mapping) with ``schema``, type-check it with ``types`` and validate it: names,
    the grid, the rounds budget, labels, the kind's ``extra_checks`` and every check steps 1–4 would make from their
    arguments (errors name the key)."""
    config = merge_keys(copy.deepcopy(schema), raw, source, free_form)
    check_types(config, source, types)
    config["tasks"] = [config["task"]]  # what the shared Pipeline steps read
    validate_study_names(config, source)
    if config["federated"]["init_from"] == "head" and not config["model"]["freeze_encoder"]:
        raise TaskHetError(f"{source}: federated.init_from head needs model.freeze_encoder: true (step 2 then trains the "
                           "head on the frozen encoder's features, which the federated runs start from)")
    size = grid_size(config["grid"], len(config["seeds"]))
    if size is not None:  # a malformed grid is reported key by key by validate_grid
        check_run_count(size, source, "Σ over grid blocks of partitions × local_steps × algorithm variants × seeds")
    config["grid"] = validate_grid(config["grid"], source, most_label_groups(config))
    budget = config["federated"]["rounds_x_local_steps"]
    for index, block in enumerate(config["grid"]):
        for position, local_steps in enumerate(block["local_steps"]):
            if budget % local_steps:
                raise TaskHetError(f"{source}: grid[{index}].local_steps[{position}] = {local_steps} does not divide "
                                   f"federated.rounds_x_local_steps {budget}: rounds × J could not stay constant")
    validate_labels(config["grid"], source)
    for check in extra_checks:
        check(config, source)
    n_clients = config["federated"]["n_clients"]
    checks.check_model_and_data(config, source)
    checks.check_partitions(config, source, partition_entries(config), n_clients)
    checks.check_algorithms(config, source, algorithm_entries(config), n_clients, "federated.n_clients",
                            calibration_hint="set federated.calibration_fraction (train rows held out for the server)")
    check_stages(config, source)
    return config


# Step 3b's and step 4's parameters a grid study sets from its own keys, by the key that sets them.
STUDY_ORIGINS = {"n_clients": "federated.n_clients", "client_test_fraction": "federated.client_test_fraction",
                 "seed": "seeds", "rand_seed": "seeds", "task": "task", "encoder": "model.encoder",
                 "weights": "model.weights", "freeze_encoder": "model.freeze_encoder", "image_size": "model.image_size",
                 "use_accelerator": "use_accelerator", "n_rounds": "federated.rounds_x_local_steps",
                 "eval_every": "federated.evaluations", **{key: f"federated.{key}" for key in GRID_SCHEMA["federated"]}}


def check_stages(config: dict[str, Any], source: Path) -> None:
    """Steps 3b and 4's own argument checks on every partition and every run of the grid, and each temporal
    schedule against the rounds of the runs that use it, before step 0 (errors name the YAML key)."""
    from steps import federated as step4

    seed = config["seeds"][0]
    for entry, partition in zip(partition_entries(config), (p for block in config["grid"] for p in block["partitions"])):
        params = assignment_params(config, partition, seed, "manifest.csv", "groups.csv" if partition.class_groups else None)
        origins = {**STUDY_ORIGINS, **{name: f"{entry.key}.{name}" for name in partition.params}}
        checks.check_partition_stage(config, Entry(entry.key, partition.scheme, params, origins), params, source)
    n_clients, parsers = config["federated"]["n_clients"], {}  # parsers: one per method for every run checked
    for index, block in enumerate(config["grid"]):
        for partition, local_steps, variant in itertools.product(block["partitions"], block["local_steps"],
                                                                 block["variants"]):
            run = StudyRun(partition, local_steps, variant, seed)
            params = federated_params(config, run, "data", "manifest.csv", "assignments.csv", "best.pt")
            key = f"grid[{index}].algorithms.{variant.algorithm}"
            origins = {**STUDY_ORIGINS, "local_steps": f"grid[{index}].local_steps", "method": f"grid[{index}].algorithms",
                       **{name: f"{key}.{name}" for name, _ in variant.settings}}
            entry = Entry(key, variant.algorithm, params, origins)
            checks.check_stage(entry, lambda argv: step4.check_arguments(argv, n_clients=n_clients, parsers=parsers), params, source)
            options = dict(partition.params)
            checks.check_schedule_fits(Entry(f"grid[{index}] ({partition.label}, J={local_steps})", partition.scheme, {}),
                                       options.get("temporal"), options.get("n_rounds"), params["n_rounds"],
                                       "federated.rounds_x_local_steps / J", source)


def partition_entries(config: dict[str, Any]) -> list[Entry]:
    """Every partition of the grid with its step-3b options (each set by ``<entry key>.<option>``)."""
    return [Entry(f"grid[{index}].partitions[{position}]", partition.scheme, dict(partition.params))
            for index, block in enumerate(config["grid"]) for position, partition in enumerate(block["partitions"])]


def algorithm_entries(config: dict[str, Any]) -> list[Entry]:
    """Every algorithm variant of the grid with its settings."""
    return [Entry(f"grid[{index}].algorithms.{variant.algorithm}", variant.algorithm, dict(variant.settings))
            for index, block in enumerate(config["grid"]) for variant in block["variants"]]


def validate_study_names(config: dict[str, Any], source: Path) -> None:
    """Data source, task (a classification task of the family), encoder and schedule against the registries."""
    from models.tasks import get_task, list_tasks

    if config["task"] not in list_tasks() or get_task(config["task"]).kind != "classification":
        raise TaskHetError(f"{source}: task {config['task']!r} must be a registered classification task (the study "
                           "reports accuracy)")
    validate_data(config, source)
    validate_encoder(config, source)
    validate_lr_schedule(config["federated"]["lr_schedule"], "federated.lr_schedule", source)


def validate_grid(grid: Any, source: Path, n_labels: int | None = None) -> list[dict[str, Any]]:
    """Each block's partitions (registered schemes and their step-3b options), J values and algorithm variants.

    ``n_labels``: the classes the data source can have (``class_groups`` must cover exactly 0..n_labels − 1).

    Returns:
        The blocks as ``{"partitions": [Partition], "local_steps": [int], "variants": [Variant]}``.
    """
    from network.algorithms import list_algorithms
    from network.algorithms.base import get_settings_class
    from network.settings import build_settings

    if not isinstance(grid, list) or not grid:
        raise TaskHetError(f"{source}: grid must list at least one block {{partitions: [...], local_steps: [...], "
                           f"algorithms: {{fedavg: {{}}}}}}, got {grid!r}")
    blocks = []
    for index, block in enumerate(grid):
        key = f"grid[{index}]"
        if not isinstance(block, dict) or set(block) != set(BLOCK_KEYS):
            raise TaskHetError(f"{source}: {key} must be a mapping with exactly the keys {', '.join(BLOCK_KEYS)}, got {block!r}")
        try:
            partitions = ListOf(PartitionCheck(n_labels))(block["partitions"], f"{key}.partitions")
            local_steps = ListOf(Int(1, MAX_LOCAL_STEPS))(block["local_steps"], f"{key}.local_steps")
        except TaskHetError as error:
            raise TaskHetError(f"{source}: {error}") from None
        algorithms = block["algorithms"]
        if not isinstance(algorithms, dict) or not algorithms:
            raise TaskHetError(f"{source}: {key}.algorithms must map algorithm names to their settings, e.g. {{fedavg: {{}}}}")
        variants = []
        for name, settings in algorithms.items():
            if name not in list_algorithms():
                raise TaskHetError(f"{source}: {key}.algorithms: {name!r} is unknown; choose from: {', '.join(list_algorithms())}")
            variants += expand_settings(name, settings, f"{source}: {key}.algorithms.{name}")
        for variant in variants:
            try:
                build_settings(get_settings_class(variant.algorithm), dict(variant.settings), variant.algorithm)
            except TaskHetError as error:
                raise TaskHetError(f"{source}: {key}.algorithms.{variant.algorithm}: {error}") from None
        blocks.append({"partitions": partitions, "local_steps": local_steps, "variants": variants})
    return blocks


def validate_labels(blocks: list[dict[str, Any]], source: Path) -> None:
    """Two different partitions may not share a label: they would share folders and report rows."""
    seen: dict[str, Partition] = {}
    for index, block in enumerate(blocks):
        for position, partition in enumerate(block["partitions"]):
            other = seen.setdefault(partition.label, partition)
            if other != partition:
                raise TaskHetError(f"{source}: grid[{index}].partitions[{position}] is named {partition.label!r} like "
                                   "another, different partition; give each situation its own name")


def grid_size(grid: Any, n_seeds: int) -> int | None:
    """The number of runs the grid asks for (duplicates across blocks counted), from list lengths alone; None when
    the grid is not shaped as blocks of lists (validate_grid then names the key)."""
    if not isinstance(grid, list):
        return None
    total = 0
    for block in grid:
        if not isinstance(block, dict) or not all(isinstance(block.get(key), list) for key in ("partitions", "local_steps")):
            return None
        algorithms = block.get("algorithms")
        if not isinstance(algorithms, dict):
            return None
        variants = sum(math.prod(len(value) if isinstance(value, list) else 1 for value in settings.values())
                       if isinstance(settings, dict) else 1 for settings in algorithms.values())
        total += len(block["partitions"]) * len(block["local_steps"]) * variants * n_seeds
    return total


def expand_settings(algorithm: str, settings: Any, key: str) -> list[Variant]:
    """One variant per combination of the list-valued settings (scalars stay fixed).

    A list that holds one value twice after conversion to the setting's type (``['0.1', 0.1]``) is an error naming
    the key: it would run the same variant twice and count one seed as two.
    """
    from network.algorithms.base import get_settings_class
    from network.settings import convert, describe

    if settings is None:
        settings = {}
    if not isinstance(settings, dict):
        raise TaskHetError(f"{key} must be a mapping of its settings (a list value is a grid over that setting)")
    infos = {info.name: info for info in describe(get_settings_class(algorithm))}
    names = sorted(settings)
    values = [settings[name] if isinstance(settings[name], list) else [settings[name]] for name in names]
    for name, options in zip(names, values):
        if not options:
            raise TaskHetError(f"{key}.{name} is an empty list")
        if name not in infos:
            continue  # an unknown setting: build_settings names it with the algorithm's settings
        try:
            converted = [convert(infos[name], option, algorithm) for option in options]
        except TaskHetError as error:
            raise TaskHetError(f"{key}.{name}: {error}") from None
        repeated = [value for index, value in enumerate(converted) if value in converted[:index]]
        if repeated:
            raise TaskHetError(f"{key}.{name} lists the value {repeated[0]!r} twice "
                               f"({options!r}); each value of a grid must be distinct after conversion to "
                               f"{infos[name].type.__name__}")
    return [Variant(algorithm, tuple(zip(names, combination))) for combination in itertools.product(*values)]
