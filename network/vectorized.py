"""Vectorised clients (issue 23): a chunk of a round's clients trained in lock-step with ``torch.func``.

With a frozen, cached encoder a local step trains a small decoder or head, and most of its
time is per-step overhead paid once per client (Python, kernel launches, optimizer
bookkeeping). Here the C clients of a chunk keep their entries *stacked* (``[C, ...]``
per state-dict entry) and one step of all of them is one ``vmap`` over
``functional_call`` (the forward pass, each client on its own batch), one backward pass
over the batched graph (:func:`_chunk_gradients`), and one SGD update of the stacked tensors. What the sequential engine's loop does per client, this
does per chunk, so a client's trajectory is its sequential one (tested for every
supporting algorithm, ``tests/test_vectorized.py``):

* **Batches**: each client draws from its own seeded loader through the very generator
  ``local_train`` uses (``network.local_train.budget_batches``), so it sees the same samples in
  the same order. Clients whose batches differ in shape at a step (an epoch's short last
  batch) are stepped in separate calls, one per shape.
* **Masked steps**: a client without a batch at a step (fewer batches in the round, or
  a batch of another shape) takes a masked step: its parameters, momentum buffer and
  buffers (BatchNorm running statistics and ``num_batches_tracked``) keep their values
  exactly (``torch.where`` on the old tensor), and its loss is not counted.
* **SGD** (``network/functional_sgd.py``): ``torch.optim.SGD``'s per-tensor step, every option,
  as a function of stacked tensors; a client's first *taken* step sets its buffer to the
  direction, as torch's first step does.
* **BatchNorm**: each client's buffers are its own vmapped inputs, so batch statistics
  are per client and the running statistics come back as outputs (cloned before the
  forward pass, which updates them in place), never shared.

Hand-written on top of ``torch.func`` because no kept library trains many models with
different data in lock-step under torch's SGD semantics (``torch.func.stack_module_state``
covers the stacking only, and takes modules where the engine holds weight dicts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from network.algorithms.base import ClientConfig, LossFn
from network.functional_sgd import SGDOptions, momentum_step, per_client, sgd_step
from network.local_train import LocalTrainResult, budget_batches
from utils.device import autocast, to_device
from utils.errors import NonFiniteLossError, TaskHetError

Weights = dict[str, Tensor]
_WORKER = "model."  # entry prefix of the worker inside _Objective


def _masked(active: Tensor | None, new: Tensor, old: Tensor) -> Tensor:
    """``new`` for the active clients (every client where ``active`` is None), ``old`` (bit for bit) for the others."""
    return new if active is None else torch.where(per_client(active, new), new, old)


def stack_weights(weights: Sequence[Weights], keys: Iterable[str]) -> Weights:
    """The clients' entries ``keys`` stacked along a new first dimension (client order)."""
    # contiguous: a channels_last entry (a sequential CUDA run's checkpoint) would stack into strides vmap refuses
    return {key: torch.stack([client[key].detach() for client in weights]).contiguous() for key in keys}


def unstack_weights(stacked: Weights, index: int) -> Weights:
    """Client ``index``'s entries of a stacked state (views)."""
    return {key: value[index] for key, value in stacked.items()}


@dataclass(frozen=True)
class Hooks:
    """The functional forms of a phase's hooks (``network.algorithms.skeleton.Phase``).

    Attributes:
        extra_loss: one client's entries (parameters and buffers, by name) -> a scalar added to
            the task loss, inside ``vmap`` (FedProx's and Ditto's proximal terms).
        grad_map: the chunk's stacked gradients of the trained parameters -> the gradients the
            optimizer sees (SCAFFOLD's correction).
        post_step: the chunk's stacked entries after a step -> replaced entries (Ditto's proximal map).
        sum_grads: also return, per client, the sum over its taken steps of the optimizer's step direction
            replayed on the raw gradients alone (before ``grad_map`` and weight decay; with momentum 0 the
            raw gradients themselves): SCAFFOLD's option II.
        masks: stacked 0/1 masks ``[C, ...]`` (the parameters' dtype) of trained parameters: each client's
            step direction is multiplied by its mask after weight decay (``sparse.optim.SparseSGDM``'s rule,
            sparse_ft), so an entry outside it never moves.
    """

    extra_loss: Callable[[Weights], Tensor] | None = None
    grad_map: Callable[[Weights], Weights] | None = None
    post_step: Callable[[Weights], Weights] | None = None
    sum_grads: bool = False
    masks: Weights | None = None


