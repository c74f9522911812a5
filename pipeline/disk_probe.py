"""What an algorithm keeps, read from real rounds on a small probe model (pipeline/disk_sizes.py charges it on the
experiment's model; pipeline/disk_projection.py adds the grid up).

An algorithm's server state and each client's state cannot be read off a meta-device model, since a client's round
calls ``.item()``; they are read from real rounds of the algorithm on :class:`ProbeEncoder` (about 1,400 parameters),
tensor by tensor: each tensor is matched to the worker-model entry it copies and counted in that entry's *cell*
(:class:`pipeline.disk_sizes.Footprint`).
"""

from __future__ import annotations

import io
import re
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from pipeline.disk_sizes import (ASSUMED_RECORD_BYTES, AlgorithmShape, Cell, Footprint, ModelCells, ModelSpec,
                                 RunBytes, cell_of, model_cells, run_files, worker_cells)
from utils.errors import TaskHetError

PROBE_IMAGE = 16  # probe batches' side in pixels: shapes of the states do not depend on it
PROBE_CLASSES = 4
PROBE_BATCHES = 2  # batches of 2 in a probe client's loader (one local step is taken)
_SPLIT = re.compile(r"[./]")  # an entry inside a longer name: FedEM's "components.0.<key>", sparse_ft's "base/<key>"


class ProbeEncoder(nn.Module):
    """A two-stage convolutional encoder with BatchNorm (about 1,400 parameters): the probe's task model then has
    every cell a registered encoder's has (BatchNorm parameters and statistics, other layers, a decoder, a head),
    and a round of it costs milliseconds (EfficientNet-Lite0's took 0.5–4 s on the shared 2-core CPU)."""

    channels, strides = (8, 16), (2, 4)
    mean, std = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
    decoder_width, prelogit_hidden = 8, 16

    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleList(nn.Sequential(nn.Conv2d(inputs, outputs, 3, stride=2, padding=1, bias=False),
                                                  nn.BatchNorm2d(outputs), nn.ReLU())
                                    for inputs, outputs in ((3, 8), (8, 16)))

    def forward(self, x: Tensor) -> list[Tensor]:
        features = []
        for stage in self.stages:
            x = stage(x)
            features.append(x)
        return features


def probe_model(task: str, freeze_encoder: bool) -> nn.Module:
    """The probe's task model for ``task``: :class:`ProbeEncoder` under the task's own decoder and head."""
    from models.task_model import TaskModel
    from models.tasks import get_task

    spec = get_task(task)
    outputs = PROBE_CLASSES if spec.kind == "classification" or spec.out_channels is None else spec.out_channels
    config = {"task": task, "encoder": "probe", "weights": "none", "num_classes": PROBE_CLASSES, "embedding_grid": 0,
              "embedding_layer": "penultimate", "decoder_width": None}
    model = TaskModel(spec, ProbeEncoder(), outputs, 0, "penultimate", config)  # an Encoder by its attributes
    return model.freeze_encoder_() if freeze_encoder else model


# ----- the probe: one real round of an algorithm on a small model -----
def probe_algorithm(task: str, algorithm: str, settings: Mapping[str, Any], n_clients: int,
                    freeze_encoder: bool) -> AlgorithmShape:
    """What ``algorithm`` with ``settings`` keeps on a federation of ``n_clients``, read from real rounds on the
    probe model (:func:`probe_model`) for ``task``. A probe that fails (an algorithm whose round diverges on
    random data) assumes the largest usual shape instead, two models on the server and one per client, and says so.
    """
    sizes = probe_sizes(algorithm, settings, n_clients)
    try:
        with torch.random.fork_rng(devices=[]):  # the probe must not move the caller's global RNG
            torch.manual_seed(0)
            model = probe_model(task, freeze_encoder)
            part = probe_round(model, task, algorithm, settings, sizes[0])
            cells, probe_cells = cell_of(part["worker"]), part["cells"]
            inits = [footprint(part["server_init"], cells, probe_cells)]
            # A second size only where the server could keep a model per client: one that starts with two model-
            # sized sets or more (FedAMP: 1 + clients; SCAFFOLD, IFCA: 2), and init_server alone (FedLoGe's init
            # refines its ETF for 10,000 steps: seconds of CPU, so no server that starts with one set pays it twice).
            if len(sizes) == 2 and inits[0].overall >= 2.0:
                inits.append(footprint(server_at_init(model, algorithm, settings, sizes[1]), cells, probe_cells))
    except Exception as error:  # any failure of a round on random data: a stated upper bound, never a crash
        return assumed_shape(sizes, f"{algorithm}'s probe round failed ({type(error).__name__}: "
                                    f"{str(error).splitlines()[0][:120]}); assumed two models on the server and one "
                                    "per client")
    return AlgorithmShape(footprint(part["server"], cells, probe_cells), tuple(inits),
                          footprint(part["best"], cells, probe_cells), footprint(part["client"], cells, probe_cells),
                          tuple(sizes[:len(inits)]), record_bytes(part["server"]), part["keeps_states"])


