"""FedRep (Collins et al. 2021): a shared body (representation), a personal head per client.

Client, each round:
1. Load the global weights, then this client's own head (its client state; a
   client's first round starts from the global model's head).
2. Head phase: train the head with the body frozen, for ``head_epochs`` times the
   local budget (J steps with ``--local_steps``, E epochs with ``--local_epochs``).
3. Body phase: train the body with the head frozen, for ``body_epochs`` times the
   budget (1 = exactly the budget every other algorithm gets).
   Each phase has its own optimizer over only its parameters, so momentum and
   weight decay never move a frozen part; the frozen part's buffers (BatchNorm
   statistics) are restored after the phase (``skeleton.run_phases``).
4. Upload Δ of the body entries only; keep the head as client state.

Server: FedAvg's sample-weighted mean (and server optimizer) over the body; the
global head is never updated. The split comes from the model's ``head_keys()``
(the ``TaskModel`` interface), never from reaching into its submodules.

Evaluation: a client's own model is the global body with its head. A client that
has never been sampled has no head of its own, so it has no personal model: it is
left out of the personal evaluation and counted in its ``skipped`` row.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from network.aggregation import ServerOptSettings
from network.algorithms.base import ALGORITHMS, Bundle, ClientConfig, Federation, Weights, require
from network.algorithms.skeleton import DELTA, ModelAveraging, Phase
from network.settings import check, setting

HEAD_TRAIN_LOSS = "head_train_loss"  # client metric: the head phase's mean loss


MAX_PHASE_BUDGETS = 100  # head_epochs, body_epochs: each multiplies a round's local training


@dataclass(frozen=True)
class FedRepSettings(ServerOptSettings):
    head_epochs: int = setting(1, "head phase length, in local budgets (J steps or E epochs)", high=MAX_PHASE_BUDGETS)
    body_epochs: int = setting(1, "body phase length, in local budgets", high=MAX_PHASE_BUDGETS)

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.head_epochs >= 0 and self.body_epochs >= 0 and self.head_epochs + self.body_epochs > 0,
              "head_epochs/body_epochs", ">= 0 and not both 0", (self.head_epochs, self.body_epochs))


def require_head(federation: Federation, name: str) -> frozenset[str]:
    """The model's head entries; an error if the model declares none (``head_keys()``, the TaskModel interface)."""
    require(bool(federation.layout.head_keys),
            f"{name} needs a model with head_keys() (the TaskModel interface) naming its output layer")
    return federation.layout.head_keys


@ALGORITHMS.register("fedrep")
class FedRep(ModelAveraging):
    """Alternating head/body local training; only the body is averaged."""

    name = "fedrep"
    use_when = "clients share features but not labels"
    dp_groups = (DELTA,)  # client-level DP: the shared entries' Δ, clipped and noised as DP-FedAvg's
    result_is_personal = True  # the global head is never updated: its clients' own models are the result
    vectorizable = True  # --vectorize_clients: the skeleton's phases run in lock-step
    Settings = FedRepSettings

    def __init__(self, settings: FedRepSettings, federation: Federation) -> None:
        super().__init__(settings, federation)
        self._head = require_head(federation, self.name)

    def private_keys(self) -> frozenset[str]:
        return self._head

    def phases(self, model: nn.Module, broadcast: Bundle, client_state: Weights, cfg: ClientConfig) -> list[Phase]:
        return [Phase(keys=self._head, multiple=self.settings.head_epochs, metric=HEAD_TRAIN_LOSS),
                Phase(keys=self.federation.layout.body_keys, multiple=self.settings.body_epochs)]
