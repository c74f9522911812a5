"""The sections every experiment or study file shares (``data``, ``model``, ``centralized``), their defaults and
the checks that read them, and the merge of a file with its kind's schema.

Every study kind (pipeline/studies/) builds its schema from these sections and its own keys, so a key means
the same in every kind and is checked by the same code.
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import MappingProxyType
from typing import Any

from utils.errors import TaskHetError

# data.source -> the data family that reads it (synthetic buildings are written in the Taskonomy layout).
DATA_SOURCES = {"synthetic": "taskonomy", "taskonomy": "taskonomy", "digits": "digits", "cifar10": "cifar", "cifar100": "cifar",
                "imagefolder": "imagefolder", "paired_folders": "paired_folders"}
# A user's own folder (datasets/imagefolder.py, datasets/paired_folders.py): an optional data.split_csv, no fixed classes.
FOLDER_SOURCES = ("imagefolder", "paired_folders")
# Keys of the data section that only some sources read (a key set for another source is an error).
SOURCE_KEYS = {"imbalance_factor": ("cifar10", "cifar100", "digits"), "verify_checksums": ("cifar10", "cifar100")}

DATA_SECTION: dict[str, Any] = {
    "source": "synthetic",  # synthetic | taskonomy | digits | cifar10 | cifar100 | imagefolder | paired_folders
    "root": "data/synthetic",  # ignored by digits (scikit-learn ships the images); cifar: torchvision's folders' parent;
    # imagefolder, paired_folders: your folder (docs/DATA.md, "Your own images")
    "synthetic": {"n_buildings": 24, "n_views": 50, "image_size": 64, "seed": 0},
    "split_csv": None,  # taskonomy: required, the split CSV (id,train,val,test); imagefolder (path,split) and
    # paired_folders (stem,split): optional, else a seeded split; relative to root unless absolute
    "buildings": None,  # taskonomy only: list of buildings to include (None: all on disk)
    "top_k_classes": 16,  # taskonomy/synthetic only
    "test_fraction": 0.2,  # share of buildings (taskonomy/synthetic) or samples in the test split (cifar: fixed)
    "split_by": "building",  # taskonomy/synthetic only: building | csv (the split CSV's own columns) | sample
    "n_samples": None,  # digits only: samples kept, stratified by digit (None: all 1,797)
    "imbalance_factor": None,  # cifar and digits: n_min / n_max of the long-tailed training set (None: 1.0, balanced)
    "val_fraction": None,  # share of the training buildings (or samples) kept for validation (None: step 1's 0.1)
    "verify_checksums": None,  # cifar only: torchvision's md5 check (None: on; off only for hand-made files)
}
# cache_features: with freeze_encoder, the encoder's maps are computed once per sample (steps 2, 3c, 4)
# decoder_width: channels of the dense decoder (None: the encoder's default)
MODEL_SECTION: dict[str, Any] = {"encoder": "resnet50", "weights": "none", "image_size": 64, "embedding_grid": 0,
                                 "freeze_encoder": False, "cache_features": False, "decoder_width": None}
CENTRALIZED_SECTION: dict[str, Any] = {
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
}
SHARED_SECTIONS = ("name", "data", "model", "centralized", "seeds", "use_accelerator")

# What each shared key does, one line per dotted key: the experiment-file reference page prints it beside the key's
# default and type (docsgen/experiment_keys.py), and a test requires one for every key of every kind.
SHARED_HELP = MappingProxyType({
    "name": "the experiment's folder under --results (results/<name>/), with every step's outputs and the report",
    "data.source": "where the images come from: synthetic (rendered buildings), taskonomy, digits, cifar10, cifar100, "
                   "or your own folder: imagefolder, paired_folders",
    "data.root": "the data folder: synthetic renders into it; taskonomy and your own folders are read from it; cifar: "
                 "the parent of torchvision's folders; digits ignores it",
    "data.synthetic.n_buildings": "synthetic only: buildings (rooms) rendered",
    "data.synthetic.n_views": "synthetic only: views rendered per building",
    "data.synthetic.image_size": "synthetic only: side of the rendered square images, in pixels",
    "data.synthetic.seed": "synthetic only: the renderer's root seed (the same seed renders the same files)",
    "data.buildings": "taskonomy only: the buildings to include (null: every building on disk)",
    "data.top_k_classes": "taskonomy and synthetic only: keep the K most frequent scene classes",
    "data.test_fraction": "share of the buildings (taskonomy, synthetic) or samples in the test split (cifar's test "
                          "set is fixed)",
    "data.split_by": "taskonomy and synthetic only: building (whole buildings per split), csv (the split CSV's own "
                     "columns) or sample (views one by one)",
    "data.n_samples": "digits only: samples kept, stratified by digit (null: all 1,797)",
    "data.split_csv": "the split CSV, relative to data.root unless absolute: taskonomy needs it (id,train,val,test); "
                      "imagefolder and paired_folders may give one (else a seeded split)",
    "data.imbalance_factor": "cifar and digits only: n_min / n_max of a long-tailed training set (null: balanced)",
    "data.val_fraction": "share of the training buildings or samples kept for validation, on which step 2 picks its "
                         "best epoch (null: 0.1)",
    "data.verify_checksums": "cifar only: torchvision's md5 check of the dataset files (null: on)",
    "model.encoder": "the encoder every model is built on (a registered encoder)",
    "model.weights": "the encoder's starting weights: none, imagenet, clip, dino (those the encoder offers) or a file",
    "model.image_size": "side length the images are resized to before the encoder",
    "model.embedding_grid": "step 2's embedding of a sample: the global average of the encoder's map plus the cell "
                            "averages of this grid (0: the global average only)",
    "model.freeze_encoder": "keep the encoder fixed: only the decoder and head train, centralized and federated",
    "model.cache_features": "with model.freeze_encoder: compute the encoder's maps once per sample and train on them "
                            "(steps 2, 3c and 4)",
    "model.decoder_width": "channels of a dense task's decoder (null: the encoder's default)",
    "centralized.n_epochs": "step 2 (the centralized model): training epochs",
    "centralized.batch_size": "step 2: batch size",
    "centralized.init_lr": "step 2: initial learning rate",
    "centralized.optimizer": "step 2: the optimizer",
    "centralized.scheduler": "step 2: the per-epoch learning-rate schedule after the warmup: cosine, exponential "
                             "(centralized.lr_decay_rate), step (centralized.step_size, centralized.gamma) or none",
    "centralized.warmup_epochs": "step 2: epochs of linear learning-rate warmup",
    "centralized.step_size": "step 2, scheduler step: epochs between decays",
    "centralized.gamma": "step 2, scheduler step: factor per decay",
    "centralized.momentum": "step 2, optimizer sgd: momentum",
    "centralized.lr_decay_rate": "step 2, scheduler exponential: factor per epoch",
    "centralized.weight_decay": "step 2: weight decay",
    "centralized.early_stopping_patience": "step 2: stop after this many epochs without a lower validation loss (0: "
                                           "never)",
    "seeds": "every partition and federated run is repeated once per seed; the data split uses the first",
    "use_accelerator": "use CUDA or MPS where present (false: the CPU only)",
})
# Federated keys the main job and the grid studies read alike (each kind's help adds them).
LOCAL_TRAINING_HELP = MappingProxyType({
    "federated.batch_size": "step 4: local batch size",
    "federated.init_lr": "step 4: local learning rate of round 1",
    "federated.lr_schedule": "step 4: the local learning rate per round: constant, cosine, exponential:RATE or "
                             "step:EVERY:GAMMA",
    "federated.momentum": "step 4: local SGD momentum (a fresh buffer each round)",
    "federated.weight_decay": "step 4: local SGD weight decay",
    "federated.client_fraction": "step 4: share of the clients sampled each round",
})

# The most federated runs one experiment or study file may ask for. The grid is counted from its list lengths
# before anything expands it, so a typo such as five 60-value lists (7.8e8 runs) is one error line, not a
# MemoryError; 10,000 is 12 times paper.yaml's 840 runs, and at ~2 s per tiny digits run already 5.5 hours.
MAX_RUNS = 10_000


def shared_sections() -> dict[str, Any]:
    """A fresh copy of the shared sections' defaults (a kind adds its own keys to it)."""
    return copy.deepcopy({"data": DATA_SECTION, "model": MODEL_SECTION, "centralized": CENTRALIZED_SECTION})


