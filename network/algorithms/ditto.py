"""Ditto (Li et al. 2021, "Ditto: Fair and Robust Federated Learning Through Personalization").

Each client keeps a personal model v_i next to the global model w.

Client, each round (Algorithm 1 of the paper, with FedAvg as the global solver):
1. Global part: from the broadcast w^t, train a copy for the local budget exactly as
   FedAvg does; upload its change Δ (all entries).
2. Personal part: from its own v_i (w^t in its first round), train for the same budget
   on min_v F_i(v) + (λ/2)·‖v − w^t‖², w^t held fixed. ``prox_step`` chooses how the
   proximal term enters a step:
   * ``explicit`` (the paper): v ← v − η(∇F_i(v) + λ(v − w^t)) (stable for η·λ < 2);
   * ``implicit``: a proximal-gradient step, v ← (v − η∇F_i(v) + ηλ·w^t)/(1 + ηλ),
     equal to the explicit step to first order in ηλ and stable for every λ, so
     λ → ∞ gives v = w^t exactly and λ = 0 plain local training.
   Keep v_i (client state). The personal part costs a second local budget: the metric
   ``local_steps`` counts both parts, ``personal_train_loss`` is the personal part's loss.

Server: FedAvg's sample-weighted mean (and server optimizer). Evaluation: a client's
own model is v_i; a never-sampled client has none (left out, counted as skipped).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

from network.aggregation import ServerOptSettings
from network.algorithms.base import (ALGORITHMS, GLOBAL_MODEL, LOCAL_STEPS, Bundle, ClientConfig, ClientResult,
                                     Weights, copy_state, load_weights, trainable)
from network.algorithms.skeleton import DELTA, ModelAveraging, Phase, proximal_term, run_phases, run_phases_lockstep
from network.settings import check, setting

PERSONAL_TRAIN_LOSS = "personal_train_loss"  # client metric: the personal part's mean task loss
PROX_STEPS = ("explicit", "implicit")


@dataclass(frozen=True)
class DittoSettings(ServerOptSettings):
    lam: float = setting(0.1, "λ of the personal objective F_i(v) + (λ/2)·‖v − w‖²")
    prox_step: str = setting("explicit", "how λ enters a personal step: explicit (paper) or implicit (proximal map)",
                             choices=PROX_STEPS)

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.lam >= 0, "lam", ">= 0", self.lam)
        check(self.prox_step in PROX_STEPS, "prox_step", f"one of {', '.join(PROX_STEPS)}", self.prox_step)


@ALGORITHMS.register("ditto")
class Ditto(ModelAveraging):
    """FedAvg for w plus a proximally regularised personal model v_i per client."""

    name = "ditto"
    use_when = "personal models that stay near a fair global one"
    dp_groups = (DELTA,)  # client-level DP: the shared entries' Δ, clipped and noised as DP-FedAvg's
    Settings = DittoSettings
    personalized = True
    vectorizable = True  # --vectorize_clients: both parts run in lock-step (client_updates below)

    def client_update(self, model: nn.Module, broadcast: Bundle, client_state: Weights,
                      loader: Iterable[dict], cfg: ClientConfig) -> ClientResult:
        result = super().client_update(model, broadcast, {}, loader, cfg)  # the global part, from w^t
        anchor = broadcast[GLOBAL_MODEL]
        load_weights(model, client_state or anchor)
        personal = run_phases(model, [self.personal_phase(model, anchor, cfg.lr)], loader, cfg)
        result.metrics[PERSONAL_TRAIN_LOSS] = personal[PERSONAL_TRAIN_LOSS]
        result.metrics[LOCAL_STEPS] += personal[LOCAL_STEPS]
        result.client_state = copy_state(model)
        return result

    def client_updates(self, model: nn.Module, broadcast: Bundle, client_states: list[Weights],
                       loaders: list[Iterable[dict]], cfgs: list[ClientConfig]) -> list[ClientResult]:
        results = super().client_updates(model, broadcast, [{} for _ in client_states], loaders, cfgs)
        anchor = broadcast[GLOBAL_MODEL]
        finals, personal = run_phases_lockstep(model, [state or anchor for state in client_states],
                                               [self.personal_phase(model, anchor, cfgs[0].lr)], loaders, cfgs[0],
                                               self.federation.layout.varying_keys)
        for result, final, metrics in zip(results, finals, personal):
            result.metrics[PERSONAL_TRAIN_LOSS] = metrics[PERSONAL_TRAIN_LOSS]
            result.metrics[LOCAL_STEPS] += metrics[LOCAL_STEPS]
            load_weights(model, final)
            result.client_state = copy_state(model)
        return results

    def personal_phase(self, model: nn.Module, anchor: Weights, lr: float) -> Phase:
        lam = self.settings.lam
        if self.settings.prox_step == "explicit":
            return Phase(extra_loss=proximal_term(model, anchor, lam) if lam else None, metric=PERSONAL_TRAIN_LOSS)
        return Phase(post_step=proximal_map(model, anchor, lr * lam), metric=PERSONAL_TRAIN_LOSS)

    def next_client_state(self, model: nn.Module, client_state: Weights) -> Weights:
        return {}  # the global part keeps nothing: v_i is set after the personal part

    def personal_model(self, models: dict[str, Weights], client_state: Weights) -> Weights | None:
        return dict(client_state) if client_state else None


def proximal_map(model: nn.Module, anchor: Weights, strength: float) -> Callable[[nn.Module], None]:
    """v ← (v + s·anchor)/(1 + s) for every trainable parameter: the prox of (s/2)·‖v − anchor‖² after an SGD step."""
    params = trainable(model)
    targets = list(params.values())
    anchors = [anchor[name].detach() for name in params]

    def apply(_: nn.Module) -> None:
        with torch.no_grad():
            torch._foreach_add_(targets, anchors, alpha=strength)
            torch._foreach_div_(targets, 1.0 + strength)

    def functional(entries: Weights) -> Weights:  # stacked entries of a chunk (vectorised clients)
        return {name: entries[name].add(anchor, alpha=strength).div(1.0 + strength)
                for name, anchor in zip(params, anchors)}

    apply.functional = functional  # type: ignore[attr-defined]
    return apply
