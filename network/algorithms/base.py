"""The federated algorithm interface (docs/DESIGN.md §4) and the types that cross it.

An algorithm is one file: its ``Settings`` (a frozen dataclass of typed, documented
hyperparameters), its client half (``client_update``, run where the data is) and its
server half (``aggregate``, a pure function of the server state and the uploads).
Engines own the loop, sampling, evaluation, checkpoints and transport; an algorithm
never sees an engine.

State is explicit and made of ``dict[str, Tensor]`` only, so one checkpoint format
and one transport serve every algorithm:

* :class:`ServerState`: the named server *models* (one ``"global"`` model for FedAvg,
  k cluster models for IFCA) plus the algorithm's other server tensors (optimizer
  moments, SCAFFOLD's c). Engines evaluate, checkpoint and transport models by name.
* A *bundle* (``dict[str, Weights]``): what the server broadcasts and what a client
  uploads, as named groups of tensors (FedAvg uploads ``{"delta": Δ}``; SCAFFOLD
  ``{"delta": Δy, "control_delta": Δc}``). Flower sends one ArrayRecord per group.
* A client state (``Weights``): what a client keeps between its rounds and never
  uploads (FedRep's head, SCAFFOLD's c_i, Ditto's v_i, IFCA's cluster id).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Protocol

import torch
from torch import Tensor, nn

from network.aggregation import Weights, reported_size
from utils.errors import TaskHetError
from utils.registry import Registry

Bundle = dict[str, Weights]

# Client metric names every algorithm reports (engines and the report read them).
TRAIN_LOSS = "train_loss"  # mean task loss over the local steps of the shared model
LOCAL_STEPS = "local_steps"  # optimizer steps actually taken, all phases together
GLOBAL_MODEL = "global"  # the model name of single-model algorithms

ALGORITHMS: Registry[type["Algorithm"]] = Registry("algorithm")


class LossFn(Protocol):
    """``loss_fn(model, batch)`` is the batch's mean loss (a scalar); ``reduction="none"`` gives one loss per sample."""

    def __call__(self, model: nn.Module, batch: dict, reduction: str = "mean") -> Tensor: ...


@dataclass(frozen=True)
class ModelLayout:
    """Names of a model's state-dict entries by role, read once from the (worker) model.

    Attributes:
        state_keys: every state-dict entry, in the model's order.
        param_keys: entries that are parameters (the server optimizer moves only these).
        head_keys: the task-specific output layer (``model.head_keys()``; empty if the model has none).
        batchnorm_keys: every entry of a BatchNorm module (affine parameters, running statistics,
            counter), selected by module type, whatever the module is called.
        fixed_keys: every entry of a module whose parameters are all frozen (``requires_grad``
            False when the algorithm is built: a frozen pretrained encoder, its BatchNorm
            statistics included, which TaskModel keeps in eval mode). Every party holds them from
            the start and they never change, so no client uploads them, no control variate or
            server moment covers them, and the server models keep their initial values.
    """

    state_keys: tuple[str, ...]
    param_keys: frozenset[str]
    head_keys: frozenset[str]
    batchnorm_keys: frozenset[str]
    fixed_keys: frozenset[str] = frozenset()

    @classmethod
    def of(cls, model: nn.Module) -> "ModelLayout":
        head = getattr(model, "head_keys", None)
        batchnorm = {f"{module_name}.{key}" if module_name else key
                     for module_name, module in model.named_modules()
                     if isinstance(module, nn.modules.batchnorm._BatchNorm)  # not InstanceNorm (also a _NormBase)
                     for key in module.state_dict()}
        fixed = {f"{module_name}.{key}" if module_name else key
                 for module_name, module in model.named_modules()
                 if any(True for _ in module.parameters(recurse=False))
                 and not any(param.requires_grad for param in module.parameters(recurse=False))
                 for key in module.state_dict(keep_vars=True) if "." not in key}
        return cls(state_keys=tuple(model.state_dict()), param_keys=frozenset(name for name, _ in model.named_parameters()),
                   head_keys=frozenset(head() if callable(head) else ()), batchnorm_keys=frozenset(batchnorm),
                   fixed_keys=frozenset(fixed))

    @property
    def varying_keys(self) -> tuple[str, ...]:
        """Every entry but the fixed ones, in the model's order: what training can change."""
        return tuple(key for key in self.state_keys if key not in self.fixed_keys)

    @property
    def body_keys(self) -> tuple[str, ...]:
        """Every entry outside the head, in the model's order."""
        return tuple(key for key in self.state_keys if key not in self.head_keys)


