"""FedBABU (Oh et al., "FedBABU: Toward Enhanced Representation for Federated Image Classification", ICLR 2022).

The head (the model's ``head_keys()``) keeps its random initialisation for all of federated
training; only the body trains and only the body is aggregated.

Client: load the global model; train the body for the local budget with the head frozen; upload
Δ of the body. Server: FedAvg's sample-weighted mean (and server optimizer) over the body; the
global head is never updated.

The head is frozen by leaving it out of the optimizer (``requires_grad`` off for the phase,
``skeleton.run_phases``), not by zeroing its gradient as FL-bench does: with weight decay (and the
momentum it feeds) an optimizer that holds the head moves it even at zero gradient. So the head
stays bit-identical whatever the momentum and weight decay.

Evaluation: FedBABU's personalisation is fine-tuning the whole model (head included) on each
client's training rows, which is ``--finetune_steps`` (``client_test_finetuned`` rows) for every
algorithm; run FedBABU with ``--finetune_steps > 0``.
"""

from __future__ import annotations

import functools

from torch import nn

from network.aggregation import ServerOptSettings
from network.algorithms.base import ALGORITHMS, Bundle, ClientConfig, Federation, Weights
from network.algorithms.fedrep import require_head
from network.algorithms.multihead import classifier_head
from network.algorithms.skeleton import DELTA, ModelAveraging, Phase


@ALGORITHMS.register("fedbabu")
class FedBABU(ModelAveraging):
    """Body-only training and averaging under a fixed random head; personalised by fine-tuning at evaluation."""

    name = "fedbabu"
    personalised_by_finetuning = True  # --finetune_steps gives its personal models
    use_when = "a long-tailed or label-skewed federation: a frozen random head, the body averaged"
    dp_groups = (DELTA,)  # client-level DP: the shared entries' Δ, clipped and noised as DP-FedAvg's
    Settings = ServerOptSettings

    @classmethod
    def worker_model(cls, model: nn.Module, settings: ServerOptSettings) -> nn.Module:
        task = getattr(model, "task", None)
        if task is not None:  # a TaskModel: a classifier only (a model without a task, e.g. a test network, is taken as is)
            classifier_head(model, cls.name)
        return model

    def __init__(self, settings: ServerOptSettings, federation: Federation) -> None:
        super().__init__(settings, federation)
        self._head = require_head(federation, self.name)

    @functools.cached_property
    def _body(self) -> tuple[str, ...]:
        return tuple(key for key in super().shared_keys() if key not in self._head)

    def shared_keys(self) -> tuple[str, ...]:
        return self._body

    def phases(self, model: nn.Module, broadcast: Bundle, client_state: Weights, cfg: ClientConfig) -> list[Phase]:
        return [Phase(keys=self.federation.layout.body_keys)]
