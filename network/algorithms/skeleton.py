"""The shared client skeleton: methods compose *phases* instead of subclassing FedAvg.

A :class:`Phase` says which parameters train, for how many local budgets, with which
extra loss term, gradient hook or post-step map; :func:`run_phases` runs a list of
them through the one local loop (``network.local_train``). Everything not trained in
a phase is frozen: its parameters take no gradient (so neither momentum nor weight
decay moves them) and its buffers (BatchNorm statistics) are restored afterwards.

:class:`ModelAveraging` is the skeleton of every algorithm with one global model
averaged over its shared entries while private entries stay on the clients: FedAvg
(no private entries), FedProx (an extra loss), FedPer (private head), FedRep (private
head, two phases), FedBN (private BatchNorm), Ditto (an extra personal model). A
subclass chooses ``phases`` and ``private_keys``; the halves below do the rest.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, ClassVar, Collection, Iterable, Iterator, Sequence

import torch
from torch import Tensor, nn

from network.aggregation import (ServerOptSettings, Weights, WeightedMean, federation_shares, init_server_optimizer,
                                 server_step, subtract, upload_weight)
from network.algorithms.base import (GLOBAL_MODEL, LOCAL_STEPS, TRAIN_LOSS, Algorithm, Bundle, ClientConfig,
                                     ClientResult, ServerState, Upload, copy_state, load_weights, make_optimizer,
                                     require, trainable)
from network.local_train import local_train
from network.vectorized import Hooks, stack_weights, train_lockstep, unstack_weights
from utils.errors import TaskHetError
from utils.device import to_device

DELTA = "delta"  # upload group: the client's change y − x of the shared entries


@dataclass(frozen=True)
class Phase:
    """One stretch of local training.

    Attributes:
        keys: state-dict entries trained in this phase (None: every trainable parameter);
            every other entry is frozen for the phase.
        multiple: length in local budgets (J steps or E epochs each).
        extra_loss: ``extra_loss(model) -> scalar`` added to the task loss (FedProx, Ditto).
        grad_hook: called after ``backward``, before ``optimizer.step`` (SCAFFOLD).
        post_step: called after every ``optimizer.step`` (a proximal map).
        metric: the metric name of this phase's mean task loss.
    """

    keys: Collection[str] | None = None
    multiple: int = 1
    extra_loss: Callable[[nn.Module], Tensor] | None = None
    grad_hook: Callable[[nn.Module], None] | None = None
    post_step: Callable[[nn.Module], None] | None = None
    metric: str = TRAIN_LOSS


def run_phases(model: nn.Module, phases: Iterable[Phase], loader: Iterable[dict], cfg: ClientConfig) -> dict[str, float]:
    """Run ``phases`` in order on ``model``; returns each phase's mean loss (by metric) and the total steps."""
    metrics: dict[str, float] = {LOCAL_STEPS: 0}
    for phase in phases:
        if phase.multiple == 0:
            continue
        frozen_keys = [] if phase.keys is None else [key for key in model.state_dict() if key not in set(phase.keys)]
        with frozen(model, frozen_keys):
            optimizer = make_optimizer(trainable(model, phase.keys).values(), cfg)
            result = local_train(model, loader, cfg.loss_fn, optimizer, cfg.device, **cfg.budget(phase.multiple),
                                 extra_loss=phase.extra_loss, grad_hook=phase.grad_hook, post_step=phase.post_step)
        metrics[phase.metric] = result.mean_loss
        metrics[LOCAL_STEPS] += result.steps
    return metrics


@contextlib.contextmanager
def frozen(model: nn.Module, keys: Iterable[str]) -> Iterator[None]:
    """Within the block, the named parameters take no gradient and the named buffers are restored on exit."""
    keys = set(keys)
    params = [param for name, param in model.named_parameters() if name in keys and param.requires_grad]
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers() if name in keys}
    for param in params:
        param.requires_grad_(False)
    try:
        yield
    finally:
        for param in params:
            param.requires_grad_(True)
        load_weights(model, buffers)


def proximal_term(model: nn.Module, anchor: Weights, mu: float) -> "ProximalTerm":
    """``(μ/2)·‖w − anchor‖²`` over the model's trainable parameters (gradient μ·(w − anchor)); anchor held fixed."""
    return ProximalTerm(model, anchor, mu)


class ProximalTerm:
    """An ``extra_loss`` hook: ``(μ/2)·‖w − anchor‖²`` over the model's trainable parameters at construction.

    ``functional(entries)`` is the same term of one client's entries by name (vectorised clients).
    """

    def __init__(self, model: nn.Module, anchor: Weights, mu: float) -> None:
        params = trainable(model)
        self.names = list(params)
        self.anchors = [anchor[name].detach() for name in self.names]
        self.weights = list(params.values())
        self.half_mu = mu / 2

    def __call__(self, _: nn.Module) -> Tensor:
        squared = torch._foreach_pow(torch._foreach_sub(self.weights, self.anchors), 2)
        return self.half_mu * sum(part.sum() for part in squared)

    def functional(self, entries: Weights) -> Tensor:
        # Plain ops, not _foreach: these run inside vmap.
        squared = [(entries[name] - anchor).pow(2) for name, anchor in zip(self.names, self.anchors)]
        return self.half_mu * sum(part.sum() for part in squared)