@dataclass(frozen=True)
class Federation:
    """What an algorithm may know about the federation it serves (fixed for a run).

    Attributes:
        client_sizes: client id -> number of training samples n_i, for every client.
        layout: the worker model's :class:`ModelLayout`.
        seed: the run's root seed (for an algorithm's own random draws, e.g. IFCA's initial models).
        input_key: the batch key of the model input: the data family's ``input_key`` (``rgb``, ``image``), or
            ``encoded`` with cached features (datasets/encoded.py); for an algorithm that feeds batches to the
            model itself (sparse_ft's mask calibration).
    """

    client_sizes: dict[str, int]
    layout: ModelLayout
    seed: int = 0
    input_key: str = "x"

    @property
    def num_clients(self) -> int:
        return len(self.client_sizes)

    @property
    def total_samples(self) -> int:
        return sum(self.client_sizes.values())


@dataclass
class ServerState:
    """The server's side of a run: named models plus the algorithm's other tensors.

    Attributes:
        models: model name -> weights (at least one model; ``"global"`` for single-model algorithms).
        tensors: everything else the server keeps (optimizer moments, control variates, counts).
    """

    models: dict[str, Weights]
    tensors: Weights = field(default_factory=dict)

    def to(self, device: torch.device | str) -> "ServerState":
        """A copy with every tensor on ``device`` (a checkpoint is written from ``to("cpu")``)."""
        return ServerState({name: _moved(weights, device) for name, weights in self.models.items()},
                           _moved(self.tensors, device))

    def as_dict(self) -> dict[str, Any]:
        return {"models": self.models, "tensors": self.tensors}


@dataclass(frozen=True)
class ClientConfig:
    """What the engine tells a client for one round (identical across algorithms).

    Attributes:
        lr: local learning rate η_l for this round (a function of the round only).
        loss_fn: see :class:`LossFn` (batch already on ``device``).
        device: where the model lives.
        num_samples: the client's number of training samples (its aggregation weight).
        local_steps: J minibatch steps per round, or None when ``local_epochs`` is set.
        local_epochs: E passes over the client's data per round, or None.
        momentum: local SGD momentum (a fresh optimizer each round and phase).
        weight_decay: local SGD weight decay.
        class_counts: the client's training samples per class (classification data; None otherwise),
            set by ``network.client.train_client`` from its ClientData (FedRoD's balanced softmax).
    """

    lr: float
    loss_fn: LossFn
    device: torch.device
    num_samples: int
    local_steps: int | None = None
    local_epochs: int | None = None
    momentum: float = 0.0
    weight_decay: float = 0.0
    class_counts: tuple[int, ...] | None = None

    def budget(self, multiple: int = 1) -> dict[str, int | None]:
        """``local_train`` keyword arguments for ``multiple`` times the local budget."""
        return {"steps": None if self.local_steps is None else self.local_steps * multiple,
                "epochs": None if self.local_epochs is None else self.local_epochs * multiple}


@dataclass
class ClientResult:
    """What ``client_update`` returns.

    Attributes:
        upload: the bundle sent to the server (never an entry of ``private_keys``).
        client_state: what the client keeps for its next round (never sent).
        metrics: numbers for metrics.csv (``TRAIN_LOSS``, ``LOCAL_STEPS``, …).
        num_samples: the client's number of training samples; ``network.client.train_client`` replaces it by the
            size the client reports (``Algorithm.reported_num_samples``) before it leaves the client.
    """

    upload: Bundle
    client_state: Weights
    metrics: dict[str, float] = field(default_factory=dict)
    num_samples: int = 0


@dataclass(frozen=True)
class Upload:
    """One client's upload as the server half sees it."""

    client_id: str
    tensors: Bundle
    num_samples: int
    metrics: dict[str, float] = field(default_factory=dict)