@dataclass
class LockstepResult:
    """What :func:`train_lockstep` returns.

    Attributes:
        state: the chunk's stacked entries after training.
        results: each client's steps and mean task loss.
        grad_sums: with ``Hooks.sum_grads``, each trained parameter's stacked sum of replayed step directions.
    """

    state: Weights
    results: list[LocalTrainResult]
    grad_sums: Weights | None = None


class ChunkNonFiniteLoss(NonFiniteLossError):
    """A client of a chunk had a non-finite loss; ``position`` is its index in the chunk."""

    def __init__(self, message: str, position: int) -> None:
        super().__init__(message)
        self.position = position


class _Objective(nn.Module):
    """The task loss as a module, so ``functional_call`` can swap the worker's entries for one client's."""

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch: dict) -> Tensor:
        return self.loss_fn(self.model, batch)


def train_lockstep(model: nn.Module, state: Weights, train_keys: Sequence[str], loaders: Sequence[Iterable[dict]],
                   cfg: ClientConfig, budget: dict[str, int | None], hooks: Hooks = Hooks()) -> LockstepResult:
    """``local_train`` for a chunk of clients at once (see the module docstring).

    Args:
        model: the worker model (its entries outside ``state``, e.g. a frozen encoder, are used as they are).
        state: the chunk's stacked entries ``[C, ...]`` (every entry training can change).
        train_keys: the parameters this phase trains (the others in ``state`` are held fixed).
        loaders: one client's loader each, in the order of ``state``.
        cfg: lr, momentum, weight decay, loss and device (the same for every client of a round).
        budget: ``local_train``'s ``steps``/``epochs`` keywords.
        hooks: functional hooks.

    Returns:
        The stacked entries after training, each client's steps and mean loss, and the gradient sums.
    """
    count = len(loaders)
    options = SGDOptions(lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    train_keys = list(train_keys)
    # A parameter no batch reaches gets no gradient: torch's SGD then leaves it alone (no decay, no momentum), as
    # the lock-step does; a gradient hook sees zeros there instead, as SCAFFOLD's sequential hook makes them.
    gradients = _chunk_gradients(model, cfg.loss_fn, [key for key in state if key not in train_keys],
                                 hooks.extra_loss, autocast(cfg.device), zeros_for_unused=hooks.grad_map is not None)
    state = dict(state)
    momentum: dict[str, Tensor | None] = {key: torch.zeros_like(state[key]) if options.momentum else None
                                         for key in train_keys}
    started = [False] * count  # whether each client's momentum buffer exists (kept in Python: no device sync)
    step_losses: list[Tensor] = []  # [C] per lock-step call; step_active says whose counted (None: everyone's)
    step_active: list[Tensor | None] = []
    grad_sums = {key: torch.zeros_like(state[key]) for key in train_keys} if hooks.sum_grads else None
    raw_buffers = {key: torch.zeros_like(state[key]) for key in train_keys}  # momentum replayed on raw gradients
    model.train()
    iterators = [budget_batches(loader, budget["steps"], budget["epochs"]) for loader in loaders]
    while True:
        batches = [next(iterator, None) for iterator in iterators]
        if all(batch is None for batch in batches):
            break
        for members in _shape_groups(batches):
            everyone = len(members) == count
            active = None if everyone else _flags(members, count, cfg.device)
            member_set = set(members)
            stacked = _stack_batches(batches if everyone else [batches[index] if index in member_set
                                                               else batches[members[0]] for index in range(count)],
                                     cfg.device)
            constants = {key: value for key, value in state.items() if key not in momentum}
            grads, losses, buffers = gradients({key: state[key] for key in train_keys}, constants, stacked)
            stepped = [key for key in train_keys if grads[key] is not None]
            flags: Tensor | bool = started[0] if len(set(started)) == 1 else torch.tensor(started, device=cfg.device)
            if grad_sums is not None:
                _add_step_directions(grad_sums, raw_buffers, grads, stepped, flags, active, options)
            if hooks.grad_map is not None:
                grads = hooks.grad_map(grads)
            params, new_momentum = sgd_step([state[key] for key in stepped], [grads[key] for key in stepped],
                                            [momentum[key] for key in stepped], flags, options,
                                            None if hooks.masks is None else [hooks.masks.get(key) for key in stepped])
            updated = {**buffers, **dict(zip(stepped, params))}
            if hooks.post_step is not None:
                updated.update(hooks.post_step({**state, **updated}))
            for key, value in updated.items():
                state[key] = _masked(active, value, state[key])
            if options.momentum:
                for key, value in zip(stepped, new_momentum):
                    momentum[key] = _masked(active, value, momentum[key])
            started = [was or index in member_set for index, was in enumerate(started)]
            step_losses.append(losses)
            step_active.append(active)
    return LockstepResult(state, _results(step_losses, step_active, count), grad_sums)


def _flags(members: Sequence[int], count: int, device: torch.device) -> Tensor:
    """``[count]`` bools, True at ``members``."""
    flags = torch.zeros(count, dtype=torch.bool, device=device)
    flags[list(members)] = True
    return flags


def _add_step_directions(grad_sums: Weights, raw_buffers: Weights, grads: dict[str, Tensor | None],
                         keys: Sequence[str], flags: Tensor | bool, active: Tensor | None, options: SGDOptions) -> None:
    """Add the step direction replayed on the raw gradients (SCAFFOLD's option II) to ``grad_sums``, in place."""
    for key in keys:
        direction = grads[key]
        if options.momentum:
            direction, raw_buffer = momentum_step(grads[key], raw_buffers[key], flags, options)
            raw_buffers[key] = _masked(active, raw_buffer, raw_buffers[key])
        grad_sums[key] = grad_sums[key] + _masked(active, direction, torch.zeros((), dtype=direction.dtype))


def _chunk_gradients(model: nn.Module, loss_fn: LossFn, constant_keys: Sequence[str],
                     extra_loss: Callable[[Weights], Tensor] | None, mixed_precision,
                     zeros_for_unused: bool) -> Callable:
    """``(trained, constants, batch) -> (grads, losses, new buffers)`` of a chunk; a parameter the loss does not
    reach has gradient None (zeros with ``zeros_for_unused``).

    Only the forward pass is vmapped: the clients' losses are independent, so the gradient of their sum with
    respect to the stacked parameters is each client's own gradient (d(Σ_c L_c)/dθ_c = dL_c/dθ_c, every
    seed exactly 1), and one ordinary backward pass over the batched graph computes all of them. That is
    ``vmap(grad(...))``'s result without its per-call transform levels (the lock-step's largest fixed cost
    on small models).
    """
    objective = _Objective(model, loss_fn)
    param_names = set(dict(model.named_parameters()))
    buffer_keys = [key for key in constant_keys if key not in param_names]

    def one_client(trained: Weights, constants: Weights, batch: dict):
        # BatchNorm updates its running statistics in place: the clones become this client's new ones.
        buffers = {key: constants[key].clone() for key in buffer_keys}
        entries = {**constants, **trained, **buffers}
        with mixed_precision:
            loss = functional_call(objective, {_WORKER + key: value for key, value in entries.items()}, (batch,))
        total = loss if extra_loss is None else loss.float() + extra_loss(entries)
        return total, loss.detach(), buffers

    forward = vmap(one_client)

    def gradients(trained: Weights, constants: Weights, batch: dict):
        leaves = {key: value.detach().requires_grad_() for key, value in trained.items()}
        with torch.enable_grad():
            totals, losses, buffers = forward(leaves, constants, batch)
            grads = torch.autograd.grad(totals.sum(), list(leaves.values()), allow_unused=True,
                                        materialize_grads=zeros_for_unused)
        return dict(zip(leaves, grads)), losses, buffers

    return gradients


def _results(step_losses: list[Tensor], step_active: list[Tensor | None], count: int) -> list[LocalTrainResult]:
    """Each client's steps and mean loss, computed as ``local_train`` computes them (the float32 mean of its losses)."""
    if not step_losses:
        return [LocalTrainResult(steps=0, mean_loss=0.0) for _ in range(count)]
    losses = torch.stack(step_losses).float()  # [S, C]
    if all(active is None for active in step_active):  # every client took every step: one reduction per client
        counts, means = [len(step_losses)] * count, losses.t().contiguous().mean(1).tolist()
    else:
        active = torch.stack([torch.ones(count, dtype=torch.bool, device=losses.device) if flags is None else flags
                              for flags in step_active])
        counts = active.sum(0).tolist()
        means = torch.stack([losses[:, index][active[:, index]].mean() for index in range(count)]).tolist()
    results = []
    for position, (taken, mean_loss) in enumerate(zip(counts, means)):
        mean_loss = mean_loss if taken else 0.0
        if not math.isfinite(mean_loss):
            raise ChunkNonFiniteLoss(f"the local training loss is {mean_loss}", position)
        results.append(LocalTrainResult(steps=taken, mean_loss=mean_loss))
    return results


def _signature(batch: dict) -> tuple:
    """What must match for batches to be stacked: each tensor's (or tensor list's) key, shapes and dtypes."""
    parts = []
    for key, value in batch.items():
        if torch.is_tensor(value):
            parts.append((key, tuple(value.shape), value.dtype))
        elif isinstance(value, list) and value and all(torch.is_tensor(item) for item in value):
            parts.append((key, tuple((tuple(item.shape), item.dtype) for item in value)))
    return tuple(parts)


def _shape_groups(batches: Sequence[dict | None]) -> list[list[int]]:
    """Indices of the clients with a batch, grouped by batch signature (first appearance order)."""
    groups: dict[tuple, list[int]] = {}
    for index, batch in enumerate(batches):
        if batch is not None:
            groups.setdefault(_signature(batch), []).append(index)
    return list(groups.values())


def _stack_batches(batches: Sequence[dict], device: torch.device) -> dict:
    """One batch dict of ``[C, B, ...]`` tensors (and lists of them); other values (sample ids) are left out:
    they cannot be vmapped, and no loss reads them."""
    first = batches[0]
    stacked = {}
    for key, value in first.items():
        if torch.is_tensor(value):
            stacked[key] = torch.stack([batch[key] for batch in batches])
        elif isinstance(value, list) and value and all(torch.is_tensor(item) for item in value):
            stacked[key] = [torch.stack([batch[key][part] for batch in batches]) for part in range(len(value))]
    return to_device(stacked, device)


def vectorization_problem(model: nn.Module) -> str | None:
    """Why ``model`` cannot train vectorised with results equal to the sequential engine's, or None."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return (f"its module {name or 'model'} ({type(module).__name__}, p={module.p}) draws random numbers, "
                    "which vmap cannot draw as the sequential engine does")
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats and module.momentum is None:
            return (f"its BatchNorm {name} keeps a cumulative average (momentum=None), which reads its batch counter "
                    "as a Python number")
    return None


def require_vectorizable(model: nn.Module, algorithm_name: str, vectorizable: bool, supported: Sequence[str]) -> None:
    """Raise a TaskHetError naming the algorithm or the model's module when the run cannot train vectorised."""
    if not vectorizable:
        raise TaskHetError(f"--vectorize_clients: algorithm {algorithm_name} does not train vectorised "
                           f"(those that do: {', '.join(supported)}); run it without --vectorize_clients")
    problem = vectorization_problem(model)
    if problem is not None:
        raise TaskHetError(f"--vectorize_clients: the model cannot train vectorised: {problem}; run without it")
