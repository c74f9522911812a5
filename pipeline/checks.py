"""Checks of an experiment or study file that the steps would otherwise make only when they run.

The README promises that an experiment file is checked before step 0. The steps check their own
flags (they also run by hand), but in a pipeline run step 2 starts only after step 1, and step 4
after steps 1–3c: a mistake they find then has already cost that work and left step folders behind.
So every check a step makes from its arguments alone is made here first, on the YAML keys, by the study
kind's ``load`` (pipeline/studies/), before step 0 and without reading any file but the experiment file:

* :func:`check_model_and_data`: the encoder's weight name (step 2), ``centralized.warmup_epochs`` below
  ``n_epochs`` (step 2), frozen-encoder feature caching (step 2), the digits subsample size (step 1).
* :func:`check_partitions`: each partition's scheme parameters, the family's natural owners and groups per
  client against the labels the data source can have (step 3b).
* :func:`check_algorithm_settings` and :func:`check_algorithms`: each algorithm's settings, and each
  algorithm against the number of clients (IFCA: k ≤ clients) and sparse_ft's server masks against the
  calibration split (step 4).
* :func:`check_input_files` (from the runner, before step 0): every file the experiment names but no
  step makes — Taskonomy's data root and split CSV, CIFAR's batch files, a ``model.weights`` path.

What needs the data stays with the steps, which name it: a partition that the samples cannot meet
(too few samples for the clients, more groups per client than the data has), KMeans with more
clusters than samples. They can only be known once step 1 has written the manifest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pipeline.sections import DATA_SOURCES, most_label_groups, split_csv_path
from utils.errors import TaskHetError


@dataclass(frozen=True)
class Entry:
    """One partition or algorithm configuration a step will be asked for, and where the file sets it.

    Attributes:
        key: the YAML key of the entry (``partition``, ``grid[0].partitions[2]``, ``federated.algorithms.fedprox``).
        name: its scheme or algorithm.
        params: its parameters, as the step takes them.
        origins: parameter -> the YAML key that sets it, so that a step's ``--flag`` in a message names the key
            (a parameter not listed is ``<key>.<parameter>``).
    """

    key: str
    name: str
    params: dict[str, Any]
    origins: dict[str, str] = field(default_factory=dict)

    def readdress(self, message: str) -> str:
        """``message`` with every ``--parameter`` of this entry replaced by the YAML key that sets it (and without
        a parser's ``(see script --help)``: the file, not a command line, is what the user edits)."""
        message = re.sub(r" \(see \S+ --help\)$", "", message)
        for parameter in sorted(self.params, key=len, reverse=True):  # --size_skew before --size
            message = message.replace(f"--{parameter}", self.origins.get(parameter, f"{self.key}.{parameter}"))
        return re.sub(r"^argument ", "", message)  # argparse's "argument --x: ..."

    def error(self, message: str, source: Path) -> TaskHetError:
        """One line: the file, this entry's key (unless the re-addressed message starts with a key of it) and
        ``message`` re-addressed."""
        text = self.readdress(message)
        return TaskHetError(f"{source}: {text}" if text.startswith(self.key) else f"{source}: {self.key}: {text}")


def check_model_and_data(config: dict[str, Any], source: Path) -> None:
    """What steps 1 and 2 would refuse from the shared sections: the encoder's weight name, the warmup against the
    epochs, feature caching without a frozen encoder, digits' subsample size."""
    _check_weights_name(config, source)
    _check_centralized(config, source)
    _check_digits_size(config, source)


def check_input_files(config: dict[str, Any]) -> None:
    """Every input file the experiment names but no step makes exists; errors name the key."""
    data = config["data"]
    if data["source"] == "taskonomy":
        if not Path(data["root"]).is_dir():
            raise TaskHetError(f"data.root {data['root']} does not exist (download Taskonomy first: download_taskonomy.py)")
        if not split_csv_path(data).is_file():
            raise TaskHetError(f"data.split_csv: {split_csv_path(data)} does not exist (download_taskonomy.py writes "
                               "train_val_test_<subset>.csv into data.root)")
    if data["source"] in ("cifar10", "cifar100"):
        from datasets.cifar_files import FETCH_COMMAND, expected_files

        missing = [path for path in expected_files(Path(data["root"]), data["source"]) if not path.is_file()]
        if missing:
            raise TaskHetError(f"data.root {data['root']}: {data['source']} files missing: "
                               f"{', '.join(str(path) for path in missing)}; fetch them with "
                               f"{FETCH_COMMAND.format(dataset=data['source'])}")
    weights = config["model"]["weights"]
    if _is_path(weights, config["model"]["encoder"]) and not Path(weights).is_file():
        raise TaskHetError(f"model.weights: {weights} is not a file (a weights file for encoder "
                           f"{config['model']['encoder']}, relative to the folder run_pipeline.py runs in)")


def _is_path(weights: str, encoder: str) -> bool:
    from models.encoders import NAMED_WEIGHTS, encoder_outline

    return weights != "none" and weights not in NAMED_WEIGHTS and weights not in encoder_outline(encoder).pretrained


def _check_weights_name(config: dict[str, Any], source: Path) -> None:
    """model.weights: a name the encoder offers (a path is checked by :func:`check_input_files`)."""
    from models.encoders import check_weights

    model = config["model"]
    if _is_path(model["weights"], model["encoder"]):
        return
    try:
        check_weights(model["encoder"], model["weights"])
    except TaskHetError as error:
        raise TaskHetError(f"{source}: {str(error).replace('--weights', 'model.weights')}") from None


def _check_centralized(config: dict[str, Any], source: Path) -> None:
    centralized, model = config["centralized"], config["model"]
    if centralized["warmup_epochs"] >= centralized["n_epochs"]:
        raise TaskHetError(f"{source}: centralized.warmup_epochs {centralized['warmup_epochs']} must be below "
                           f"centralized.n_epochs {centralized['n_epochs']} (step 2 refuses it)")
    if model["cache_features"] and not model["freeze_encoder"]:
        raise TaskHetError(f"{source}: model.cache_features needs model.freeze_encoder: true (a trained encoder's maps "
                           "change every step)")


def _check_digits_size(config: dict[str, Any], source: Path) -> None:
    from datasets.digits import NUM_CLASSES, load_arrays

    data = config["data"]
    if data["source"] != "digits" or data["n_samples"] is None:
        return
    available = len(load_arrays()[1])
    if not NUM_CLASSES * 2 <= data["n_samples"] <= available:
        raise TaskHetError(f"{source}: data.n_samples must be between {NUM_CLASSES * 2} and {available} (scikit-learn's "
                           f"digits), got {data['n_samples']}")


def check_partitions(config: dict[str, Any], source: Path, entries: list[Entry], n_clients: int) -> None:
    """Each partition :class:`Entry` as step 3b builds it (parameters the scheme does not take are left out, as
    step 3b leaves them); the natural scheme only for a family with natural owners; groups per client no more
    than the labels the source can have. Errors name the YAML key."""
    from datasets.family import get_family
    from partitioning.partition import get_partitioner, scheme_parameters

    family = get_family(DATA_SOURCES[config["data"]["source"]])
    most = most_label_groups(config)
    for entry in entries:
        key, scheme, params = entry.key, entry.name, entry.params
        if scheme == "natural" and family.source_column is None:
            raise TaskHetError(f"{source}: {key}: scheme natural needs each sample's natural owner, which data family "
                               f"{family.name} (data.source {config['data']['source']}) does not have")
        per_client = params.get("groups_per_client")
        if per_client is not None and most is not None and per_client > most:
            raise TaskHetError(f"{source}: {key}: {scheme} groups_per_client {per_client} exceeds the {most} labels "
                               f"data.source {config['data']['source']} can have (step 3b refuses it)")
        accepted = scheme_parameters(scheme)
        given = {name: value for name, value in params.items() if value is not None and name in accepted}
        try:
            get_partitioner(scheme, n_clients, **given).check_parameters()
        except TaskHetError as error:
            raise entry.error(str(error), source) from None


def check_algorithm_settings(algorithms: dict[str, Any], source: Path, prefix: str) -> None:
    """Each algorithm's settings against its own ``Settings`` (types, ranges, no foreign keys); ``prefix``: the
    YAML key of the mapping (``federated.algorithms``)."""
    from network.algorithms.base import get_settings_class
    from network.settings import build_settings

    for name, settings in algorithms.items():
        if settings is not None and not isinstance(settings, dict):
            raise TaskHetError(f"{source}: {prefix}.{name} must be a mapping of its settings")
        try:
            build_settings(get_settings_class(name), settings or {}, name)
        except TaskHetError as error:
            raise TaskHetError(f"{source}: {prefix}.{name}: {error}") from None


def check_algorithms(config: dict[str, Any], source: Path, entries: list[Entry], n_clients: int, clients_key: str,
                     calibration_hint: str) -> None:
    """What step 4 refuses from each algorithm :class:`Entry` (its settings) and the run: more IFCA clusters than
    clients, and sparse_ft server masks without the held-out calibration split they are calibrated on
    (``calibration_hint`` says where the kind sets one)."""
    from network.algorithms.base import ALGORITHMS
    from network.settings import build_settings

    calibration = config["federated"].get("calibration_fraction", 0.0)
    for entry in entries:
        key, name, values = entry.key, entry.name, entry.params
        algorithm = ALGORITHMS.get(name)
        settings = build_settings(algorithm.Settings, values, name)
        try:
            algorithm.check_num_clients(settings, n_clients)
        except TaskHetError as error:
            raise TaskHetError(f"{source}: {key}: {error} ({clients_key})") from None
        if getattr(settings, "mask_source", None) == "server" and not calibration:
            raise TaskHetError(f"{source}: {key}: mask_source server calibrates on held-out train rows; {calibration_hint}")


def check_stage(entry: Entry, check: Callable[[list[str]], Any], params: dict[str, Any], source: Path) -> Any:
    """Run a step's own argument checks (``check``: ``steps.federated.check_arguments``) on the parameters a stage
    will pass it, before step 0; a failure is one line naming ``entry``'s YAML key, with every ``--flag``
    re-addressed to the key that sets it. Returns what ``check`` returns (the parsed arguments)."""
    from pipeline.argv import flags

    try:  # the folder a runner passes is made by the runner; the checks read and write nothing
        return check([*flags(params), "--out", "out"])
    except TaskHetError as error:
        raise entry.error(str(error), source) from None


def check_partition_stage(config: dict[str, Any], entry: Entry, params: dict[str, Any], source: Path) -> None:
    """Step 3b's own argument checks on the parameters of one partition (scheme, temporal schedule, skews), then
    its skews against what the data source can hold (its classes and tasks: a label pair or a target variant the
    family lacks), before step 0; errors name the YAML key."""
    from datasets.family import get_family
    from partitioning.skews import SkewContext, get_skew
    from steps import assign as step3b
    from steps.skew_flags import skew_settings

    args = check_stage(entry, step3b.check_arguments, params, source)
    family = get_family(DATA_SOURCES[config["data"]["source"]])
    context = SkewContext(family.name, most_label_groups(config), tuple(family.tasks), args.n_clients)
    try:
        for name, given in skew_settings(args).items():
            get_skew(name).check_settings(given, context)
    except TaskHetError as error:
        raise entry.error(str(error), source) from None


def check_schedule_fits(entry: Entry, temporal: str | None, schedule_rounds: int | None, run_rounds: int,
                        rounds_key: str, source: Path) -> None:
    """A temporal schedule (step 3b's ``--temporal`` over ``schedule_rounds``) must fit a run of ``run_rounds``: no
    phase starts after its last round, no window ends after it, and every round up to it is in some window (what
    step 4 refuses once it reads the schedule). ``rounds_key`` names the key that sets the run's rounds."""
    from partitioning.temporal import NO_END, parse_temporal, phase_windows

    spec = parse_temporal(temporal)
    if spec is None:
        return
    windows = [window for phase in phase_windows(spec, schedule_rounds) for window in phase]
    starts = [start for start, _ in windows]
    ends = [end for _, end in windows]
    covered = NO_END in ends or max(ends) >= run_rounds
    if max(starts) > run_rounds or any(end != NO_END and end > run_rounds for end in ends) or not covered:
        last = "to its end" if NO_END in ends else f"to round {max(ends)}"
        raise TaskHetError(f"{source}: {entry.key}: temporal schedule {temporal!r} runs from round 1 {last} "
                           f"(phases start at rounds {', '.join(map(str, sorted(set(starts))))}), but {rounds_key} "
                           f"gives the federated runs {run_rounds} rounds; make the schedule cover exactly those rounds")
