"""The one local training loop every federated algorithm runs (STYLE.md §1).

Algorithms differ only in what they pass in (through ``network.algorithms.skeleton.Phase``):
an extra loss term (FedProx's proximal term), a gradient hook run between ``backward``
and ``optimizer.step`` (SCAFFOLD's correction), a map applied after each step (Ditto's
proximal step), or which parameters the optimizer holds (FedRep's phases). The loop knows nothing about tasks: ``loss_fn(model, batch)`` does, so
the same loop trains TaskModels on Taskonomy batches and the least-squares oracle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import torch
from torch import Tensor, nn

from utils.device import autocast, to_device
from utils.errors import NonFiniteLossError, TaskHetError

if TYPE_CHECKING:  # annotations only: network.algorithms imports this module
    from network.algorithms.base import LossFn


@dataclass(frozen=True)
class LocalTrainResult:
    """Summary of one client's local training.

    Attributes:
        steps: optimizer steps actually taken (SCAFFOLD's K).
        mean_loss: mean of ``loss_fn`` over those steps (extra loss terms excluded).
    """

    steps: int
    mean_loss: float


def local_train(model: nn.Module, loader: Iterable[dict], loss_fn: LossFn, optimizer: torch.optim.Optimizer,
                device: torch.device, *, steps: int | None = None, epochs: int | None = None,
                extra_loss: Callable[[nn.Module], Tensor] | None = None,
                grad_hook: Callable[[nn.Module], None] | None = None,
                post_step: Callable[[nn.Module], None] | None = None) -> LocalTrainResult:
    """Train ``model`` in place for ``steps`` minibatch steps or ``epochs`` passes over ``loader``.

    Args:
        model: the model, already on ``device``, holding the weights to start from.
        loader: re-iterable batches (dicts of tensors); with ``steps`` it is cycled
            (each new pass draws the loader's next shuffle).
        loss_fn: ``loss_fn(model, batch) -> scalar`` on a batch moved to ``device``.
        optimizer: holds exactly the parameters this phase may change.
        device: where batches go.
        steps: J, the number of optimizer steps (exclusive with ``epochs``).
        epochs: E, the number of passes over ``loader``.
        extra_loss: ``extra_loss(model) -> scalar`` added to the loss before
            ``backward`` (computed outside autocast, in the parameters' precision).
        grad_hook: ``grad_hook(model)`` called after ``backward``, before ``optimizer.step``.
        post_step: ``post_step(model)`` called after every ``optimizer.step`` (a proximal map).

    Returns:
        The steps taken and the mean task loss. The loss is checked once at the end
        (one device sync per client); a NaN/inf loss raises :class:`NonFiniteLossError`.
    """
    if (steps is None) == (epochs is None):
        raise ValueError("local_train needs exactly one of steps and epochs")
    model.train()
    mixed_precision = autocast(device)  # one context object, re-entered every step
    losses = []  # kept on the device and summed once: no per-step sync, no per-step add kernel
    for batch in budget_batches(loader, steps, epochs):
        batch = to_device(batch, device)
        optimizer.zero_grad(set_to_none=True)
        with mixed_precision:
            loss = loss_fn(model, batch)
        objective = loss if extra_loss is None else loss.float() + extra_loss(model)
        objective.backward()
        if grad_hook is not None:
            grad_hook(model)
        optimizer.step()
        if post_step is not None:
            post_step(model)
        losses.append(loss.detach())
    taken = len(losses)
    mean_loss = float(torch.stack(losses).float().mean()) if losses else 0.0
    if not math.isfinite(mean_loss):
        raise NonFiniteLossError(f"the local training loss is {mean_loss}")
    return LocalTrainResult(steps=taken, mean_loss=mean_loss)


def budget_batches(loader: Iterable[dict], steps: int | None, epochs: int | None) -> Iterator[dict]:
    """The batches of a local budget: ``epochs`` passes over ``loader``, or ``steps`` batches cycling it."""
    if epochs is not None:
        for _ in range(epochs):
            yield from loader
        return
    taken = 0
    while taken < steps:
        empty = True
        for batch in loader:
            empty = False
            yield batch
            taken += 1
            if taken == steps:
                return
        if empty:
            raise TaskHetError("a client has no training batches (its data loader is empty)")
