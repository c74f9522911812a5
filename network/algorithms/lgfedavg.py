"""LG-FedAvg (Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov & Morency, "Think Locally, Act Globally:
Federated Learning with Local and Global Representations", arXiv:2001.01523, 2020; NeurIPS 2019 Workshop on
Federated Learning).

Each client m keeps a *local* representation θ^l_m (every entry outside the model's head: its body) and all
clients share a *global* model θ^g on top of it (the head): the mirror image of FedPer, which shares the body
and keeps the head. Algorithm 1 of the paper, as implemented here, round t:

* Client m (sampled): load (θ^l_m, θ^g_t), θ^l_m being the global body θ^l_0 in its first round; train both
  jointly on its data for the local budget, (θ^l_m, θ^g_m) ← SGD on f_m(θ^l_m, θ^g); upload
  Δ_m = θ^g_m − θ^g_t of the head only; keep θ^l_m (client state, never uploaded).
* Server: θ^g_{t+1} = θ^g_t + η_g · Σ_m w_m Δ_m / Σ_m w_m over the round's uploads, with w_m = n_m (the
  ``weighting`` setting; η_g = 1 gives the paper's average of the heads); FedAvg's server optimizer.
  The global body never changes: it is only every client's starting body.

Choices where the paper is open:

* Split: the head is the model's ``head_keys()`` (the TaskModel interface); the body is every other entry.
  A model without a head, or without trainable entries on both sides, is refused (that is FedAvg or local
  training, not LG-FedAvg).
* BatchNorm statistics of the body are part of the local representation, so they stay private with it (a
  representation is its weights and its normalisation); a head's buffers are averaged as in FedAvg.
* A frozen part of the body (``ModelLayout.fixed_keys``: a pretrained encoder) is neither private nor
  uploaded: every client reads it from the global model, which keeps it at its initial value.
* Weights: the paper's server weighs each head by n_m/n; the authors' code (pliang279/LG-FedAvg) divides the
  sum by the number of sampled clients, which is ``weighting uniform`` here.
* The paper's auxiliary local objectives (reconstruction, adversarial fair representations) are left out: the
  local body trains on the task loss through the global head, the paper's supervised LG-FedAvg.
* The paper starts the local models from a FedAvg-trained model; here they start from the run's initial
  model (pass a pretrained one as the initial model to reproduce that).
* Result: the global body is never trained, so the global model measures nothing; the clients' own
  models (own body + global head) are the result (``result_is_personal``). A never-sampled client has
  no local representation, hence no personal model (skipped).
"""

from __future__ import annotations

from network.aggregation import ServerOptSettings
from network.algorithms.base import ALGORITHMS, Federation, require
from network.algorithms.fedrep import require_head
from network.algorithms.skeleton import ModelAveraging


@ALGORITHMS.register("lgfedavg")
class LGFedAvg(ModelAveraging):
    """Local representations, global head: joint local training, only the head is averaged."""

    name = "lgfedavg"
    use_when = "clients' inputs differ (feature skew) while one output rule fits them all"
    # The global body is never trained: the clients' own bodies with the global head are the result.
    result_is_personal = True
    vectorizable = True  # --vectorize_clients: the skeleton's single phase runs in lock-step
    Settings = ServerOptSettings

    def __init__(self, settings: ServerOptSettings, federation: Federation) -> None:
        super().__init__(settings, federation)
        head = require_head(federation, self.name)
        layout = federation.layout
        # The local representation: the body's varying entries (BatchNorm statistics included); a frozen encoder
        # is read from the global model by every client, so it is neither kept per client nor uploaded.
        self._body = frozenset(key for key in layout.body_keys if key not in layout.fixed_keys)
        trainable = layout.param_keys - layout.fixed_keys
        require(bool(self._body & trainable) and bool(head & trainable),
                f"{self.name} needs a model with trainable entries both outside and inside head_keys() (a local "
                "body and a global head); without them it is FedAvg or local training")

    def private_keys(self) -> frozenset[str]:
        return self._body