def run_phases_lockstep(model: nn.Module, starts: list[Weights], phases: list[Phase], loaders: list[Iterable[dict]],
                        cfg: ClientConfig, keys: Sequence[str]) -> tuple[list[Weights], list[dict[str, float]]]:
    """:func:`run_phases` for a chunk of clients in lock-step (``network.vectorized``), each from its own start.

    Args:
        starts: each client's weights before the phases (at least ``keys``).
        phases: the phases (the same for every client); each hook needs its ``functional`` form.
        loaders: each client's loader.
        cfg: the round's client config (lr, momentum, weight decay, budget; ``num_samples`` is not read).
        keys: the entries training can change (the layout's varying keys): they are stacked; the
            model's own values serve for every other entry (a frozen encoder).

    Returns:
        Each client's entries ``keys`` after the phases, and its metrics (as :func:`run_phases`).
    """
    state, metrics = run_phases_stacked(model, starts, phases, loaders, cfg, keys)
    return [unstack_weights(state, index) for index in range(len(starts))], metrics


def run_phases_stacked(model: nn.Module, starts: list[Weights], phases: list[Phase], loaders: list[Iterable[dict]],
                       cfg: ClientConfig, keys: Sequence[str]) -> tuple[Weights, list[dict[str, float]]]:
    """:func:`run_phases_lockstep` returning the chunk's entries still stacked (``[C, ...]`` per key)."""
    state = stack_weights(starts, keys)
    metrics: list[dict[str, float]] = [{LOCAL_STEPS: 0} for _ in starts]
    params = dict(model.named_parameters())
    for phase in phases:
        if phase.multiple == 0:
            continue
        train_keys = [key for key in trainable(model, phase.keys) if key in state]
        phase_keys = set(state) if phase.keys is None else set(phase.keys)
        kept = {key: value for key, value in state.items() if key not in phase_keys and key not in params}
        result = train_lockstep(model, state, train_keys, loaders, cfg, cfg.budget(phase.multiple), _hooks(phase))
        state = {**result.state, **kept}  # frozen buffers restored, as ``frozen`` does
        for client, outcome in zip(metrics, result.results):
            client[phase.metric] = outcome.mean_loss
            client[LOCAL_STEPS] += outcome.steps
    return state, metrics


def _hooks(phase: Phase) -> Hooks:
    return Hooks(extra_loss=_functional(phase.extra_loss, "extra loss"),
                 grad_map=_functional(phase.grad_hook, "gradient hook"),
                 post_step=_functional(phase.post_step, "post-step map"))


def _functional(hook: Callable | None, what: str) -> Callable | None:
    if hook is None:
        return None
    functional = getattr(hook, "functional", None)
    if functional is None:
        raise TaskHetError(f"a phase's {what} ({hook!r}) has no functional form (.functional): it cannot train "
                           "vectorised; run without --vectorize_clients")
    return functional


def _outline(phases: list[Phase]) -> list[tuple]:
    """What must agree between clients for their phases to run in lock-step."""
    return [(None if phase.keys is None else tuple(phase.keys), phase.multiple, phase.metric, phase.extra_loss is None,
             phase.grad_hook is None, phase.post_step is None) for phase in phases]


