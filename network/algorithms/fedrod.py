"""FedRoD (Chen & Chao, "On Bridging Generic and Personalized Federated Learning for Image Classification", ICLR 2022).

The output layer becomes two heads on one backbone: a generic head g, shared, and a personal
head p_k per client (``network.algorithms.multihead``).

Local step (one phase, the local budget), from one backbone pass z = backbone(x):
* generic loss, the balanced softmax CE(g(z) + γ·log n^{(k)}, y): n^{(k)}_c is the client's own
  number of training samples of class c (``ClientConfig.class_counts``); it trains the backbone and
  g. A class the client has no sample of gets log 0 = −∞ (prior 0; with γ = 0 the adjustment is 0);
* personal loss CE(g(z).detach() + p_k(z.detach()), y): trains p_k only (no gradient reaches g or
  the backbone).
The reported ``train_loss`` is the sum of the two. Uploads: Δ of the backbone and g; p_k is a
private entry (client state) and never leaves the client.

Models: the global model is body + g (the server's p is all zeros and is never updated, so the
served logits g(z) + p(z) are g(z)); client k's model is body + g + p_k. A client's p_k starts at
zero in its first round.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import Tensor, nn

from network.aggregation import ServerOptSettings
from network.algorithms.base import ALGORITHMS, GLOBAL_MODEL, ClientConfig, ClientResult, Weights, require
from network.algorithms.multihead import HEAD_MODULE, MultiHead, classifier_head, copy_linear, multi_head_loss
from network.algorithms.skeleton import ModelAveraging
from network.settings import check, setting

HEADS = ("generic", "personal")
PERSONAL_KEYS = frozenset({f"{HEAD_MODULE}.personal.weight", f"{HEAD_MODULE}.personal.bias"})


@dataclass(frozen=True)
class FedRoDSettings(ServerOptSettings):
    gamma: float = setting(1.0, "γ of the generic head's balanced softmax CE(g(z) + γ·log n_c, y)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.gamma >= 0 and math.isfinite(self.gamma), "gamma", ">= 0", self.gamma)


def log_prior(class_counts: Iterable[int], gamma: float, dtype: torch.dtype = torch.float32) -> Tensor:
    """γ·log n_c per class (−∞ where n_c = 0 and γ > 0; all zeros when γ = 0), computed in ``dtype``.

    Build it in the logits' dtype: a float32 prior cast up to float64 logits is off the equation by ~6e-8.
    """
    counts = torch.tensor(list(class_counts), dtype=dtype)
    if gamma == 0:
        return torch.zeros_like(counts)
    return gamma * torch.log(counts)


class FedRoDHead(MultiHead):
    """The generic head g and the personal head p; serves g(z) + p(z)."""

    def __init__(self, head: nn.Linear) -> None:
        super().__init__()
        self.generic = copy_linear(head)
        self.personal = copy_linear(head)
        nn.init.zeros_(self.personal.weight)
        nn.init.zeros_(self.personal.bias)
        self.adjustment: Tensor | None = None  # γ·log n of the client in training (set per client update)

    def collect_logits(self, features: Tensor) -> dict[str, Tensor]:
        generic = self.generic(features)
        return {"generic": generic + self.adjustment.to(generic),
                "personal": generic.detach() + self.personal(features.detach())}

    def served_logits(self, features: Tensor) -> Tensor:
        return self.generic(features) + self.personal(features)


@ALGORITHMS.register("fedrod")
class FedRoD(ModelAveraging):
    """A generic head trained with the balanced softmax and a personal head on detached features."""

    name = "fedrod"
    use_when = "a long-tailed global class distribution, with a generic and a personal head"
    Settings = FedRoDSettings
    personalized = True
    needs_classifier = True

    @classmethod
    def worker_model(cls, model: nn.Module, settings: FedRoDSettings) -> nn.Module:
        setattr(model, HEAD_MODULE, FedRoDHead(classifier_head(model, cls.name)))
        return model

    def private_keys(self) -> frozenset[str]:
        return PERSONAL_KEYS

    def client_update(self, model: nn.Module, broadcast, client_state: Weights, loader: Iterable[dict],
                      cfg: ClientConfig) -> ClientResult:
        head = getattr(model, HEAD_MODULE)
        require(cfg.class_counts is not None and len(cfg.class_counts) == head.generic.out_features,
                f"{self.name} needs each client's training class counts over {head.generic.out_features} classes "
                "(a classification task's data), got " + ("none" if cfg.class_counts is None
                                                          else f"{len(cfg.class_counts)} classes"))
        # The generic logits come out in the generic head's dtype (autocast may lower them; collect_logits casts).
        head.adjustment = log_prior(cfg.class_counts, self.settings.gamma, head.generic.weight.dtype).to(cfg.device)
        try:
            loss = multi_head_loss(cfg.loss_fn, model, head, HEADS)
            return super().client_update(model, broadcast, client_state, loader, dataclasses.replace(cfg, loss_fn=loss))
        finally:
            head.adjustment = None

    def personal_model(self, models: dict[str, Weights], client_state: Weights) -> Weights | None:
        return {**models[GLOBAL_MODEL], **client_state} if client_state else None
