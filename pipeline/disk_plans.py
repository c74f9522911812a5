"""The parts of a grid's disk plan (pipeline/disk_projection.py) every study kind shares: the model of a stage, the
sample count, step 2's models, step 4's runs and the caches, each sized by pipeline/disk_sizes.py."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from pipeline.disk_projection import Bytes, PlannedCache, PlannedStage
from pipeline.disk_probe import run_bytes
from pipeline.disk_sizes import (ModelSpec, RunBytes, centralized_bytes, decoded_bytes_per_sample, embedding_width,
                                 feature_bytes_per_sample)
from pipeline.runner import centralized_params
from utils.stages import is_done

MIB = 2**20
# The small files of a stage beside its tensors (config.json, run.log, metrics.csv, clients.csv, the pictures): the
# tiny test experiment's step-4 folders hold 13 kB of them; a paper.yaml run's metrics.csv (21 evaluations of 25
# clients, ~10 metrics a row) about 0.3 MB; its curves.png about 0.1 MB.
STAGE_FILES = 1 * MIB
# A row of a per-sample CSV (assignments.csv, clusters.csv, sample_ids.csv): a sample id (Taskonomy's are about 30
# characters), a client, a group, a split. The tiny experiment's rows are 24 bytes.
CSV_ROW_BYTES = 64
# Classes of a classification head where the file does not fix them before step 1 (a folder family's labels): the
# head is 2,048 × K floats on ResNet-50, 0.8 MB at K = 100.
DEFAULT_CLASSES = 100
CLASSES = {"digits": 10, "cifar10": 10, "cifar100": 100}
FIXED_SAMPLES = {"digits": 1797, "cifar10": 60_000, "cifar100": 60_000}
TASKONOMY_CACHE = ("synthetic", "taskonomy")  # the sources whose samples go through the decoded-sample cache
NO_DECODED_CACHE = ("digits", "cifar10", "cifar100")  # in memory: their families decode nothing to disk


def model_spec(config: dict[str, Any], task: str, freeze_encoder: bool | None = None) -> ModelSpec:
    """The task model of ``task`` from the model section (``freeze_encoder``: a kind's own choice for step 4)."""
    from models.tasks import get_task

    model, data, spec = config["model"], config["data"], get_task(task)
    classes = None
    if spec.kind == "classification" or spec.out_channels is None:  # a folder family's target: its manifest says
        classes = CLASSES.get(data["source"], data.get("top_k_classes") or DEFAULT_CLASSES)
    return ModelSpec(task, model["encoder"], model["weights"],
                     model["freeze_encoder"] if freeze_encoder is None else freeze_encoder, model["decoder_width"],
                     model["image_size"], model.get("embedding_grid", 0), classes)


def sample_count(config: dict[str, Any], out_dir: Path) -> tuple[int | None, str]:
    """The manifest's rows before step 1, and where the figure comes from: a finished step 1 in ``out_dir`` (the
    latest), else what the source fixes (synthetic: buildings × views, an upper bound of step 1's top-k classes),
    else None (Taskonomy and folders are counted by step 1)."""
    manifests = sorted((path for path in Path(out_dir).glob("step1-*/manifest.csv") if is_done(path.parent)),
                       key=lambda path: path.stat().st_mtime)
    if manifests:
        with open(manifests[-1], "rb") as handle:
            return sum(1 for _ in handle) - 1, f"the finished step 1 in {manifests[-1].parent.name}"
    data = config["data"]
    if data["source"] == "synthetic":
        synthetic = data["synthetic"]
        return synthetic["n_buildings"] * synthetic["n_views"], "data.synthetic's buildings × views, at most"
    if data["source"] == "digits" and data.get("n_samples"):
        return data["n_samples"], "data.n_samples"
    if data["source"] in FIXED_SAMPLES:
        return FIXED_SAMPLES[data["source"]], f"{data['source']}'s size"
    return None, ""


def centralized_stages(config: dict[str, Any], references: list[tuple[str, int]]) -> list[PlannedStage]:
    """Step 2 of each (task, seed): best.pt, last.pt (with the optimizer's state) and its small files; while it
    writes last.pt, a temporary copy of it. Each task's model is sized once."""
    sizes = {task: centralized_bytes(model_spec(config, task), config["centralized"]["optimizer"])
             for task in dict.fromkeys(task for task, _ in references)}
    return [PlannedStage("step 2", f"centralized/{task}-*", centralized_params(config, task, "", "", seed),
                         Bytes(sizes[task] + STAGE_FILES), peak=sizes[task]) for task, seed in references]


def federated_stage(folder: str, params: dict[str, Any], size: RunBytes, n_clients: int) -> PlannedStage:
    """One step-4 run: what it keeps, and its peak while it writes (pipeline/disk_sizes.py's RunBytes)."""
    from network.run_config import RunConfig

    memory = int(_default(RunConfig, "client_state_memory_mb") * MIB)  # no study key sets it: step 4's default
    return PlannedStage("step 4", folder, params, Bytes(size.kept() + STAGE_FILES), peak=size.peak(n_clients, memory))


@dataclass
class RunSizes:
    """The files of each kind of step-4 run of one grid, each kind sized once and each algorithm probed once
    (pipeline/disk_sizes.py); ``notes`` collects what a failed probe assumed."""

    config: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    runs: dict[tuple, RunBytes] = field(default_factory=dict)
    probes: dict[tuple, Any] = field(default_factory=dict)

    def of(self, task: str, algorithm: str, settings: Mapping[str, Any], n_clients: int,
           freeze_encoder: bool) -> RunBytes:
        key = (task, algorithm, tuple(sorted((str(name), str(value)) for name, value in settings.items())), n_clients,
               freeze_encoder)
        if key not in self.runs:
            # keep_client_state: no study key sets it, so only an algorithm whose states are a result keeps them
            self.runs[key] = run_bytes(model_spec(self.config, task, freeze_encoder), algorithm, settings, n_clients,
                                       False, self.probes)
            if self.runs[key].note and self.runs[key].note not in self.notes:
                self.notes.append(self.runs[key].note)
        return self.runs[key]


def caches(config: dict[str, Any], per_task_sets: Mapping[str, int], notes: list[str]) -> list[PlannedCache]:
    """The decoded-sample cache and the feature cache of a grid.

    Args:
        per_task_sets: task -> how many distinct sets of rows its stages decode, each set its own cache (the cache is
            keyed by the rows it holds: step 2's splits together make one, every partition's clients another).
    """
    from models.tasks import get_task

    found = []
    model, source = config["model"], config["data"]["source"]
    if source in TASKONOMY_CACHE:
        # step 3 embeds the whole manifest (rgb and mask), then each task's sets with its own domains
        per_sample = decoded_bytes_per_sample([], model["image_size"]) + sum(
            sets * decoded_bytes_per_sample(get_task(task).required_domains, model["image_size"])
            for task, sets in per_task_sets.items())
        found.append(PlannedCache("decoded-sample cache", "decoded_", Bytes(per_sample=per_sample)))
    elif source not in NO_DECODED_CACHE:  # a folder family's cache: its layout is its own
        notes.append(f"the decoded-sample cache of data.source {source} is not projected")
    if model["cache_features"]:
        spec = model_spec(config, next(iter(per_task_sets)))
        try:
            per_sample = feature_bytes_per_sample(spec)
        except Exception as error:  # an encoder whose meta forward fails: said, not guessed
            notes.append(f"the feature cache is not projected ({type(error).__name__} on the meta device)")
        else:
            found.append(PlannedCache("feature cache", "encoded_", Bytes(per_sample=per_sample)))
    return found


def embedding_bytes(spec: ModelSpec, notes: list[str]) -> Bytes:
    """Step 3's folder of one step-2 model: embeddings.npy, clusters.csv and sample_ids.csv per sample."""
    try:
        width = embedding_width(spec)
    except Exception as error:  # a model whose meta forward fails: said in the line, not guessed
        notes.append(f"step 3's embeddings are not projected ({type(error).__name__} on the meta device)")
        return Bytes(STAGE_FILES)
    return Bytes(STAGE_FILES, width * 4 + 2 * CSV_ROW_BYTES)


def _default(cls: type, name: str) -> Any:
    return next(item.default for item in dataclasses.fields(cls) if item.name == name)
