"""FedRep (Collins et al. 2021): a shared body (representation), a personal head per client.

Client, each round:
1. Load the global weights, then this client's own head (kept in its client state;
   a client's first round starts from the global model's head).
2. Head phase: train the head with the body frozen, for ``head_epochs`` times the
   local budget (J steps with ``--local_steps``, E epochs with ``--local_epochs``).
3. Body phase: train the body with the head frozen, for ``body_epochs`` times the
   budget (1 = exactly the budget every other algorithm gets).
   Each phase has its own optimizer over only its parameters, so momentum and
   weight decay never move a frozen part; the frozen part's buffers (BatchNorm
   statistics) are restored after the phase, so frozen means unchanged.
4. Upload Δ of the body entries only; keep the head as client state.

Server: FedAvg's sample-weighted mean (and server optimizer) over the body; the
global head is never updated. The split comes from the model's ``head_keys()``
(the ``TaskModel`` interface), never from reaching into its submodules.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

from torch import nn

from network.aggregation import Weights, subtract
from network.algorithms.base import (ALGORITHMS, HEAD_TRAIN_LOSS, LOCAL_STEPS, TRAIN_LOSS, AlgorithmConfig,
                                     ClientConfig, ClientResult, load_weights, make_optimizer, require, trainable)
from network.algorithms.fedavg import FedAvg
from network.local_train import local_train


@ALGORITHMS.register("fedrep")
class FedRep(FedAvg):
    """Alternating head/body local training; only the body is averaged."""

    name = "fedrep"

    def __init__(self, config: AlgorithmConfig) -> None:
        super().__init__(config)
        require(config.head_epochs >= 0 and config.body_epochs >= 0 and config.head_epochs + config.body_epochs > 0,
                f"--head_epochs and --body_epochs must be >= 0, not both 0 (got {config.head_epochs}, {config.body_epochs})")

    def personal_keys(self, model: nn.Module) -> list[str]:
        require(callable(getattr(model, "head_keys", None)),
                f"fedrep needs a model with head_keys() (the TaskModel interface); {type(model).__name__} has none")
        return list(model.head_keys())

    def personalized_weights(self, global_weights: Weights, client_state: Weights) -> Weights:
        return {**global_weights, **client_state}  # the client state is exactly its head

    def client_update(self, model: nn.Module, broadcast: Weights, client_state: Weights,
                      loader: Iterable[dict], cfg: ClientConfig) -> ClientResult:
        head_keys = set(self.personal_keys(model))
        body_keys = [key for key in model.state_dict() if key not in head_keys]
        load_weights(model, broadcast)
        load_weights(model, client_state)
        metrics = {}
        for phase_keys, frozen_keys, multiple, metric in ((head_keys, body_keys, self.config.head_epochs, HEAD_TRAIN_LOSS),
                                                          (body_keys, head_keys, self.config.body_epochs, TRAIN_LOSS)):
            if multiple == 0:
                continue
            with frozen(model, frozen_keys):
                optimizer = make_optimizer(trainable(model, phase_keys).values(), cfg)
                result = local_train(model, loader, cfg.loss_fn, optimizer, cfg.device, **cfg.budget(multiple))
            metrics[metric] = result.mean_loss
            metrics[LOCAL_STEPS] = metrics.get(LOCAL_STEPS, 0) + result.steps
        state = model.state_dict()
        upload = subtract(state, broadcast, [key for key in body_keys if key in broadcast])
        head = {key: state[key].detach().clone() for key in head_keys}
        return ClientResult(upload, head, metrics, cfg.num_samples)


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
