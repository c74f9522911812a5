"""Aggregation arithmetic: pure functions over ``dict[str, Tensor]`` (no engine, no transport).

Every federated algorithm's server half reduces to these: a (weighted) mean of
client uploads folded one upload at a time, so an engine never holds more than
one upload plus the running sum, and a server step that applies the mean update
to the global weights (plain SGD, FedAvgM momentum or FedAdam).

Tensors keep their device; sums are kept in the upload's floating dtype, and
integer entries (BatchNorm's ``num_batches_tracked``) are summed in float32 and
rounded back, since a counter has no meaningful fractional mean.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor

from utils.errors import TaskHetError

Weights = dict[str, Tensor]

SERVER_OPTIMIZERS = ("sgd", "momentum", "adam")
# Keys of the server optimizer's state, prefixed to the weight names they belong to.
MOMENTUM_PREFIX = "server_momentum/"
ADAM_M_PREFIX = "server_adam_m/"
ADAM_V_PREFIX = "server_adam_v/"


class WeightedMean:
    """Running weighted mean of uploads: ``add`` one at a time, ``mean`` at the end.

    Memory is one sum per key, whatever the number of uploads (streaming aggregation).
    """

    def __init__(self) -> None:
        self._sums: Weights = {}
        self._dtypes: dict[str, torch.dtype] = {}
        self.total_weight = 0.0
        self.count = 0

    def add(self, tensors: Weights, weight: float) -> None:
        """Fold ``weight * tensors`` into the sums (every upload must have the same keys)."""
        if weight < 0:
            raise ValueError(f"aggregation weight must be >= 0, got {weight}")
        if self.count and set(tensors) != set(self._sums):
            raise ValueError(f"upload keys differ from the first upload's: {sorted(set(tensors) ^ set(self._sums))[:5]}")
        for key, value in tensors.items():
            value = value.detach()
            if key not in self._sums:
                self._dtypes[key] = value.dtype
                dtype = value.dtype if value.is_floating_point() else torch.float32
                self._sums[key] = torch.zeros_like(value, dtype=dtype)
            self._sums[key].add_(value.to(self._sums[key].dtype), alpha=weight)
        self.total_weight += weight
        self.count += 1

    def mean(self) -> Weights:
        """The weighted mean of everything added (same keys, dtypes and devices as the uploads)."""
        if self.count == 0 or self.total_weight <= 0:
            raise TaskHetError("nothing to aggregate: no client upload with a positive weight this round")
        means = {}
        for key, total in self._sums.items():
            mean = total / self.total_weight
            dtype = self._dtypes[key]
            means[key] = mean.to(dtype) if dtype.is_floating_point else mean.round().to(dtype)
        return means


def weighted_average(uploads: Iterable[tuple[Weights, float]]) -> tuple[Weights, int]:
    """Weighted mean of ``(tensors, weight)`` pairs, consumed one at a time.

    Args:
        uploads: an iterable (a generator is fine: it is read once) of pairs; all
            tensors dicts have the same keys and shapes.

    Returns:
        ``(mean, count)``: ``sum_i w_i x_i / sum_i w_i`` per key, and the number of pairs.
    """
    accumulator = WeightedMean()
    for tensors, weight in uploads:
        accumulator.add(tensors, float(weight))
    return accumulator.mean(), accumulator.count


def subtract(minuend: Weights, subtrahend: Weights, keys: Iterable[str]) -> Weights:
    """``minuend[k] - subtrahend[k]`` for each key (new tensors)."""
    return {key: minuend[key].detach() - subtrahend[key] for key in keys}


def apply_update(weights: Weights, update: Weights, scale: float = 1.0) -> Weights:
    """A new dict: ``weights[k] + scale * update[k]`` where ``update`` has ``k``, else ``weights[k]`` unchanged."""
    result = dict(weights)
    for key, value in update.items():
        result[key] = _cast_like(weights[key] + scale * value.to(_work_dtype(weights[key])), weights[key])
    return result


def init_server_optimizer(server_opt: str, global_weights: Weights) -> Weights:
    """The server optimizer's initial state: zeros per floating weight (empty for plain SGD)."""
    if server_opt not in SERVER_OPTIMIZERS:
        raise TaskHetError(f"--server_opt must be one of {', '.join(SERVER_OPTIMIZERS)}, got {server_opt!r}")
    prefixes = {"sgd": (), "momentum": (MOMENTUM_PREFIX,), "adam": (ADAM_M_PREFIX, ADAM_V_PREFIX)}[server_opt]
    return {prefix + key: torch.zeros_like(value) for prefix in prefixes
            for key, value in global_weights.items() if value.is_floating_point()}


