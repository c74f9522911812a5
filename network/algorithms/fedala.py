"""FedALA (Zhang, Hua, Wang, Song, Xue, Ma & Guan, "FedALA: Adaptive Local Aggregation for Personalized Federated
Learning", AAAI 2023).

Before training, each client builds its start from the received global model θ and its own previous local
model θ_i by *adaptive local aggregation* (ALA), with element-wise weights W_i ∈ [0, 1] it learns and keeps.
Algorithm 1 of the paper and the authors' ALA module (github.com/TsingZ0/FedALA, ``utils/ALA.py``), as
implemented here, for a sampled client i:

1. First round of the client (no θ_i yet): start from θ (no ALA).
2. Later rounds: the lower layers take θ; each parameter of the top p layers takes
   θ̂_i = θ_i + (θ − θ_i) ⊙ W_i, with W_i = 1 (so θ̂_i = θ) the first time. W_i is learned on the local loss
   of θ̂_i over an s% sample of the client's rows, one step per batch:
   W_i ← clip(W_i − η · ∇_θ̂ L(θ̂_i) ⊙ (θ − θ_i), 0, 1), then θ̂_i is recomputed (∂θ̂/∂W = θ − θ_i).
   The first time (the *start phase*) it repeats epochs over the sample until the standard deviation of the
   last ``ala_window`` recorded losses (one per epoch: its last batch's loss, as the authors record it) is
   below ``ala_threshold``, at most ``ala_max_epochs`` epochs; in later rounds one epoch.
3. Train the whole model from θ̂_i for the local budget, as FedAvg's client; upload Δ = y_i − θ of every
   varying entry (the paper uploads the trained model y_i itself; the server's mean of Δ plus θ is the same
   model). Keep y_i as θ_i and W_i (client state, never uploaded).

Server: FedAvg's sample-weighted mean and server optimizer (η_g = 1 is the paper's server).

Choices where the paper is open, and why:

* "Top p layers": the last p *layers* (modules owning trainable parameters, frozen ones skipped), in the model's
  order with the head's layers last, so the head is always the top layer. The authors' ``layer_idx`` counts
  parameter *tensors* instead: their default 2 is their CNN's last Linear (weight and bias), i.e. p = 1 here,
  the default. A model with fewer than p layers is refused.
* The s% sample: a window of ⌊s·n_i/100⌋ consecutive rows (at least 1) of each pass of the client's loader,
  its start drawn once per round from the client's torch generator (the engine seeds it from the run seed,
  the round and the client, so runs replicate), as the authors' ``rand_idx`` window. Over a shuffling loader
  each epoch's window is a fresh random s% subset; rows are streamed, never all held in memory.
* Buffers (BatchNorm statistics) are not weights ALA mixes: they take θ's values like the lower layers (the
  authors' code leaves the client's own and never averages them, so their server statistics stay at their
  initial values).
* W-learning evaluates L(θ̂_i) in eval mode (the authors' CNN has neither dropout nor BatchNorm, so their
  mode never mattered): without dropout's noise the start phase's std test measures W converging, not the
  noise (which alone can keep the std above 0.01), BatchNorm statistics are not moved by a probe, and a cut
  edge batch of one row is valid input.
* ``ala_threshold`` 0.01 is the paper's value as the authors' README states it (``ALA.py`` defaults to 0.1);
  ``ala_window`` 10 is ``num_pre_loss``; η = 1 and s = 80 are ``main.py``'s defaults. The authors' start
  phase has no cap and "may get stuck"; ``ala_max_epochs`` caps it.
* Only sampled clients run ALA (the authors' server runs it for every client every round, sampled or not).
  η = 0 keeps W_i = 1, so every client starts from θ: FedAvg's client.
* Evaluation: a client's own model is its last trained model y_i (the paper evaluates θ̂_i, the ALA start of
  the next round, which needs the client's data; y_i is what that start refines). A never-sampled client has none.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
from torch import Tensor, nn

from network.aggregation import ServerOptSettings, Weights, subtract
from network.algorithms.base import (ALGORITHMS, GLOBAL_MODEL, Bundle, ClientConfig, ClientResult, Federation,
                                     ModelLayout, copy_state, load_weights, require)
from network.algorithms.skeleton import DELTA, ModelAveraging, Phase, run_phases
from network.settings import check, setting
from utils.device import autocast, to_device
from utils.errors import TaskHetError

ALA_WEIGHT = "ala_weight/"  # client-state prefix of W_i, by parameter name
ALA_EPOCHS = "ala_epochs"  # client metric: epochs of W-learning this round (0: no ALA)
MAX_ALA_LAYERS = 1000
MAX_ALA_EPOCHS = 10_000  # ala_max_epochs repeats passes over the client's sample


@dataclass(frozen=True)
class FedALASettings(ServerOptSettings):
    ala_layers: int = setting(1, "p: ALA mixes the top p layers (the last p modules with trainable parameters, the "
                                 "head last); lower layers take the global model", high=MAX_ALA_LAYERS)
    rand_percent: int = setting(80, "s: percent of the client's training rows the weights W are learned on")
    ala_eta: float = setting(1.0, "η: learning rate of the aggregation weights W (0: W stays 1, the FedAvg start)")
    ala_threshold: float = setting(0.01, "start phase: stop when the std of the last ala_window epoch losses is "
                                         "below this")
    ala_window: int = setting(10, "start phase: number of recent epoch losses whose std is compared (num_pre_loss)",
                              high=MAX_ALA_EPOCHS)
    ala_max_epochs: int = setting(100, "start phase: the most epochs W is learned for (the paper has no cap)",
                                  high=MAX_ALA_EPOCHS)

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.ala_layers >= 1, "ala_layers", ">= 1", self.ala_layers)
        check(1 <= self.rand_percent <= 100, "rand_percent", "in [1, 100]", self.rand_percent)
        check(self.ala_eta >= 0, "ala_eta", ">= 0", self.ala_eta)
        check(self.ala_threshold >= 0, "ala_threshold", ">= 0", self.ala_threshold)
        check(self.ala_window >= 2, "ala_window", ">= 2", self.ala_window)
        check(self.ala_max_epochs >= 1, "ala_max_epochs", ">= 1", self.ala_max_epochs)


def top_layer_keys(layout: ModelLayout, count: int) -> tuple[str, ...]:
    """The trainable parameters of the top ``count`` layers: modules owning a varying parameter, in the model's
    order with the head's layers last (the head is the top layer). Fewer than ``count`` layers: an error."""
    params = [key for key in layout.varying_keys if key in layout.param_keys]
    head = [key for key in params if key in layout.head_keys]
    ordered = [key for key in params if key not in layout.head_keys] + head
    layers = list(dict.fromkeys(_module_of(key) for key in ordered))
    require(count <= len(layers), f"fedala setting ala_layers must be at most the model's {len(layers)} layers with "
                                  f"trainable parameters, got {count}")
    top = set(layers[-count:])
    return tuple(key for key in ordered if _module_of(key) in top)