class ModelAveraging(Algorithm):
    """One global model; clients train it in ``phases`` and upload Δ of its shared entries; the server averages.

    Client: load the global model, then the client's private entries (from its state,
    once it has trained); run ``phases``; upload Δ = y − x of every shared entry; keep
    the private entries as the client state. Server: the mean of the Δs weighted by
    the clients' shares (``weighting``: samples, uniform, capped, or the private bucketed and noisy
    sizes; see :func:`network.aggregation.client_weights`), applied by the server optimizer
    (parameters) or as the plain mean (buffers): :func:`network.aggregation.server_step`.
    Private entries of the global model are never updated.
    """

    Settings: ClassVar[type] = ServerOptSettings

    def __init__(self, settings: ServerOptSettings, federation) -> None:
        super().__init__(settings, federation)
        # Fixed for the run, and checked here so an infeasible cap stops the run before it starts.
        self.shares = federation_shares(settings, federation.client_sizes, federation.seed)

    def phases(self, model: nn.Module, broadcast: Bundle, client_state: Weights, cfg: ClientConfig) -> list[Phase]:
        """The local training of one round (one phase over every parameter by default)."""
        return [Phase()]

    @property
    def personalized(self) -> bool:  # type: ignore[override]
        return bool(self.private_keys())

    @functools.cached_property
    def _shared(self) -> tuple[str, ...]:
        # Derived once from the fixed layout: it is read for every client of every round.
        private = self.private_keys()
        return tuple(key for key in self.federation.layout.varying_keys if key not in private)

    def shared_keys(self) -> tuple[str, ...]:
        """The entries every client uploads Δ of (all but the private and the fixed ones), in the model's order."""
        return self._shared

    def init_server(self, weights: Weights) -> ServerState:
        return ServerState({GLOBAL_MODEL: weights},
                           init_server_optimizer(self.settings, weights, self._averaged_params))

    def client_update(self, model: nn.Module, broadcast: Bundle, client_state: Weights,
                      loader: Iterable[dict], cfg: ClientConfig) -> ClientResult:
        global_weights = broadcast[GLOBAL_MODEL]
        load_weights(model, global_weights)
        load_weights(model, self.own_entries(client_state))
        metrics = run_phases(model, self.phases(model, broadcast, client_state, cfg), loader, cfg)
        upload = {DELTA: subtract(model.state_dict(), global_weights, self.shared_keys())}
        return ClientResult(upload, self.next_client_state(model, client_state), metrics, cfg.num_samples)

    def client_updates(self, model: nn.Module, broadcast: Bundle, client_states: list[Weights],
                       loaders: list[Iterable[dict]], cfgs: list[ClientConfig]) -> list[ClientResult]:
        """``client_update`` of a chunk of clients in lock-step: the same phases, uploads and client states."""
        global_weights = broadcast[GLOBAL_MODEL]
        load_weights(model, global_weights)  # the entries that are not stacked (a frozen encoder) come from the model
        phases = self.phases(model, broadcast, client_states[0], cfgs[0])
        require(all(_outline(self.phases(model, broadcast, state, cfg)) == _outline(phases)
                    for state, cfg in zip(client_states[1:], cfgs[1:])),
                f"{self.name}: clients of one round have different phases, so they cannot train in lock-step")
        starts = [{**global_weights, **self.own_entries(state)} for state in client_states]
        final, metrics = run_phases_stacked(model, starts, phases, loaders, cfgs[0], self.federation.layout.varying_keys)
        # Δ of the whole chunk at once (elementwise, so each client's slice is its own subtract's bits), as views.
        deltas = subtract(final, global_weights, self.shared_keys())
        keeps_entries = bool(self.private_keys()) or type(self).next_client_state is not ModelAveraging.next_client_state
        results = []
        for index, (state, cfg, client_metrics) in enumerate(zip(client_states, cfgs, metrics)):
            if keeps_entries:  # the client state comes from the very code client_update runs
                load_weights(model, unstack_weights(final, index))
            upload = {DELTA: {key: value[index] for key, value in deltas.items()}}
            next_state = self.next_client_state(model, state) if keeps_entries else {}
            results.append(ClientResult(upload, next_state, client_metrics, cfg.num_samples))
        return results

    def own_entries(self, client_state: Weights) -> Weights:
        """The entries of the client state loaded over the global model before training (its private entries)."""
        return client_state

    def next_client_state(self, model: nn.Module, client_state: Weights) -> Weights:
        """What the client keeps after training (its private entries)."""
        return copy_state(model, sorted(self.private_keys()))

    def aggregate(self, server: ServerState, uploads: Iterable[Upload]) -> ServerState:
        mean = WeightedMean()
        for upload in uploads:
            mean.add(upload.tensors[DELTA], self.upload_weight(upload))
        weights, tensors = server_step(server.models[GLOBAL_MODEL], mean.mean(), server.tensors, self.settings,
                                       self._averaged_params)
        return ServerState({GLOBAL_MODEL: weights}, tensors)

    def upload_weight(self, upload: Upload) -> float:
        """The upload's weight in the server mean: its sample count (samples) or its client's share."""
        return upload_weight(self.settings.weighting, self.shares, upload.client_id, upload.num_samples)

    def personal_model(self, models: dict[str, Weights], client_state: Weights) -> Weights | None:
        own = self.own_entries(client_state)
        return {**models[GLOBAL_MODEL], **own} if own else None

    @functools.cached_property
    def _averaged_params(self) -> tuple[str, ...]:
        params = self.federation.layout.param_keys
        return tuple(key for key in self.shared_keys() if key in params)


def training_loss(model: nn.Module, loader: Iterable[dict], cfg: ClientConfig) -> float:
    """F_i(θ): the model's mean per-sample loss over one pass of ``loader`` (eval mode, no gradient; IFCA, q-FedAvg)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in loader:
            per_sample = cfg.loss_fn(model, to_device(batch, cfg.device), reduction="none")
            total += float(per_sample.double().sum())
            count += per_sample.numel()
    model.train(was_training)
    return total / max(count, 1)