def merge_keys(defaults: dict[str, Any], given: dict[str, Any], source: Path, free_form: frozenset[str] = frozenset(),
               prefix: str = "") -> dict[str, Any]:
    """``given`` merged into ``defaults`` (a deep copy is the caller's), key by key: an unknown key is an error
    naming it and listing the keys allowed there; ``free_form`` names the dotted keys whose mappings are taken
    whole (algorithm name -> settings)."""
    if not isinstance(given, dict):
        raise TaskHetError(f"{source}: expected a mapping of keys at the top level, got {type(given).__name__}")
    for key, value in given.items():
        dotted = f"{prefix}{key}"
        if key not in defaults:
            allowed = ", ".join(sorted(defaults))
            raise TaskHetError(f"{source}: unknown key {dotted!r}; allowed here: {allowed}")
        if isinstance(defaults[key], dict) and dotted not in free_form:
            if not isinstance(value, dict):
                raise TaskHetError(f"{source}: key {dotted!r} must be a mapping")
            defaults[key] = merge_keys(defaults[key], value, source, free_form, prefix=f"{dotted}.")
        else:
            defaults[key] = value
    return defaults


def check_run_count(count: int, source: Path, product: str) -> None:
    """Refuse a grid of more than :data:`MAX_RUNS` federated runs, printing the count."""
    if count > MAX_RUNS:
        raise TaskHetError(f"{source}: the grid asks for {count:,} federated runs ({product}), above the limit of "
                           f"{MAX_RUNS:,} runs per file (pipeline/sections.py MAX_RUNS); split it into several files")