def _module_of(key: str) -> str:
    return key.rpartition(".")[0]


@ALGORITHMS.register("fedala")
class FedALA(ModelAveraging):
    """Each client starts from its old model and the global one mixed element-wise by weights it learns (ALA)."""

    name = "fedala"
    use_when = "label-skewed clients should take from the global model only what helps their own data"
    personalized = True  # its last local model (nothing of the model is private: the whole model is uploaded)
    Settings = FedALASettings

    def __init__(self, settings: FedALASettings, federation: Federation) -> None:
        super().__init__(settings, federation)
        self._top = top_layer_keys(federation.layout, settings.ala_layers)

    def client_update(self, model: nn.Module, broadcast: Bundle, client_state: Weights,
                      loader: Iterable[dict], cfg: ClientConfig) -> ClientResult:
        global_weights = broadcast[GLOBAL_MODEL]
        load_weights(model, global_weights)
        weights, epochs = {}, 0
        if client_state:  # a previous local model θ_i: ALA builds the start θ̂_i (else θ itself)
            weights, epochs = self.adaptive_local_aggregation(model, global_weights, client_state, loader, cfg)
        metrics = run_phases(model, [Phase()], loader, cfg)
        metrics[ALA_EPOCHS] = epochs
        upload = {DELTA: subtract(model.state_dict(), global_weights, self.shared_keys())}
        state = {**copy_state(model, self.federation.layout.varying_keys),
                 **{ALA_WEIGHT + key: value for key, value in weights.items()}}
        return ClientResult(upload, state, metrics, cfg.num_samples)

    def adaptive_local_aggregation(self, model: nn.Module, global_weights: Weights, client_state: Weights,
                                   loader: Iterable[dict], cfg: ClientConfig) -> tuple[Weights, int]:
        """Load θ̂_i into ``model`` (which holds θ); returns the learned W_i and the epochs it took."""
        start_phase = ALA_WEIGHT + self._top[0] not in client_state  # W_i is kept from the first ALA on
        mixed = _Mixture(model, self._top, global_weights, client_state)
        weights = {key: torch.ones_like(param) if start_phase else client_state[ALA_WEIGHT + key].to(param, copy=True)
                   for key, param in zip(self._top, mixed.params)}
        mixed.load(weights)
        if self.settings.ala_eta == 0:  # W never moves: θ̂_i is already final
            return weights, 0
        window = _sample_window(cfg.num_samples, self.settings.rand_percent)
        losses: list[float] = []
        model.eval()  # no dropout noise, no BatchNorm update (see the module docstring); local_train resets it
        while True:
            loss = None
            for batch in _window_batches(loader, *window):
                loss = self._weight_step(model, mixed, weights, to_device(batch, cfg.device), cfg)
            require(loss is not None, "fedala: the client's loader yielded none of the rows of its s% sample")
            losses.append(float(loss))
            if not start_phase or self._converged(losses) or len(losses) >= self.settings.ala_max_epochs:
                break
        return weights, len(losses)

    def _weight_step(self, model: nn.Module, mixed: "_Mixture", weights: Weights, batch: dict,
                     cfg: ClientConfig) -> Tensor:
        """One W step on one batch: W ← clip(W − η·∇_θ̂ L ⊙ (θ − θ_i), 0, 1), then θ̂ from the new W."""
        with autocast(cfg.device):
            loss = cfg.loss_fn(model, batch)
        grads = torch.autograd.grad(loss, mixed.params, allow_unused=True, materialize_grads=True)
        for key, grad in zip(self._top, grads):
            weights[key] = (weights[key] - self.settings.ala_eta * grad * mixed.gap[key]).clamp_(0, 1)
        mixed.load(weights)
        return loss.detach()

    def _converged(self, losses: list[float]) -> bool:
        window = self.settings.ala_window
        return len(losses) > window and statistics.pstdev(losses[-window:]) < self.settings.ala_threshold

    def personal_model(self, models: dict[str, Weights], client_state: Weights) -> Weights | None:
        own = {key: value for key, value in client_state.items() if not key.startswith(ALA_WEIGHT)}
        return {**models[GLOBAL_MODEL], **own} if own else None


