"""Sparse fine-tuning (TaLoS, Iurada et al., ICLR 2025) in FL: clients train a fixed, calibrated subset of entries.

Client: load the global model; take the mask (see ``mask_source``); train with
:class:`sparse.optim.SparseSGDM` (the round's lr, momentum and weight decay) so an entry
outside the mask never moves, through gradient, momentum or weight decay; non-maskable
parameters (the head: ``head_keys()`` and ``sparse.calibration.default_maskable``) take
no gradient and buffers (BatchNorm statistics) are restored, so the update is exactly
sparse (a task vector supported on the mask). Upload Δ of the maskable parameters (0
at frozen entries) and the mask.

Masks, ``mask_source``:
* ``client``: each client calibrates its own mask on its first ``calibration_batches``
  training batches at its first participation (at that round's global weights) and
  keeps it (client state). The label draws come from the seeded RNG the engine gives
  each client round.
* ``server``: one mask for everyone, calibrated by :meth:`SparseFinetune.calibrate_server`
  (the engine's hook, once before round 1) at the initial global model on the run's
  held-out calibration split (``--calibration_fraction``: manifest train rows no client
  holds, network/calibration_split.py), kept in the server state (so a resume keeps it)
  and broadcast with the model. Without a calibration split the run stops before round 0.

``keep_local_models``: θ_0 stays in the server tensors and each client's last local model
in its client state (both in checkpoint.pt), so ``merge_task_vectors.py --run`` can form
the task vectors τ_k = θ_k − θ_0 (sparse/from_run.py).

``--vectorize_clients``: the client update is one masked SGD phase with fixed per-client
masks, so a chunk trains in lock-step (``client_updates``: each client's step direction is
multiplied by its own mask after weight decay, SparseSGDM's rule); a new client's mask is
calibrated first, alone, under its own seed (``prepare_lockstep``).

Server: per entry, the sample-weighted mean of Δ over the clients whose mask trained it
(``sparse.aggregation.MaskedMean``: a frozen entry's 0 is no vote), then the server
optimizer (``server_opt``). With one server mask it is FedAvg's mean.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from network.aggregation import (ServerOptSettings, Weights, federation_shares, init_server_optimizer, server_step,
                                 subtract, upload_weight)
from network.algorithms.base import (ALGORITHMS, GLOBAL_MODEL, LOCAL_STEPS, TRAIN_LOSS, Algorithm, Bundle,
                                     ClientConfig, ClientResult, Federation, ServerState, Upload, load_weights, require,
                                     trainable)
from network.algorithms.skeleton import frozen
from network.local_train import local_train
from network.settings import check, setting
from network.vectorized import Hooks, stack_weights, train_lockstep
from sparse.aggregation import MaskedMean
from sparse.calibration import calibrate_mask, default_maskable, fisher_score_fn
from sparse.fisher import LIKELIHOODS, VARIANTS, evaluating, model_outputs
from sparse.optim import SparseSGDM
from sparse.rules import list_rules
from utils.device import to_device
from utils.seeding import torch_generator

DELTA = "delta"  # upload group: Δ of the maskable parameters
MASK = "mask"  # broadcast (server masks) and upload group: parameter name -> bool mask
MASK_PREFIX = "mask/"  # server tensors and client state: the mask of a parameter
MASK_SOURCES = ("client", "server")
BASE_PREFIX = "base/"  # server tensors (keep_local_models): θ_0, the initial global model
LOCAL_PREFIX = "local/"  # client state (keep_local_models): θ_k, the client's model after its last local training


# Mask calibration runs rounds × batches backward passes per client: both are bounded.
MAX_CALIBRATION_ROUNDS = 100
MAX_CALIBRATION_BATCHES = 10_000


@dataclass(frozen=True)
class SparseFinetuneSettings(ServerOptSettings):
    density: float = setting(0.1, "fraction d of the maskable entries that train, in (0, 1]")
    calibration_rounds: int = setting(4, "mask calibration rounds R (round r keeps d^((r+1)/R))",
                                      high=MAX_CALIBRATION_ROUNDS)
    calibration_batches: int = setting(4, "batches of calibration data per calibration round",
                                       high=MAX_CALIBRATION_BATCHES)
    mask_rule: str = setting("least_sensitive", "which entries train (TaLoS: least_sensitive)",
                             choices=tuple(list_rules()))
    score: str = setting("log_prob", "sensitivity: log_prob (Fisher) or logit (TaLoS's sampled logit)",
                         choices=VARIANTS)
    likelihood: str = setting("auto", "predictive distribution: categorical, gaussian, or auto (one output: gaussian)",
                              choices=("auto", *LIKELIHOODS))
    mask_source: str = setting("client", "who calibrates the mask: client (own data) or server (held-out data)",
                               choices=MASK_SOURCES)
    input_key: str = setting("auto", "model input for calibration: auto (the data family's input key) or the "
                             "first of these comma-separated batch keys the batch has")
    keep_local_models: bool = setting(False, "keep θ_0 (server) and each client's last local model (client state) "
                                      "in checkpoint.pt, for merge_task_vectors.py --run")

    def __post_init__(self) -> None:
        super().__post_init__()
        check(0 < self.density <= 1, "density", "in (0, 1]", self.density)
        check(self.calibration_rounds >= 1, "calibration_rounds", ">= 1", self.calibration_rounds)
        check(self.calibration_batches >= 1, "calibration_batches", ">= 1", self.calibration_batches)


@ALGORITHMS.register("sparse_ft")
class SparseFinetune(Algorithm):
    """Clients fine-tune only a calibrated sparse mask of entries (TaLoS); the server averages per entry."""

    name = "sparse_ft"
    use_when = "sparse task vectors to merge later (task arithmetic)"
    Settings = SparseFinetuneSettings
    # --vectorize_clients: one masked SGD phase whose masks are fixed per-client tensors (client_updates below);
    # a new client's mask is calibrated before the chunk, under its own seed (prepare_lockstep).
    vectorizable = True

    def client_state_is_a_result(self) -> bool:
        return self.settings.keep_local_models  # merge_task_vectors.py reads each client's θ_k from the checkpoint

    def __init__(self, settings: SparseFinetuneSettings, federation: Federation) -> None:
        super().__init__(settings, federation)
        self.shares = federation_shares(settings, federation.client_sizes, federation.seed)

    @functools.cached_property
    def maskable(self) -> tuple[str, ...]:
        layout = self.federation.layout
        return tuple(key for key in layout.state_keys if key in layout.param_keys and key not in layout.head_keys
                     and default_maskable(key))

    def calibrate(self, model: nn.Module, batches: Iterable[dict], generator: torch.Generator,
                  device: torch.device) -> Weights:
        """The mask of the model's current weights from the first ``calibration_batches`` of ``batches``."""
        settings = self.settings
        data = [to_device(batch, device) for batch in itertools.islice(batches, settings.calibration_batches)]
        require(bool(data), f"{self.name} needs calibration data: the loader gave no batch")
        output_fn = model_outputs(self.calibration_input(data[0]))
        likelihood = settings.likelihood
        if likelihood == "auto":
            with torch.no_grad(), evaluating(model):
                likelihood = "gaussian" if output_fn(model, data[0])[0].numel() == 1 else "categorical"
        seed = int(torch.randint(2 ** 62, (1,), generator=generator))
        score_fn = fisher_score_fn(model, lambda _: data, output_fn, likelihood=likelihood, variant=settings.score,
                                   seed=seed)
        return calibrate_mask(model, score_fn, density=settings.density, rounds=settings.calibration_rounds,
                              rule=settings.mask_rule, maskable=set(self.maskable).__contains__,
                              generator=torch_generator(seed, "mask_rule"))

    def calibration_input(self, batch: dict) -> str:
        """The batch key calibration feeds to the model: the run's (the data family's) unless the setting names keys."""
        if self.settings.input_key == "auto":
            return self.federation.input_key
        keys = [key.strip() for key in self.settings.input_key.split(",") if key.strip()]
        return next((key for key in keys if key in batch), keys[0] if keys else self.federation.input_key)

    def calibrate_server(self, server: ServerState, model: nn.Module, batches: Iterable[dict] | None,
                         device: torch.device) -> ServerState:
        """Server masks (``mask_source`` server): calibrated once at the global model on held-out ``batches``."""
        if self.settings.mask_source != "server":
            return server
        require(batches is not None, f"{self.name} --mask_source server needs a held-out calibration split: pass "
                "--calibration_fraction F (train rows of the manifest that no client holds)")
        load_weights(model, server.models[GLOBAL_MODEL])
        masks = self.calibrate(model, batches, torch_generator(self.federation.seed, "server_mask"), device)
        return ServerState(server.models, {**server.tensors, **{MASK_PREFIX + key: mask for key, mask in masks.items()}})

    def init_server(self, weights: Weights) -> ServerState:
        base = {BASE_PREFIX + key: value.detach().clone() for key, value in weights.items()}
        return ServerState({GLOBAL_MODEL: weights}, {**init_server_optimizer(self.settings, weights, self.maskable),
                                                     **(base if self.settings.keep_local_models else {})})

    def broadcast(self, server: ServerState) -> Bundle:
        masks = {key[len(MASK_PREFIX):]: value for key, value in server.tensors.items() if key.startswith(MASK_PREFIX)}
        return {GLOBAL_MODEL: server.models[GLOBAL_MODEL], MASK: masks}

    def client_update(self, model: nn.Module, broadcast: Bundle, client_state: Weights,
                      loader: Iterable[dict], cfg: ClientConfig) -> ClientResult:
        weights = broadcast[GLOBAL_MODEL]
        load_weights(model, weights)
        masks = self._client_masks(model, broadcast, client_state, loader, cfg)
        params = dict(model.named_parameters())
        with frozen(model, [key for key in self.federation.layout.state_keys if key not in masks]):
            optimizer = SparseSGDM([params[key] for key in masks], list(masks.values()), lr=cfg.lr,
                                   momentum=cfg.momentum, weight_decay=cfg.weight_decay)
            result = local_train(model, loader, cfg.loss_fn, optimizer, cfg.device, **cfg.budget())
        return self._result(model, weights, masks, result.mean_loss, result.steps, cfg)

    def prepare_lockstep(self, model: nn.Module, broadcast: Bundle, client_state: Weights, loader: Iterable[dict],
                         cfg: ClientConfig) -> Weights:
        """A client without a mask calibrates it here (the engine runs this under the client's seed, on the loader
        the chunk then trains on, so the draws and the batches are those of ``client_update``)."""
        if self.settings.mask_source == "server" or any(key.startswith(MASK_PREFIX) for key in client_state):
            return client_state
        load_weights(model, broadcast[GLOBAL_MODEL])
        masks = self._client_masks(model, broadcast, client_state, loader, cfg)
        return {**client_state, **{MASK_PREFIX + key: mask for key, mask in masks.items()}}

    def client_updates(self, model: nn.Module, broadcast: Bundle, client_states: list[Weights],
                       loaders: list[Iterable[dict]], cfgs: list[ClientConfig]) -> list[ClientResult]:
        """``client_update`` of a chunk in lock-step (``network.vectorized``): each client's mask multiplies its
        step direction, as SparseSGDM does; the other entries take no gradient and buffers keep their values."""
        weights = broadcast[GLOBAL_MODEL]
        load_weights(model, weights)
        masks = [self._client_masks(model, broadcast, state, loader, cfg)
                 for state, loader, cfg in zip(client_states, loaders, cfgs)]
        require(all(list(mask) == list(masks[0]) for mask in masks),
                f"{self.name}: clients of one chunk mask different parameters, so they cannot train in lock-step")
        state = stack_weights([weights] * len(loaders), self.federation.layout.varying_keys)
        names = [key for key in trainable(model, masks[0]) if key in state]
        stacked = {key: torch.stack([(mask[key] != 0).to(state[key].dtype) for mask in masks]) for key in names}
        trained = train_lockstep(model, state, names, loaders, cfgs[0], cfgs[0].budget(), Hooks(masks=stacked))
        results = []
        for index, (outcome, client_state, client_masks, cfg) in enumerate(zip(trained.results, client_states,
                                                                                masks, cfgs)):
            load_weights(model, {**weights, **{key: trained.state[key][index] for key in names}})  # buffers restored
            results.append(self._result(model, weights, client_masks, outcome.mean_loss, outcome.steps, cfg))
        return results

    def _result(self, model: nn.Module, weights: Weights, masks: Weights, mean_loss: float, steps: int,
                cfg: ClientConfig) -> ClientResult:
        """The upload (Δ on the masks, and the masks), client state and metrics of the model after training."""
        upload = {DELTA: subtract(model.state_dict(), weights, masks), MASK: masks}
        state = {MASK_PREFIX + key: mask for key, mask in masks.items()} if self.settings.mask_source == "client" else {}
        if self.settings.keep_local_models:
            state.update({LOCAL_PREFIX + key: value.detach().clone() for key, value in model.state_dict().items()})
        return ClientResult(upload, state, {TRAIN_LOSS: mean_loss, LOCAL_STEPS: steps}, cfg.num_samples)

    def _client_masks(self, model: nn.Module, broadcast: Bundle, client_state: Weights, loader: Iterable[dict],
                      cfg: ClientConfig) -> Weights:
        if self.settings.mask_source == "server":
            require(bool(broadcast[MASK]), f"{self.name} mask_source=server: the broadcast has no mask (the engine "
                    "did not call calibrate_server before round 1)")
            return {key: mask.to(cfg.device) for key, mask in broadcast[MASK].items()}
        kept = {key[len(MASK_PREFIX):]: mask.to(cfg.device) for key, mask in client_state.items()
                if key.startswith(MASK_PREFIX)}
        if kept:
            return kept
        seed = int(torch.randint(2 ** 62, (1,)))  # the engine seeds each client round's RNG
        return self.calibrate(model, loader, torch.Generator().manual_seed(seed), cfg.device)

    def aggregate(self, server: ServerState, uploads: Iterable[Upload]) -> ServerState:
        mean = MaskedMean()
        for upload in uploads:
            mean.add(upload.tensors[DELTA], upload.tensors[MASK],
                     upload_weight(self.settings.weighting, self.shares, upload.client_id, upload.num_samples))
        weights, tensors = server_step(server.models[GLOBAL_MODEL], mean.mean(), server.tensors, self.settings,
                                       self.maskable)
        return ServerState({GLOBAL_MODEL: weights}, tensors)
