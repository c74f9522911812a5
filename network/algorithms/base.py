"""The federated algorithm interface (DESIGN.md §4) and the helpers algorithms share.

An algorithm is a small object with explicit state. Both its halves live in its
file: the client half (``client_update``, run where the data is) and the server
half (``aggregate``, a pure function of the global weights, the server state and
the uploads). Engines own the loop; an algorithm never sees an engine. All state
is ``dict[str, Tensor]``, so one checkpoint format and one transport serve all.

Keys that travel between the two halves are the constants below, defined once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Iterable

import torch
from torch import Tensor, nn

from network.aggregation import Weights
from utils.errors import TaskHetError
from utils.registry import Registry

# ----- keys shared by client and server halves (and engines) -----
CONTROL_PREFIX = "control/"  # SCAFFOLD: the server control variate c, per parameter name (broadcast, server state)
CONTROL_DELTA_PREFIX = "control_delta/"  # SCAFFOLD: a client's Δc_i, per parameter name (upload)
TRAIN_LOSS = "train_loss"  # client metric: mean task loss over the local steps
HEAD_TRAIN_LOSS = "head_train_loss"  # client metric: FedRep's head phase loss
LOCAL_STEPS = "local_steps"  # client metric: optimizer steps actually taken

LossFn = Callable[[nn.Module, dict], Tensor]
Upload = tuple[Weights, int]  # (tensors sent to the server, the client's number of training samples)

ALGORITHMS: Registry[type["Algorithm"]] = Registry("algorithm")


@dataclass(frozen=True)
class AlgorithmConfig:
    """Hyperparameters of every algorithm; each reads the fields it needs.

    Attributes:
        num_clients: N, the number of clients in the federation (SCAFFOLD's |S|/N).
        mu: FedProx proximal weight μ in (μ/2)·‖w − w_global‖².
        server_opt: "sgd" | "momentum" | "adam" (FedAvg / FedAvgM / FedAdam server step).
        server_lr: server learning rate η_g (1.0 with sgd is plain FedAvg).
        server_momentum: β of FedAvgM.
        scaffold_option: "II" (c_i from the local trajectory) or "I" (c_i = full local gradient at x).
        head_epochs: FedRep head phase, in units of the local budget (J steps or E epochs).
        body_epochs: FedRep body phase, in the same units.
    """

    num_clients: int = 1
    mu: float = 0.01
    server_opt: str = "sgd"
    server_lr: float = 1.0
    server_momentum: float = 0.9
    scaffold_option: str = "II"
    head_epochs: int = 1
    body_epochs: int = 1


@dataclass(frozen=True)
class ClientConfig:
    """What the engine tells a client for one round (identical across algorithms).

    Attributes:
        lr: local learning rate η_l for this round (a function of the round only).
        loss_fn: ``loss_fn(model, batch) -> scalar loss`` (batch already on ``device``).
        device: where the model lives.
        num_samples: the client's number of training samples (its aggregation weight).
        local_steps: J minibatch steps per round, or None when ``local_epochs`` is set.
        local_epochs: E passes over the client's data per round, or None.
        momentum: local SGD momentum (a fresh optimizer each round).
        weight_decay: local SGD weight decay.
    """

    lr: float
    loss_fn: LossFn
    device: torch.device
    num_samples: int
    local_steps: int | None = None
    local_epochs: int | None = None
    momentum: float = 0.0
    weight_decay: float = 0.0

    def budget(self, multiple: int = 1) -> dict[str, int | None]:
        """``local_train`` keyword arguments for ``multiple`` times the local budget."""
        return {"steps": None if self.local_steps is None else self.local_steps * multiple,
                "epochs": None if self.local_epochs is None else self.local_epochs * multiple}


@dataclass
class ClientResult:
    """What ``client_update`` returns.

    Attributes:
        upload: tensors sent to the server (never a personal key).
        client_state: tensors the client keeps for its next round (CPU or device).
        metrics: numbers for the metrics file (``TRAIN_LOSS``, ``LOCAL_STEPS`` …).
        num_samples: the client's number of training samples.
    """

    upload: Weights
    client_state: Weights
    metrics: dict[str, float] = field(default_factory=dict)
    num_samples: int = 0


class Algorithm(ABC):
    """Base class: the five methods of DESIGN.md §4 plus ``broadcast`` and ``personalized_weights``."""

    name: ClassVar[str] = ""

    def __init__(self, config: AlgorithmConfig) -> None:
        self.config = config

    def init_server_state(self, global_weights: Weights) -> Weights:
        """Server state before round 1 (empty by default)."""
        return {}

    def init_client_state(self, global_weights: Weights) -> Weights:
        """A client's state before its first round (empty by default)."""
        return {}

    def broadcast(self, global_weights: Weights, server_state: Weights) -> Weights:
        """What the server sends to every sampled client (the global weights by default)."""
        return global_weights

    @abstractmethod
    def client_update(self, model: nn.Module, broadcast: Weights, client_state: Weights,
                      loader: Iterable[dict], cfg: ClientConfig) -> ClientResult:
        """Train ``model`` (reused across clients: load everything it needs) on one client's data."""

    @abstractmethod
    def aggregate(self, global_weights: Weights, server_state: Weights,
                  uploads: Iterable[Upload]) -> tuple[Weights, Weights]:
        """New ``(global_weights, server_state)`` from the round's uploads (read once, streaming)."""

    def personal_keys(self, model: nn.Module) -> list[str]:
        """State-dict names that never leave a client (none by default)."""
        return []

    def personalized_weights(self, global_weights: Weights, client_state: Weights) -> Weights:
        """A client's own model: the global weights with its personal entries swapped in (none by default)."""
        return global_weights


def load_weights(model: nn.Module, weights: Weights) -> None:
    """Copy ``weights`` into the model's parameters and buffers in place (keys not in the model are skipped)."""
    state = model.state_dict()
    keys = [key for key in weights if key in state]
    if not keys:
        return
    with torch.no_grad():
        torch._foreach_copy_([state[key] for key in keys], [weights[key] for key in keys])


def trainable(model: nn.Module, keys: Iterable[str] | None = None) -> dict[str, nn.Parameter]:
    """Named parameters that require grad (restricted to ``keys`` when given)."""
    wanted = None if keys is None else set(keys)
    return {name: param for name, param in model.named_parameters()
            if param.requires_grad and (wanted is None or name in wanted)}


def make_optimizer(params: Iterable[Tensor], cfg: ClientConfig) -> torch.optim.Optimizer:
    """The local optimizer every algorithm uses: SGD with the round's lr, momentum and weight decay."""
    return torch.optim.SGD(list(params), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def require(condition: bool, message: str) -> None:
    """Raise a TaskHetError with ``message`` unless ``condition`` holds (hyperparameter checks)."""
    if not condition:
        raise TaskHetError(message)