class Algorithm(ABC):
    """Base class of every algorithm; subclasses set ``name`` and ``Settings`` and implement the two halves.

    Args:
        settings: an instance of the algorithm's own ``Settings``.
        federation: the clients' sizes and the worker model's layout.
    """

    name: ClassVar[str] = ""
    Settings: ClassVar[type] = object
    personalized: ClassVar[bool] = False  # True: clients have own models (personal_model), evaluated separately
    # True: the clients' own models ARE the result and the global model is not (FedRep, FedPer: the global head is
    # never trained, so its global loss measures nothing); reports read these algorithms from their personal models.
    result_is_personal: ClassVar[bool] = False
    # True: ``client_updates`` trains a chunk of clients in lock-step (--vectorize_clients, network/vectorized.py).
    vectorizable: ClassVar[bool] = False
    needs_classifier: ClassVar[bool] = False  # True: it needs a Linear classifier head (FedLoGe, FedRoD, FedLC, CCVR)
    # True: its personal model is the global one after ``--finetune_steps`` local steps at evaluation (FedBABU,
    # Per-FedAvg); reports read its ``client_test_finetuned`` split as its personalised accuracy.
    personalised_by_finetuning: ClassVar[bool] = False
    # One line for the reference pages: the heterogeneity this method is for ("clients drift apart over many local steps").
    use_when: ClassVar[str] = ""
    # Client-level DP (network/privacy.py): the upload groups clipped together to C and noised at the server; the
    # server step must be a uniform mean of them (``weighting uniform``). Empty: DP is refused, saying ``dp_refusal``.
    dp_groups: ClassVar[tuple[str, ...]] = ()
    dp_refusal: ClassVar[str] = "its server step is not one uniform mean of the uploads (not implemented)"

    def __init__(self, settings: Any, federation: Federation) -> None:
        if not isinstance(settings, self.Settings):
            raise TypeError(f"{self.name} takes {self.Settings.__name__}, got {type(settings).__name__}")
        self.check_num_clients(settings, federation.num_clients)
        self.settings = settings
        self.federation = federation

    @classmethod
    def check_num_clients(cls, settings: Any, num_clients: int) -> None:
        """Refuse settings that cannot serve ``num_clients`` clients (none by default; IFCA: k <= clients).

        Called when the algorithm is built, before it allocates anything, and by the experiment-file
        checks with the file's number of clients, before step 0.
        """

    @classmethod
    def worker_model(cls, model: nn.Module, settings: Any) -> nn.Module:
        """The model the clients train, built from the task model (the task model itself by default).

        An algorithm that needs extra heads or an ensemble wraps ``model`` here; the engine
        builds the worker once and reuses it for every client.
        """
        return model

    def client_state_is_a_result(self) -> bool:
        """Whether the clients' states are an output a later step reads (sparse_ft's θ_k with ``keep_local_models``,
        which merge_task_vectors.py merges): a finished run then keeps them even without ``keep_client_state``."""
        return False

    def private_keys(self) -> frozenset[str]:
        """Worker-model entries that never leave a client (none by default); engines assert it on every upload."""
        return frozenset()

    def reported_num_samples(self, client_id: str, num_samples: int) -> int:
        """The training-set size a client uploads with its update (``Upload.num_samples``, Flower's num-samples).

        Exact by default; the private weightings (``weighting`` ``bucketed`` or ``noisy``) replace it by the bucketed
        or noisy size (:func:`network.aggregation.reported_size`), so the exact size never leaves the client. Both
        engines apply it on the client side, in ``network.client.train_client``.
        """
        return reported_size(self.settings, self.federation.seed, client_id, num_samples)

    def init_server(self, weights: Weights) -> ServerState:
        """The server state before round 1, from the initial worker-model weights."""
        return ServerState({GLOBAL_MODEL: weights})

    def calibrate_server(self, server: ServerState, model: nn.Module, batches: Iterable[dict] | None,
                         device: torch.device) -> ServerState:
        """The server state after server-side calibration (unchanged by default).

        Engines call it once, after ``init_server`` and before round 0's evaluation (a resumed
        run restores its result from the checkpoint), with the run's held-out calibration
        batches (``RunConfig.calibration_fraction``), or None when the run has none.
        ``model`` is the reused worker model (load what you need).
        """
        return server

    def broadcast(self, server: ServerState) -> Bundle:
        """What the server sends to every sampled client (the global model by default)."""
        return {GLOBAL_MODEL: server.models[GLOBAL_MODEL]}

    def client_broadcast(self, server: ServerState, broadcast: Bundle, client_id: str) -> Bundle:
        """What one sampled client receives: ``broadcast`` itself by default.

        Algorithms whose message differs per client (FedAMP's u_i, a CFL client's cluster model,
        MOCHA's Ω row) return it here; engines call it for each sampled client, with the server
        state the round's ``broadcast`` was made from.
        """
        return broadcast

    @abstractmethod
    def client_update(self, model: nn.Module, broadcast: Bundle, client_state: Weights,
                      loader: Iterable[dict], cfg: ClientConfig) -> ClientResult:
        """Train ``model`` (the reused worker: load everything it needs) on one client's data.

        ``client_state`` is empty in the client's first round.
        """

    def client_updates(self, model: nn.Module, broadcast: Bundle, client_states: list[Weights],
                       loaders: list[Iterable[dict]], cfgs: list[ClientConfig]) -> list[ClientResult]:
        """``client_update`` of a chunk of clients trained in lock-step (``vectorizable`` algorithms only).

        Each result must equal (allclose) the client's own ``client_update`` from the same state and
        loader; ``cfgs`` differ only in ``num_samples``.
        """
        raise TaskHetError(f"algorithm {self.name} does not train vectorised")

    def prepare_lockstep(self, model: nn.Module, broadcast: Bundle, client_state: Weights, loader: Iterable[dict],
                         cfg: ClientConfig) -> Weights:
        """Per-client work before a lock-step chunk, run under the client's own seeded RNG (as ``client_update``
        would run it) and on the loader the chunk then trains on; returns the state ``client_updates`` receives.
        The default does nothing (sparse_ft calibrates a new client's mask here)."""
        return client_state

    @abstractmethod
    def aggregate(self, server: ServerState, uploads: Iterable[Upload]) -> ServerState:
        """The next server state from this round's uploads (an iterable read once: aggregation streams)."""

    def evaluated_models(self, server: ServerState) -> dict[str, Weights]:
        """Server models evaluated on the global test split; the first is *the* global model (report, best.pt)."""
        return {GLOBAL_MODEL: server.models[GLOBAL_MODEL]}

    def personal_model(self, models: dict[str, Weights], client_state: Weights) -> Weights | None:
        """A client's own model for evaluation (None: it has none, e.g. it never trained).

        ``models`` is ``server.models``. Only called when ``personalized`` is True.
        """
        return None


