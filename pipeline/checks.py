"""Checks of an experiment or study file that the steps would otherwise make only when they run.

The README promises that an experiment file is checked before step 0. The steps check their own
flags (they also run by hand), but in a pipeline run step 2 starts only after step 1, and step 4
after steps 1–3c: a mistake they find then has already cost that work and left step folders behind.
So every check a step makes from its arguments alone is made here first, on the YAML keys
(issue 19 item 12, issue 24):

* :func:`check_config` (from ``load_experiment`` / ``load_study``, no file is read): the encoder's
  weight name (step 2), ``centralized.warmup_epochs`` below ``n_epochs`` (step 2), frozen-encoder
  feature caching (step 2), the digits subsample size (step 1), each partition's scheme parameters,
  the family's natural owners and a study's groups per client against the labels the data source
  can have (step 3b), each algorithm against the number of clients (IFCA:
  k ≤ clients, step 4), sparse_ft's server masks against the calibration split (step 4, round 0),
  and partition labels that two α values would share in folder names and the report.
* :func:`check_input_files` (from the runner, before step 0): every file the experiment names but no
  step makes — Taskonomy's data root and split CSV, CIFAR's batch files, a ``model.weights`` path.

What needs the data stays with the steps, which name it: a partition that the samples cannot meet
(too few samples for the clients, more groups per client than the data has), KMeans with more
clusters than samples. They can only be known once step 1 has written the manifest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from utils.errors import TaskHetError

IID_REFERENCE_SCHEME = "iid"


def check_config(config: dict[str, Any], source: Path) -> None:
    """Every check of a merged, type-checked experiment or study file that needs no file (see the module doc)."""
    study = "study" in config
    n_clients = config["federated"]["n_clients"] if study else config["partition"]["n_clients"]
    _check_weights_name(config, source)
    _check_centralized(config, source)
    _check_digits_size(config, source)
    _check_partitions(config, source, n_clients, study)
    _check_algorithms(config, source, n_clients, study)
    if not study:
        _check_alpha_labels(config, source)


def check_input_files(config: dict[str, Any]) -> None:
    """Every input file the experiment names but no step makes exists; errors name the key."""
    from pipeline.experiment import split_csv_path

    data = config["data"]
    if data["source"] == "taskonomy":
        if not Path(data["root"]).is_dir():
            raise TaskHetError(f"data.root {data['root']} does not exist (download Taskonomy first: download_taskonomy.py)")
        if not split_csv_path(data).is_file():
            raise TaskHetError(f"data.split_csv: {split_csv_path(data)} does not exist (download_taskonomy.py writes "
                               "train_val_test_<subset>.csv into data.root)")
    if data["source"] in ("cifar10", "cifar100"):
        from datasets.cifar import FETCH_COMMAND, expected_files

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
    from models.encoders import ENCODERS, NAMED_WEIGHTS

    return weights != "none" and weights not in NAMED_WEIGHTS and weights not in ENCODERS.get(encoder)().pretrained


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


def _partitions(config: dict[str, Any], study: bool) -> list[tuple[str, str, dict[str, Any]]]:
    """(YAML key, scheme, parameters) of every partition step 3b will be asked for."""
    if study:
        return [(f"grid[{index}].partitions", partition.scheme, dict(partition.params))
                for index, block in enumerate(config["grid"]) for partition in block["partitions"]]
    partition = config["partition"]
    found = [("partition", partition["scheme"], {"alpha": alpha, "size_skew": partition["size_skew"]})
             for alpha in partition["alphas"]]
    if partition["iid_reference"]:
        found.append(("partition.iid_reference", IID_REFERENCE_SCHEME, {"size_skew": partition["size_skew"]}))
    return found


def _check_partitions(config: dict[str, Any], source: Path, n_clients: int, study: bool) -> None:
    """Each scheme with its parameters as step 3b builds it (parameters it does not take are left out, as step 3b
    leaves them), and the natural scheme only for a family with natural owners."""
    from datasets.family import get_family
    from pipeline.experiment import DATA_SOURCES
    from partitioning.partition import get_partitioner, scheme_parameters

    family = get_family(DATA_SOURCES[config["data"]["source"]])
    for key, scheme, params in _partitions(config, study):
        if scheme == "natural" and family.source_column is None:
            raise TaskHetError(f"{source}: {key}: scheme natural needs each sample's natural owner, which data family "
                               f"{family.name} (data.source {config['data']['source']}) does not have")
        most = most_label_groups(config)
        per_client = params.get("groups_per_client")
        if study and per_client is not None and most is not None and per_client > most:
            raise TaskHetError(f"{source}: {key}: {scheme} groups_per_client {per_client} exceeds the {most} labels "
                               f"data.source {config['data']['source']} can have (step 3b refuses it)")
        accepted = scheme_parameters(scheme)
        given = {name: value for name, value in params.items() if value is not None and name in accepted}
        try:
            get_partitioner(scheme, n_clients, **given).check_parameters()
        except TaskHetError as error:
            raise TaskHetError(f"{source}: {key}: {error}") from None


def most_label_groups(config: dict[str, Any]) -> int | None:
    """The most distinct labels the manifest of this data source can have (a study partitions by label): digits'
    and CIFAR's class counts, Taskonomy's top_k_classes."""
    source = config["data"]["source"]
    if source == "digits":
        from datasets.digits import NUM_CLASSES

        return NUM_CLASSES
    if source in ("cifar10", "cifar100"):
        from datasets.cifar import DATASET_CLASSES

        return DATASET_CLASSES[source].num_classes
    return config["data"]["top_k_classes"]


def _variants(config: dict[str, Any], study: bool) -> list[tuple[str, str, dict[str, Any]]]:
    """(YAML key, algorithm, settings) of every algorithm configuration step 4 will run."""
    if study:
        return [(f"grid[{index}].algorithms.{variant.algorithm}", variant.algorithm, dict(variant.settings))
                for index, block in enumerate(config["grid"]) for variant in block["variants"]]
    return [(f"federated.algorithms.{name}", name, settings or {})
            for name, settings in config["federated"]["algorithms"].items()]


def _check_algorithms(config: dict[str, Any], source: Path, n_clients: int, study: bool) -> None:
    """What step 4 refuses from the settings and the run: more IFCA clusters than clients, and sparse_ft server
    masks without the held-out calibration split they are calibrated on."""
    from network.algorithms.base import ALGORITHMS
    from network.settings import build_settings

    calibration = config["federated"].get("calibration_fraction", 0.0)
    clients_key = "federated.n_clients" if study else "partition.n_clients"
    for key, name, values in _variants(config, study):
        algorithm = ALGORITHMS.get(name)
        settings = build_settings(algorithm.Settings, values, name)
        try:
            algorithm.check_num_clients(settings, n_clients)
        except TaskHetError as error:
            raise TaskHetError(f"{source}: {key}: {error} ({clients_key})") from None
        if getattr(settings, "mask_source", None) == "server" and not calibration:
            where = ("set federated.calibration_fraction (train rows held out for the server)" if study else
                     "an experiment file has no calibration split: use a study file with federated.calibration_fraction")
            raise TaskHetError(f"{source}: {key}: mask_source server calibrates on held-out train rows; {where}")


def _check_alpha_labels(config: dict[str, Any], source: Path) -> None:
    """Two α that print alike (``a{α:g}``) would share folder names and report rows: refuse them."""
    seen: dict[str, float] = {}
    for alpha in config["partition"]["alphas"]:
        label = f"{float(alpha):g}"
        if label in seen:
            raise TaskHetError(f"{source}: partition.alphas {seen[label]!r} and {alpha!r} both print as α={label} (folder "
                               f"a{label}, the report's rows); give values that differ in 6 significant digits")
        seen[label] = alpha