def server_step(global_weights: Weights, mean_delta: Weights, server_state: Weights, server_opt: str,
                server_lr: float, momentum: float = 0.9, betas: tuple[float, float] = (0.9, 0.99),
                tau: float = 1e-3) -> tuple[Weights, Weights]:
    """Apply the mean client update ``mean_delta`` (client minus global) with a server optimizer.

    Treats ``-mean_delta`` as a pseudo-gradient (Reddi et al. 2021, "Adaptive Federated
    Optimization"): ``sgd``: x + lr·Δ (lr = 1 is FedAvg); ``momentum`` (FedAvgM, Hsu et al.
    2019): v = β·v + Δ, x + lr·v; ``adam`` (FedAdam, Reddi et al. Alg. 2, no bias
    correction, adaptivity τ): m = β1·m + (1-β1)·Δ, v = β2·v + (1-β2)·Δ², x + lr·m/(√v + τ).
    Only keys in ``mean_delta`` move; integer entries (counters) always take the plain mean.

    Returns:
        ``(new_global_weights, new_server_state)``; the inputs are not modified.
    """
    plain = {key: value for key, value in mean_delta.items() if server_opt == "sgd" or not value.is_floating_point()}
    adaptive = {key: value for key, value in mean_delta.items() if key not in plain}
    new_weights = apply_update(global_weights, plain, server_lr if server_opt == "sgd" else 1.0)
    new_state = dict(server_state)
    for key, delta in adaptive.items():
        if server_opt == "momentum":
            velocity = momentum * server_state[MOMENTUM_PREFIX + key] + delta
            new_state[MOMENTUM_PREFIX + key] = velocity
            step = velocity
        else:
            first = betas[0] * server_state[ADAM_M_PREFIX + key] + (1 - betas[0]) * delta
            second = betas[1] * server_state[ADAM_V_PREFIX + key] + (1 - betas[1]) * delta * delta
            new_state[ADAM_M_PREFIX + key], new_state[ADAM_V_PREFIX + key] = first, second
            step = first / (second.sqrt() + tau)
        new_weights[key] = _cast_like(global_weights[key] + server_lr * step, global_weights[key])
    return new_weights, new_state


def client_summary(values: list[float]) -> dict[str, float]:
    """Mean, population std and worst decile of per-client values (higher = worse, as for a loss).

    The worst decile is the mean of the ceil(10 %) highest values (q-FFL's "worst 10 % of
    devices"), so with fewer than 10 clients it is the single worst one.
    """
    if not values:
        raise ValueError("client_summary needs at least one value")
    ordered = torch.tensor(sorted(values, reverse=True), dtype=torch.float64)
    worst = ordered[: max(1, -(-len(values) // 10))]
    return {"mean": float(ordered.mean()), "std": float(ordered.std(unbiased=False)), "worst_decile": float(worst.mean())}


def _work_dtype(reference: Tensor) -> torch.dtype:
    return reference.dtype if reference.is_floating_point() else torch.float32


def _cast_like(value: Tensor, reference: Tensor) -> Tensor:
    return value.to(reference.dtype) if reference.is_floating_point() else value.round().to(reference.dtype)