def get_settings_class(name: str) -> type:
    """The ``Settings`` dataclass of the algorithm called ``name``."""
    return ALGORITHMS.get(name).Settings


def load_weights(model: nn.Module, weights: Weights) -> None:
    """Copy ``weights`` into the model's parameters and buffers in place.

    Every key must be an entry of the model: a key the model lacks is an error, never silently skipped.
    """
    state = model.state_dict()
    unknown = [key for key in weights if key not in state]
    if unknown:
        raise TaskHetError(f"weights do not fit the model: {len(unknown)} unknown entries, e.g. {unknown[:3]}")
    if weights:
        with torch.no_grad():
            torch._foreach_copy_([state[key] for key in weights], list(weights.values()))


def copy_state(model: nn.Module, keys: Iterable[str] | None = None) -> Weights:
    """Detached copies of the model's entries (``keys`` only, when given)."""
    state = model.state_dict()
    return {key: state[key].detach().clone() for key in (state if keys is None else keys)}


def trainable(model: nn.Module, keys: Iterable[str] | None = None) -> dict[str, nn.Parameter]:
    """Named parameters that require grad (restricted to ``keys`` when given)."""
    wanted = None if keys is None else set(keys)
    return {name: param for name, param in model.named_parameters()
            if param.requires_grad and (wanted is None or name in wanted)}


def make_optimizer(params: Iterable[Tensor], cfg: ClientConfig) -> torch.optim.Optimizer:
    """The local optimizer: SGD with the round's lr, momentum and weight decay."""
    return torch.optim.SGD(list(params), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def require(condition: bool, message: str) -> None:
    """Raise a TaskHetError with ``message`` unless ``condition`` holds."""
    if not condition:
        raise TaskHetError(message)


def _moved(weights: Weights, device: torch.device | str) -> Weights:
    return {key: value.detach().to(device) for key, value in weights.items()}
