"""What each stage of a grid writes, in bytes, asked of the code before step 0 (pipeline/disk_projection.py adds it up).

Nothing here allocates the experiment's model: it is built on PyTorch's meta device, which gives every tensor's shape
and dtype (ResNet-50 in 0.04 s) and every forward pass's output shapes, but no values. What an algorithm keeps (its
server state, each client's state) cannot be read off a meta model, since a client's round calls ``.item()``; it is
read instead from real rounds of the algorithm on a small probe model (pipeline/disk_probe.py), tensor by tensor:
each tensor is matched to the worker-model entry it copies and counted in that entry's *cell* (head or body,
parameter or buffer, BatchNorm or not, fixed or trained; :class:`Footprint`), and the experiment's model is then
charged the same share of each of its own cells. SCAFFOLD's client state, for instance, is every trained parameter
once (each cell of trained parameters at share 1.0), FedRep's the head, FedBN's the BatchNorm entries, IFCA's server
k whole models. A tensor no model entry names (CCVR's class moments, the RNG state) is charged its probe size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch
from torch import nn


FLOAT_BYTES = 4  # embeddings.npy and the feature cache's maps are float32
# torch.save's bytes per tensor beyond its data where no probe measured them: ResNet-50's best.pt is 96.4 MiB for
# 96.28 MiB of tensors in 348 entries (docs/BENCHMARKS.md), about 360 bytes each
ASSUMED_RECORD_BYTES = 512.0
Cell = tuple[bool, bool, bool, bool]  # (head, parameter, BatchNorm, fixed) of a worker-model entry


@dataclass(frozen=True)
class ModelSpec:
    """The task model a stage builds (``models.build_task_model``'s arguments that change its tensors)."""

    task: str
    encoder: str
    weights: str
    freeze_encoder: bool
    decoder_width: int | None
    image_size: int
    embedding_grid: int = 0
    num_classes: int | None = None

    @property
    def strips_encoder(self) -> bool:
        """Whether checkpoints leave the encoder out (a frozen pretrained one: models/frozen_encoder.py)."""
        return self.freeze_encoder and self.weights != "none"


@dataclass(frozen=True)
class Footprint:
    """One checkpoint part (a server checkpoint, best.pt, one client's state) as shares of the model's cells.

    Attributes:
        shares: cell -> bytes of the part's tensors copying entries of that cell ÷ the cell's bytes (SCAFFOLD's
            client state: 1.0 in every trained-parameter cell; IFCA's server with k = 2: 2.0 in every cell).
        counts: cell -> the same share in tensors (each tensor costs torch.save a record).
        probed: the cells the probe model has; a cell of the experiment's model that the probe's lacks (a fixed
            cell when only the experiment freezes its encoder) is charged ``overall``.
        overall: the part's bytes ÷ the whole probe model's.
        overall_count: the same in tensors.
        other_bytes: tensors no model entry names, at their probe size.
        other_count: how many such tensors.
    """

    shares: dict[Cell, float] = field(default_factory=dict)
    counts: dict[Cell, float] = field(default_factory=dict)
    probed: frozenset[Cell] = frozenset()
    overall: float = 0.0
    overall_count: float = 0.0
    other_bytes: int = 0
    other_count: int = 0


@dataclass(frozen=True)
class ModelCells:
    """The bytes and tensor counts of each cell of a worker model's state dict."""

    bytes: dict[Cell, int]
    counts: dict[Cell, int]

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def charge(self, footprint: Footprint, record_bytes: float, strip_fixed: bool = False) -> int:
        """Bytes of ``footprint`` on this model, written by torch.save (``record_bytes`` per tensor); with
        ``strip_fixed`` the fixed cells are left out, as a frozen pretrained encoder is."""
        payload, count = float(footprint.other_bytes), float(footprint.other_count)
        for cell, size in self.bytes.items():
            if strip_fixed and cell[3]:
                continue
            probed = cell in footprint.probed
            payload += (footprint.shares.get(cell, 0.0) if probed else footprint.overall) * size
            count += (footprint.counts.get(cell, 0.0) if probed else footprint.overall_count) * self.counts[cell]
        return math.ceil(payload + count * record_bytes)


@dataclass(frozen=True)
class AlgorithmShape:
    """What one algorithm keeps, read from a probe round (pipeline/disk_probe.py: ``probe_algorithm``).

    Attributes:
        server: the checkpoint without client states (model, server state, RNG) after the probe's rounds, on a
            federation of ``clients[0]``.
        server_init: the server state as ``init_server`` makes it at each of ``clients`` (one entry when only one
            size was probed): their difference is what each further client adds (FedAMP keeps a model per client).
        best: best.pt (the global model and the server's named models).
        client: one client's state after its probe rounds.
        clients: the federation sizes probed.
        record_bytes: torch.save's bytes per tensor beyond its data, measured on the probe's server checkpoint.
        keeps_states: a finished run keeps its clients' states whatever ``--keep_client_state`` says (sparse_ft's
            θ_k with ``keep_local_models``: ``Algorithm.client_state_is_a_result``).
        note: why the probe failed and what is assumed instead (empty: it ran).
    """

    server: Footprint
    server_init: tuple[Footprint, ...]
    best: Footprint
    client: Footprint
    clients: tuple[int, ...]
    record_bytes: float
    keeps_states: bool = False
    note: str = ""


@dataclass(frozen=True)
class RunBytes:
    """One step-4 run's files.

    Attributes:
        finished: checkpoint.pt once the run is over (no client states unless they are kept).
        best: best.pt.
        during: checkpoint.pt while the run goes on, every client holding a state.
        client: one client's state (ClientStore's in-memory bytes: what counts toward its spill limit).
        note: the probe's note (empty when it ran).
    """

    finished: int
    best: int
    during: int
    client: int
    note: str = ""

    def kept(self) -> int:
        return self.finished + self.best

    def spilled(self, n_clients: int, memory_limit: int) -> int:
        """Client states ClientStore writes to disk once ``memory_limit`` bytes of them are in memory."""
        if self.client == 0:
            return 0
        in_memory = memory_limit // self.client
        return max(0, n_clients - in_memory) * self.client

    def peak(self, n_clients: int, memory_limit: int) -> int:
        """Bytes beyond :meth:`kept` while the run writes a checkpoint: the last one, its replacement's temporary
        file of the same size, and the spilled states (best.pt is counted once, in :meth:`kept`)."""
        return 2 * self.during + self.spilled(n_clients, memory_limit) - self.finished


def meta_model(spec: ModelSpec) -> nn.Module:
    """The task model of ``spec`` on the meta device (random weights: its shapes are what count)."""
    from models import build_task_model

    with torch.device("meta"):
        return build_task_model(spec.task, spec.encoder, "none", num_classes=spec.num_classes,
                                embedding_grid=spec.embedding_grid, freeze_encoder=spec.freeze_encoder,
                                decoder_width=spec.decoder_width)


def worker_cells(spec: ModelSpec, algorithm: str, settings: Mapping[str, Any]) -> ModelCells:
    """The cells of the worker model ``algorithm`` trains for ``spec``, on the meta device."""
    from network.algorithms.base import ALGORITHMS
    from network.settings import build_settings

    algorithm_class = ALGORITHMS.get(algorithm)
    with torch.device("meta"):
        worker = algorithm_class.worker_model(meta_model(spec), build_settings(algorithm_class.Settings, settings,
                                                                               algorithm))
    return model_cells(worker)


def model_cells(model: nn.Module) -> ModelCells:
    """Bytes and tensor counts of each cell of ``model``'s state dict (a meta model's too)."""
    roles = cell_of(model)
    sizes: dict[Cell, int] = {}
    counts: dict[Cell, int] = {}
    for key, value in model.state_dict().items():
        sizes[roles[key]] = sizes.get(roles[key], 0) + value.numel() * value.element_size()
        counts[roles[key]] = counts.get(roles[key], 0) + 1
    return ModelCells(sizes, counts)


def cell_of(model: nn.Module) -> dict[str, Cell]:
    """Each state-dict entry of ``model`` -> its cell, from the layout every algorithm reads (ModelLayout)."""
    from network.algorithms.base import ModelLayout

    layout = ModelLayout.of(model)
    return {key: (key in layout.head_keys, key in layout.param_keys, key in layout.batchnorm_keys,
                  key in layout.fixed_keys) for key in layout.state_keys}


# ----- a whole step-4 run, step 2's folder, the per-sample outputs -----
def run_files(shape: AlgorithmShape, cells: ModelCells, n_clients: int, keep_client_state: bool,
              strip_fixed: bool) -> RunBytes:
    """The arithmetic of :func:`run_bytes`: ``shape`` charged on the model ``cells`` for ``n_clients`` clients.

    The server checkpoint is read after the probe's rounds and grows by what ``init_server`` adds per client between
    the two sizes probed (FedAMP's server keeps a model per client); during the run the checkpoint holds every
    client's state, and a finished one holds them only when they are kept.
    """
    inits = [cells.charge(part, shape.record_bytes, strip_fixed) for part in shape.server_init]
    per_client = inits[1] - inits[0] if len(inits) == 2 else 0
    finished = cells.charge(shape.server, shape.record_bytes, strip_fixed) + per_client * (n_clients - shape.clients[0])
    client = cells.charge(shape.client, shape.record_bytes, strip_fixed)  # an empty state (FedAvg's) charges nothing
    return RunBytes(finished + (n_clients * client if keep_client_state or shape.keeps_states else 0),
                    cells.charge(shape.best, shape.record_bytes, strip_fixed), finished + n_clients * client,
                    cells.charge(shape.client, 0.0), shape.note)  # ClientStore counts tensor bytes, none stripped


def optimizer_share(name: str) -> float:
    """Bytes of step 2's optimizer state per byte of trained parameter (AdamW: its two moments, 2.0), read from
    one step of the optimizer step 2 builds (training/schedules.py) on a small parameter."""
    from training.schedules import make_optimizer

    parameter = nn.Parameter(torch.zeros(4096))
    optimizer = make_optimizer(name, [parameter], 1e-3, 0.0)
    parameter.grad = torch.ones_like(parameter)
    optimizer.step()
    state = sum(value.numel() * value.element_size() for entry in optimizer.state.values() for value in entry.values()
                if torch.is_tensor(value))
    return state / (parameter.numel() * parameter.element_size())


def model_bytes(spec: ModelSpec) -> int:
    """A checkpoint of the model alone (step 2's best.pt), without a frozen pretrained encoder."""
    return model_cells(meta_model(spec)).charge(Footprint(overall=1.0, overall_count=1.0), ASSUMED_RECORD_BYTES,
                                                spec.strips_encoder)


def centralized_bytes(spec: ModelSpec, optimizer: str) -> int:
    """Step 2's best.pt (the model) and last.pt (the model and the optimizer's state over the trained parameters)."""
    trained = [value for value in meta_model(spec).parameters() if value.requires_grad]
    state = optimizer_share(optimizer) * sum(value.numel() * value.element_size() for value in trained)
    return 2 * model_bytes(spec) + math.ceil(state + 2 * len(trained) * ASSUMED_RECORD_BYTES)


def embedding_width(spec: ModelSpec) -> int:
    """The step-2 model's embedding length (step 3's embeddings.npy row), from a forward pass on the meta device."""
    model = meta_model(spec).eval()  # eval: BatchNorm on a 1×1 map of a small image takes any batch
    with torch.device("meta"):
        _, embedding = model(torch.empty(2, 3, spec.image_size, spec.image_size))
    return int(embedding.shape[1])


def feature_bytes_per_sample(spec: ModelSpec) -> int:
    """Bytes of one sample's row in the feature cache: the encoder's maps at the image size, float32."""
    model = meta_model(spec).eval()
    with torch.device("meta"):
        maps = model.encoder(model.normalise(torch.empty(1, 3, spec.image_size, spec.image_size)))
    return sum(feature.numel() for feature in maps) * FLOAT_BYTES


def decoded_bytes_per_sample(domains: Iterable[str], image_size: int) -> int:
    """Bytes of one sample's row in a Taskonomy-format decoded-sample cache holding rgb, ``domains`` and the mask."""
    from datasets.taskonomy import array_layout

    layout = array_layout(list(dict.fromkeys(["rgb", *domains])), image_size)
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in layout.values())