def validate_data(config: dict[str, Any], source: Path) -> None:
    """data.source is known, its split CSV named where needed, no key another source reads, every task one the
    source's family can feed."""
    data = config["data"]
    if data["source"] not in DATA_SOURCES:
        raise TaskHetError(f"{source}: data.source {data['source']!r} is unknown; choose from: {', '.join(DATA_SOURCES)}")
    validate_split_csv(data, source)
    validate_source_keys(data, source)
    validate_family_tasks(config, source)


def validate_split_csv(data: dict[str, Any], source: Path) -> None:
    """Real Taskonomy needs its split CSV named (the renderer writes its own; digits has none)."""
    split_csv = data["split_csv"]
    if data["source"] == "taskonomy":
        if not isinstance(split_csv, str) or not split_csv.strip():
            raise TaskHetError(f"{source}: data.split_csv is required for data.source taskonomy: the split CSV "
                               "(id,train,val,test) download_taskonomy.py wrote, e.g. train_val_test_tiny.csv, "
                               "relative to data.root unless absolute")
    elif split_csv is not None and data["source"] not in FOLDER_SOURCES:
        raise TaskHetError(f"{source}: data.split_csv is only for data.source taskonomy, {' and '.join(FOLDER_SOURCES)} "
                           f"(data.source is {data['source']!r})")
    elif split_csv is not None and (not isinstance(split_csv, str) or not split_csv.strip()):
        raise TaskHetError(f"{source}: data.split_csv must be a path (relative to data.root unless absolute) or null")


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


def validate_encoder(config: dict[str, Any], source: Path) -> None:
    """model.encoder is a registered encoder."""
    from models import list_encoders

    if config["model"]["encoder"] not in list_encoders():
        raise TaskHetError(f"{source}: model.encoder {config['model']['encoder']!r} is unknown; choose from: "
                           f"{', '.join(list_encoders())}")


def validate_lr_schedule(value: str, key: str, source: Path) -> None:
    """A local learning-rate schedule as step 4's ``--lr_schedule`` parses it, its message naming the YAML key."""
    from network.lr_schedule import make_lr_schedule

    try:
        make_lr_schedule(value, 1.0, 1)
    except TaskHetError as error:
        raise TaskHetError(f"{source}: {str(error).replace('--lr_schedule', key)}") from None


def most_label_groups(config: dict[str, Any]) -> int | None:
    """The most distinct labels the manifest of this data source can have: digits' and CIFAR's class counts,
    Taskonomy's top_k_classes; None for a user's folder (its classes are known once step 1 has read it)."""
    data_source = config["data"]["source"]
    if data_source in FOLDER_SOURCES:
        return None
    if data_source == "digits":
        from datasets.digits import NUM_CLASSES

        return NUM_CLASSES
    if data_source in ("cifar10", "cifar100"):
        from datasets.cifar_files import DATASET_CLASSES

        return DATASET_CLASSES[data_source].num_classes
    return config["data"]["top_k_classes"]
