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
sparsity, calibration rounds and mask rule).

``federated.init_from: head`` is issue 15's step 0: step 2 runs with ``model.freeze_encoder``
(a linear head on the frozen pretrained features), the study copies its ``best.pt`` with the
encoder unfrozen into ``head/s<seed>-<key>/``, and every federated run (dense or sparse)
fine-tunes the whole model from there (``sparse_ft`` keeps the head frozen, as TaLoS does).

Layout under ``results/<name>/``::

    step1-<key>/manifest.csv
    centralized/<task>-<key>/                             step 2, one per seed
    head/s<seed>-<key>/best.pt                            init_from head: step 2's model, encoder unfrozen
    calibration/s<seed>-<key>/manifest.csv                calibration_fraction: the manifest without the server's rows
    assignments/<partition>-s<seed>-<key>/                step 3b, shared by every J and algorithm
    federated/<partition>/J<j>/<variant>/s<seed>-<key>/   step 4 (resumes from its checkpoint)
    report.md, report.csv, *.png
"""

from __future__ import annotations

import copy
import itertools
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from pipeline.experiment import (DATA_SOURCES, SCHEMA, _merge, check_run_count, validate_family_tasks,
                                 validate_source_keys, validate_split_csv)
from pipeline.checks import check_config
from pipeline.schema import TYPES, Float, Int, ListOf, Str, check_types
from pipeline.stages import stage_key
from utils.errors import TaskHetError
from utils.loaders import load_yaml

# study name -> the module whose ``write_report(config, out_dir, run_dirs, centralized, command)`` writes its report
# (imported when the study runs: the report modules import matplotlib and pandas).
STUDY_REPORTS = {"fedavg_sharding": "pipeline.study_report", "sparse_finetuning": "pipeline.sparse_report"}
INIT_FROM = ("scratch", "centralized", "head")

# Every key of a study file with its default (the sections shared with the main job have its defaults).
STUDY_SCHEMA: dict[str, Any] = {
    "name": "study",
    "study": "fedavg_sharding",
    "data": copy.deepcopy(SCHEMA["data"]),
    "task": "digit_class",  # one classification task of the data family
    "model": copy.deepcopy(SCHEMA["model"]),
    "centralized": copy.deepcopy(SCHEMA["centralized"]),
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
    },
    "grid": [],  # blocks: {partitions: [{scheme, ...}], local_steps: [J, ...], algorithms: {name: settings}}
    "seeds": [0, 1, 2],
    "use_accelerator": True,
}
STUDY_TYPES = {**{key: check for key, check in TYPES.items() if key.split(".")[0] in ("name", "data", "model", "centralized",
                                                                                      "seeds", "use_accelerator")},
               "study": Str(tuple(STUDY_REPORTS)), "task": Str(),
               "federated.n_clients": Int(1), "federated.client_fraction": Float(0, 1, low_open=True),
               "federated.rounds_x_local_steps": Int(1), "federated.evaluations": Int(1),
               "federated.batch_size": Int(1), "federated.init_lr": Float(0, low_open=True),
               "federated.lr_schedule": Str(), "federated.momentum": Float(0), "federated.weight_decay": Float(0),
               "federated.client_test_fraction": Float(0, 1, high_open=True),
               "federated.init_from": Str(INIT_FROM), "federated.calibration_fraction": Float(0, 1, high_open=True)}
BLOCK_KEYS = ("partitions", "local_steps", "algorithms")
# Short names of scheme parameters in folder names and report rows (nc_shards-nc5, dirichlet_split-a0.1).
PARAM_LABELS = {"groups_per_client": "nc", "alpha": "a"}


@dataclass(frozen=True)
class Partition:
    """A registered scheme with its parameters; ``label`` names its folder and report rows."""

    scheme: str
    params: tuple[tuple[str, Any], ...]

    @property
    def label(self) -> str:
        return "-".join([self.scheme] + [f"{PARAM_LABELS.get(key, key)}{value}" for key, value in self.params])

    @property
    def groups_per_client(self) -> int | None:
        return dict(self.params).get("groups_per_client")


@dataclass(frozen=True)
class Variant:
    """An algorithm with one value of each setting; ``label`` names its folder and report rows."""

    algorithm: str
    settings: tuple[tuple[str, Any], ...]

    @property
    def label(self) -> str:
        return "-".join([self.algorithm] + [f"{key}{value}" for key, value in self.settings])


@dataclass(frozen=True)
class StudyRun:
    """One federated run of the study grid."""

    partition: Partition
    local_steps: int
    variant: Variant
    seed: int


def load_study(path: Path) -> dict[str, Any]:
    """Read, type-check, merge with :data:`STUDY_SCHEMA` and validate a study file (errors name the key)."""
    path = Path(path)
    raw = load_yaml(path, "experiment file")
    if not isinstance(raw, dict):
        raise TaskHetError(f"{path}: expected a mapping of keys at the top level, got {type(raw).__name__}")
    config = _merge(copy.deepcopy(STUDY_SCHEMA), raw, prefix="", source=path)
    check_types(config, path, STUDY_TYPES)
    config["tasks"] = [config["task"]]  # what the shared Pipeline steps read
    validate_study_names(config, path)
    if config["federated"]["init_from"] == "head" and not config["model"]["freeze_encoder"]:
        raise TaskHetError(f"{path}: federated.init_from head needs model.freeze_encoder: true (step 2 then trains the "
                           "head on the frozen encoder's features, which the federated runs start from)")
    size = grid_size(config["grid"], len(config["seeds"]))
    if size is not None:  # a malformed grid is reported key by key by validate_grid
        check_run_count(size, path, "Σ over grid blocks of partitions × local_steps × algorithm variants × seeds")
    config["grid"] = validate_grid(config["grid"], path)
    budget = config["federated"]["rounds_x_local_steps"]
    for index, block in enumerate(config["grid"]):
        for position, local_steps in enumerate(block["local_steps"]):
            if budget % local_steps:
                raise TaskHetError(f"{path}: grid[{index}].local_steps[{position}] = {local_steps} does not divide "
                                   f"federated.rounds_x_local_steps {budget}: rounds × J could not stay constant")
    check_config(config, path)  # what steps 1-4 would refuse from their arguments, before step 0 (pipeline/checks.py)
    return config


def validate_study_names(config: dict[str, Any], source: Path) -> None:
    """Data source, task (a classification task of the family), encoder and schedule against the registries."""
    from models import list_encoders
    from models.tasks import get_task, list_tasks
    from network.lr_schedule import make_lr_schedule

    data = config["data"]
    if data["source"] not in DATA_SOURCES:
        raise TaskHetError(f"{source}: data.source {data['source']!r} is unknown; choose from: {', '.join(DATA_SOURCES)}")
    validate_split_csv(data, source)
    validate_source_keys(data, source)
    if config["task"] not in list_tasks() or get_task(config["task"]).kind != "classification":
        raise TaskHetError(f"{source}: task {config['task']!r} must be a registered classification task (the study "
                           "reports accuracy)")
    validate_family_tasks(config, source)
    if config["model"]["encoder"] not in list_encoders():
        raise TaskHetError(f"{source}: model.encoder {config['model']['encoder']!r} is unknown; choose from: "
                           f"{', '.join(list_encoders())}")
    try:
        make_lr_schedule(config["federated"]["lr_schedule"], 1.0, 1)
    except TaskHetError as error:
        raise TaskHetError(f"{source}: {str(error).replace('--lr_schedule', 'federated.lr_schedule')}") from None


def validate_grid(grid: Any, source: Path) -> list[dict[str, Any]]:
    """Each block's partitions (registered schemes and their parameters), J values and algorithm variants.

    Returns:
        The blocks as ``{"partitions": [Partition], "local_steps": [int], "variants": [Variant]}``.
    """
    from network.algorithms import list_algorithms
    from network.algorithms.base import get_settings_class
    from network.settings import build_settings
    from partitioning.partition import list_schemes, scheme_parameters

    if not isinstance(grid, list) or not grid:
        raise TaskHetError(f"{source}: grid must list at least one block {{partitions: [...], local_steps: [...], "
                           f"algorithms: {{fedavg: {{}}}}}}, got {grid!r}")
    blocks = []
    for index, block in enumerate(grid):
        key = f"grid[{index}]"
        if not isinstance(block, dict) or set(block) != set(BLOCK_KEYS):
            raise TaskHetError(f"{source}: {key} must be a mapping with exactly the keys {', '.join(BLOCK_KEYS)}, got {block!r}")
        partitions = ListOf(_partition_check(list_schemes(), scheme_parameters))(block["partitions"], f"{key}.partitions")
        local_steps = ListOf(Int(1))(block["local_steps"], f"{key}.local_steps")
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


def _partition_check(schemes: list[str], parameters):
    def check(value: Any, key: str) -> Partition:
        if not isinstance(value, dict) or "scheme" not in value:
            raise TaskHetError(f"{key} must be a mapping with a scheme, e.g. {{scheme: nc_shards, groups_per_client: 5}}, "
                               f"got {value!r}")
        scheme = value["scheme"]
        if scheme not in schemes:
            raise TaskHetError(f"{key}.scheme {scheme!r} is unknown; choose from: {', '.join(schemes)}")
        accepted = [name for name in parameters(scheme) if name not in ("seed", "size_skew", "min_client_size")]
        params = {name: item for name, item in value.items() if name != "scheme"}
        for name, item in params.items():
            if name not in accepted:
                raise TaskHetError(f"{key}.{name}: scheme {scheme} does not take it; it takes: {', '.join(accepted) or 'nothing'}")
            checked = Float(0, low_open=True) if name == "alpha" else Int(1)
            params[name] = checked(item, f"{key}.{name}")  # '0.1' and 0.1 are one partition, never two
        return Partition(scheme, tuple(sorted(params.items())))
    return check


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


def study_runs(config: dict[str, Any]) -> list[StudyRun]:
    """Every federated run of the grid in block order, each (partition, J, variant, seed) once."""
    runs = [StudyRun(partition, local_steps, variant, int(seed))
            for block in config["grid"]
            for partition, local_steps, variant, seed in itertools.product(block["partitions"], block["local_steps"],
                                                                            block["variants"], config["seeds"])]
    return list(dict.fromkeys(runs))


def rounds_for(config: dict[str, Any], local_steps: int) -> int:
    """Rounds of a run with J local steps: the budget rounds × J over J (a TaskHetError if J does not divide it)."""
    budget = config["federated"]["rounds_x_local_steps"]
    if budget % local_steps:
        raise TaskHetError(f"federated.rounds_x_local_steps {budget} is not a multiple of local_steps {local_steps}: "
                           "rounds × J could not stay constant")
    return budget // local_steps


class Study:
    """Runs one study (a config from :func:`load_study`) into ``out_dir``, reusing the main job's steps."""

    def __init__(self, config: dict[str, Any], out_dir: Path, command: str, jobs: int = 1,
                 threads: int | None = None) -> None:
        from pipeline.runner import Pipeline

        self.config, self.out_dir, self.command = config, Path(out_dir), command
        # jobs > 1: the grid's federated runs go through the main job's worker pool (Pipeline.run_federated)
        self.pipeline = Pipeline(config, self.out_dir, command, jobs=jobs, threads=threads)

    def run(self):
        """Step 1, step 2 per seed, step 3b per partition and seed, step 4 per run, then the report; returns its table."""
        import importlib

        self.pipeline.check_inputs()  # every input file the study names, before step 0
        runs = study_runs(self.config)
        seeds = [int(seed) for seed in self.config["seeds"]]
        partitions = list(dict.fromkeys((run.partition, run.seed) for run in runs))
        total = (self.config["data"]["source"] == "synthetic") + 1 + len(seeds) + len(partitions) + len(runs)
        with tqdm(total=total, desc="study", unit="step", file=sys.stdout) as self.pipeline.progress:
            root = self.pipeline.data_root()
            manifest = self.pipeline.manifest(root)
            centralized = {seed: self.pipeline.centralized(self.config["task"], root, manifest, seed) for seed in seeds}
            starts = {seed: self.start_model(seed, centralized[seed]) for seed in seeds}
            clients = {seed: self.client_manifest(seed, manifest) for seed in seeds}
            assignments = {key: self.assignments(*key, clients[key[1]]) for key in partitions}
            stages = {run: self.federated(run, root, manifest, assignments[(run.partition, run.seed)],
                                          starts[run.seed]) for run in runs}
            self.pipeline.run_federated(list(stages.values()))  # one by one, or --jobs at a time
            run_dirs = {run: stage.stage_dir for run, stage in stages.items()}
        report = importlib.import_module(STUDY_REPORTS[self.config["study"]])
        return report.write_report(self.config, self.out_dir, run_dirs, centralized, self.command)

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

    def assignments(self, partition: Partition, seed: int, manifest: Path) -> Path:
        from pipeline.runner import flags
        from steps import assign as step3b

        federated = self.config["federated"]
        params = {"manifest": str(manifest), "scheme": partition.scheme, **dict(partition.params),
                  "n_clients": federated["n_clients"], "client_test_fraction": federated["client_test_fraction"],
                  "seed": seed}
        stage_dir = (self.out_dir / "assignments"
                     / f"{partition.label}-s{seed}-{stage_key(params, [manifest], self.out_dir)}")
        return self.pipeline.step(f"step 3b: {partition.label} seed {seed}", stage_dir, params, step3b,
                                  ["--out", str(stage_dir), *flags(params)])

    def federated(self, run: StudyRun, root: Path, manifest: Path, assignments: Path, model_dir: Path):
        """Step 4's stage of one run (a ``pipeline.runner.FederatedStage``, run by ``Pipeline.run_federated``)."""
        from pipeline.runner import FederatedStage, flags

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
        inputs = [manifest, assignments / "assignments.csv"]
        stage_dir = (self.out_dir / "federated" / run.partition.label / f"J{run.local_steps}" / run.variant.label
                     / f"s{run.seed}-{stage_key(params, inputs, self.out_dir)}")
        label = f"step 4: {run.partition.label} · J={run.local_steps} · {run.variant.label} · seed {run.seed}"
        return FederatedStage(label, stage_dir, params, ["--out", str(stage_dir), "--resume", *flags(params)])


def unfrozen_copy(checkpoint: Path, out: Path) -> None:
    """Write step 2's checkpoint with ``freeze_encoder`` off in its model config (the weights unchanged)."""
    from utils.loaders import load_checkpoint
    from utils.run_dir import atomic_torch_save

    loaded = load_checkpoint(checkpoint, "step-2 best.pt", keys=("model", "model_config"), finished=True)
    # atomic and content-only bytes: the federated runs' stage keys hash this file
    atomic_torch_save({"model": loaded["model"], "model_config": {**loaded["model_config"], "freeze_encoder": False}}, out)