class _Mixture:
    """The top layers' parameters θ̂ = θ_i + (θ − θ_i) ⊙ W of one client, written into the model."""

    def __init__(self, model: nn.Module, keys: tuple[str, ...], global_weights: Weights, local: Weights) -> None:
        named = dict(model.named_parameters())
        self.params = [named[key] for key in keys]
        # A client state may rest on the CPU (the engine's store) while the model trains on an accelerator.
        self.local = [local[key].to(param) for key, param in zip(keys, self.params)]
        self.gap = {key: global_weights[key].to(param) - own
                    for key, param, own in zip(keys, self.params, self.local)}  # θ − θ_i, also ∂θ̂/∂W
        self.keys = keys

    def load(self, weights: Weights) -> None:
        with torch.no_grad():
            for param, local, key in zip(self.params, self.local, self.keys):
                param.copy_(local + self.gap[key] * weights[key])


def _sample_window(num_samples: int, percent: int) -> tuple[int, int]:
    """(start, count): ⌊s·n/100⌋ consecutive rows (at least 1), the start uniform in [0, n − count] from the
    client's seeded torch generator (no draw when the window is every row)."""
    count = max(1, num_samples * percent // 100)
    spare = max(num_samples - count, 0)
    start = int(torch.randint(spare + 1, ())) if spare else 0
    return start, count


def _window_batches(loader: Iterable[dict], start: int, count: int) -> Iterator[dict]:
    """The rows [start, start + count) of one pass of ``loader``, in its batches (the edge batches cut)."""
    end, offset = start + count, 0
    for batch in loader:
        rows = _rows(batch)
        low, high = max(start, offset), min(end, offset + rows)
        if low < high:
            whole = low == offset and high == offset + rows
            yield batch if whole else {key: _cut(value, low - offset, high - offset) for key, value in batch.items()}
        offset += rows
        if offset >= end:
            return


def _rows(batch: dict) -> int:
    """A batch's number of samples: the first dimension of its first tensor (or first tensor of a list)."""
    for value in batch.values():
        if torch.is_tensor(value):
            return int(value.shape[0])
        if isinstance(value, (list, tuple)) and value and torch.is_tensor(value[0]):
            return int(value[0].shape[0])
    raise TaskHetError(f"a batch with keys {sorted(batch)} has no tensor to count its samples by")


def _cut(value: Any, low: int, high: int) -> Any:
    """Rows [low, high) of a batch value: a tensor, a list of tensors (one per scale) or a list of ids."""
    if torch.is_tensor(value):
        return value[low:high]
    if isinstance(value, (list, tuple)) and value and all(torch.is_tensor(item) for item in value):
        return [item[low:high] for item in value]
    return value[low:high] if isinstance(value, (list, tuple)) else value