def probe_sizes(algorithm: str, settings: Mapping[str, Any], n_clients: int) -> list[int]:
    """The federation sizes to probe: the smallest the algorithm accepts (IFCA needs k clients), and one more, so
    a server that keeps something per client is extrapolated to ``n_clients`` (one size when that is all there is)."""
    from network.algorithms.base import ALGORITHMS
    from network.settings import build_settings

    algorithm_class = ALGORITHMS.get(algorithm)
    parsed = build_settings(algorithm_class.Settings, settings, algorithm)
    for size in range(min(2, n_clients), n_clients + 1):
        try:
            algorithm_class.check_num_clients(parsed, size)
        except TaskHetError:
            continue
        return [size] if size == n_clients else [size, size + 1]
    return [n_clients]


def probe_round(model: nn.Module, task: str, algorithm: str, settings: Mapping[str, Any],
                n_clients: int) -> dict[str, Any]:
    """A round of client "0" on a federation of ``n_clients`` (its state from a second one when the first left it
    empty): the checkpoint parts as the engine writes them, and the server as ``init_server`` made it."""
    import copy

    from models.tasks import get_task
    from network.algorithms import build_algorithm
    from network.algorithms.base import ClientConfig, Upload

    classify = get_task(task).kind == "classification"
    algorithm_object, worker = build_algorithm(algorithm, copy.deepcopy(model), {str(i): 10 for i in range(n_clients)},
                                               settings, input_key="x")
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(2, 3, PROBE_IMAGE, PROBE_IMAGE, generator=generator)
    # the images under the families' input keys too: sparse_ft's calibration reads the one its settings name
    batch = {"x": images, "rgb": images, "image": images, "label": torch.tensor([0, 1]), "sample_id": ["a", "b"]}

    def loss_fn(net: nn.Module, batch: dict, reduction: str = "mean") -> Tensor:
        output = net(batch["x"])[0].float()
        losses = (nn.functional.cross_entropy(output, batch["label"], reduction="none") if classify
                  else output.pow(2).flatten(1).mean(1))
        return losses.mean() if reduction == "mean" else losses

    config = ClientConfig(lr=1e-3, loss_fn=loss_fn, device=torch.device("cpu"), num_samples=10, local_steps=1,
                          class_counts=(1, 1, 0, 0) if classify else None)
    server = algorithm_object.init_server({key: value.detach().clone() for key, value in worker.state_dict().items()})
    initial = server.as_dict()
    broadcast = algorithm_object.client_broadcast(server, algorithm_object.broadcast(server), "0")
    # several batches: FedALA's weight learning reads a share of the client's batches, at least one
    result = algorithm_object.client_update(worker, broadcast, {}, [batch] * PROBE_BATCHES, config)
    state = result.client_state
    server = algorithm_object.aggregate(server, [Upload("0", result.upload, 10)])
    if not state:  # a state that starts empty (FedRep's head before its first round): the client's second round
        broadcast = algorithm_object.client_broadcast(server, algorithm_object.broadcast(server), "0")
        state = algorithm_object.client_update(worker, broadcast, state, [batch] * PROBE_BATCHES, config).client_state
    global_weights = next(iter(algorithm_object.evaluated_models(server).values()))
    return {"worker": worker, "cells": model_cells(worker), "server_init": initial,
            "server": {"model": global_weights, "server": server.as_dict(), "rng": torch.get_rng_state()},
            "best": {"model": global_weights, "models": server.models}, "client": state,
            "keeps_states": algorithm_object.client_state_is_a_result()}


def server_at_init(model: nn.Module, algorithm: str, settings: Mapping[str, Any], n_clients: int) -> dict[str, Any]:
    """The server state ``init_server`` makes for a federation of ``n_clients`` (no round)."""
    import copy

    from network.algorithms import build_algorithm

    algorithm_object, worker = build_algorithm(algorithm, copy.deepcopy(model), {str(i): 10 for i in range(n_clients)},
                                               settings, input_key="x")
    return algorithm_object.init_server({key: value.detach().clone()
                                         for key, value in worker.state_dict().items()}).as_dict()


def assumed_shape(sizes: list[int], note: str) -> AlgorithmShape:
    """The stated upper bound of a failed probe: two whole models on the server, one per client."""
    one, two = Footprint(overall=1.0, overall_count=1.0), Footprint(overall=2.0, overall_count=2.0)
    return AlgorithmShape(two, tuple(two for _ in sizes), one, one, tuple(sizes), ASSUMED_RECORD_BYTES, note=note)


def footprint(part: Any, cells: dict[str, Cell], model: ModelCells) -> Footprint:
    """``part``'s storages (each once, as torch.save writes them) as shares of ``model``'s cells."""
    shares: dict[Cell, float] = {}
    counts: dict[Cell, float] = {}
    other_bytes = other_count = 0
    for key, size in storages(part).values():
        entry = None if key is None else entry_of(key, cells)
        if entry is None:
            other_bytes += size
            other_count += 1
            continue
        cell = cells[entry]
        shares[cell] = shares.get(cell, 0.0) + size / max(model.bytes[cell], 1)
        counts[cell] = counts.get(cell, 0.0) + 1 / max(model.counts[cell], 1)
    overall = sum(shares.get(cell, 0.0) * size for cell, size in model.bytes.items()) / max(model.total, 1)
    overall_count = (sum(counts.get(cell, 0.0) * count for cell, count in model.counts.items())
                     / max(sum(model.counts.values()), 1))
    return Footprint(shares, counts, frozenset(model.bytes), overall, overall_count, other_bytes, other_count)


def entry_of(key: str, cells: Mapping[str, Cell]) -> str | None:
    """The worker-model entry ``key`` copies: itself, or the longest entry it ends in after a ``.`` or ``/``."""
    if key in cells:
        return key
    for match in _SPLIT.finditer(key):
        if key[match.end():] in cells:
            return key[match.end():]
    return None


def storages(part: Any, key: str | None = None, found: dict | None = None) -> dict[int, tuple[str | None, int]]:
    """Every distinct storage under ``part`` (nested dicts, lists): data pointer -> (the name it was first met
    under, its bytes). torch.save writes a storage once, whatever number of entries share it."""
    found = {} if found is None else found
    if torch.is_tensor(part):
        storage = part.untyped_storage()
        found.setdefault(storage.data_ptr() or id(part), (key, storage.nbytes()))
    elif isinstance(part, Mapping):
        for name, value in part.items():
            storages(value, name if isinstance(name, str) else key, found)
    elif isinstance(part, (list, tuple)):
        for value in part:
            storages(value, key, found)
    return found


def record_bytes(part: Any) -> float:
    """torch.save's bytes per storage beyond the data (the zip record, the pickled key), measured on ``part``."""
    buffer = io.BytesIO()
    torch.save(part, buffer)
    found = storages(part)
    return max(0.0, (buffer.tell() - sum(size for _, size in found.values())) / max(len(found), 1))


def run_bytes(spec: ModelSpec, algorithm: str, settings: Mapping[str, Any], n_clients: int, keep_client_state: bool,
              shapes: dict[tuple, AlgorithmShape]) -> RunBytes:
    """The files of one step-4 run of ``algorithm`` on ``spec``'s model with ``n_clients`` clients.

    Args:
        keep_client_state: the finished checkpoint keeps every client's state (``--keep_client_state``, or an
            algorithm whose states are a result: ``Algorithm.client_state_is_a_result``).
        shapes: probes already made, by (task kind, algorithm, settings, clients, freeze_encoder): filled here.
    """
    from models.tasks import get_task

    key = (get_task(spec.task).kind, algorithm, tuple(sorted((str(k), str(v)) for k, v in settings.items())),
           n_clients, spec.freeze_encoder)
    if key not in shapes:
        shapes[key] = probe_algorithm(spec.task, algorithm, settings, n_clients, spec.freeze_encoder)
    return run_files(shapes[key], worker_cells(spec, algorithm, settings), n_clients, keep_client_state,
                     spec.strips_encoder)
