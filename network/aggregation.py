"""Aggregation arithmetic: pure functions over ``dict[str, Tensor]`` (no engine, no transport).

Every federated algorithm's server half reduces to these: a (weighted) mean of
client uploads folded one upload at a time, so an engine never holds more than
one upload plus the running sum, and a server step that applies the mean update
to the global weights (plain SGD, FedAvgM momentum or FedAdam).

Tensors keep their device; sums are kept in the upload's floating dtype, and
integer entries (BatchNorm's ``num_batches_tracked``) are summed in float32 and
rounded back, since a counter has no meaningful fractional mean.

**Weightings** (``WeightingSettings.weighting``, every model-averaging algorithm): how much a
client's upload counts. ``samples``: its number of training samples n_i; ``uniform``: 1/N;
``capped``: n_i/n with no client above ``cap``. Two keep a client's exact size private, since a
size can leak (a hospital's patient volume): the client uploads a coarser size and the server
weighs by it, exactly as ``samples`` weighs by n_i. ``bucketed``: the largest of the published
``buckets`` edges that is ≤ n_i (a size below the smallest edge reports the smallest edge, so
every client keeps a positive weight and all small clients look alike). ``noisy``:
max(1, round(n_i + Laplace(0, noise_scale))), the Laplace mechanism with sensitivity 1
(ε = 1/noise_scale for one release); the noise is drawn once per client and size from the run's
seed (``numpy_rng(seed, "noisy_size", client, n_i)``), so every round, both engines and a
resumed run report the same value, and averaging over rounds reveals nothing more than one
report would (fresh noise each round would average out: after R rounds its spread falls by √R).
The seed makes the draw repeatable for research; a deployment would draw it from a secret the
server never holds. :func:`reported_size` is the one rule; the client side applies it to what it
uploads (``Algorithm.reported_num_samples``, called by ``network.client.train_client`` for both
engines), and the server's fixed shares (``federation_shares``; SCAFFOLD's p_i) use the same
reported sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np
import torch
from torch import Tensor

from network.settings import check, setting
from utils.errors import TaskHetError
from utils.seeding import numpy_rng

Weights = dict[str, Tensor]

SERVER_OPTIMIZERS = ("sgd", "momentum", "adam")
WEIGHTINGS = ("samples", "uniform", "capped", "bucketed", "noisy")
# The weightings that keep a client's exact size on the client: it uploads its reported size (reported_size).
PRIVATE_WEIGHTINGS = ("bucketed", "noisy")
# The weightings whose upload weight is the uploaded size itself (exact for samples, reported otherwise).
SIZE_WEIGHTINGS = ("samples", *PRIVATE_WEIGHTINGS)
DEFAULT_BUCKETS = "10,100,1000,10000"
MAX_BUCKETS = 64  # published edges: a handful is the point; more would publish the sizes themselves
MAX_BUCKET_EDGE = 10**9  # no client holds more samples
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


@dataclass(frozen=True)
class WeightingSettings:
    """How much each client's upload counts in the server's mean (shared by every model-averaging algorithm)."""

    weighting: str = setting("samples", "client weights in the server mean: samples (p_i = n_i/n), uniform (1/N), "
                                        "capped (n_i/n with no client above cap), bucketed (n_i rounded down to a "
                                        "published bucket edge, see buckets), noisy (n_i plus seeded Laplace noise, see "
                                        "noise_scale); with bucketed and noisy the exact n_i never leaves the client",
                             choices=WEIGHTINGS)
    cap: float = setting(1.0, "capped weighting: the largest share one client may have (>= 1/N)")
    buckets: str = setting(DEFAULT_BUCKETS, "bucketed weighting: the published bucket edges, increasing integers >= 1 "
                                            "joined by commas; a client reports the largest edge <= its size (the "
                                            "smallest edge below it)")
    noise_scale: float = setting(10.0, "noisy weighting: the scale b > 0 of the Laplace noise added to a client's "
                                       "size (epsilon = 1/b for one release); drawn once per client from the run seed")

    def __post_init__(self) -> None:
        check(self.weighting in WEIGHTINGS, "weighting", f"one of {', '.join(WEIGHTINGS)}", self.weighting)
        check(0 < self.cap <= 1, "cap", "in (0, 1]", self.cap)
        parse_buckets(self.buckets)
        check(self.noise_scale > 0, "noise_scale", "> 0", self.noise_scale)

    @property
    def bucket_edges(self) -> tuple[int, ...]:
        """The ``buckets`` setting as integers, increasing."""
        return parse_buckets(self.buckets)


def parse_buckets(text: str) -> tuple[int, ...]:
    """``"10,100,1000"`` -> ``(10, 100, 1000)``.

    Raises:
        TaskHetError: not 1..``MAX_BUCKETS`` comma-separated integers >= 1 in increasing order (names the setting).
    """
    expected = (f"1 to {MAX_BUCKETS} increasing integers in [1, {MAX_BUCKET_EDGE:.0e}] joined by commas, "
                f"e.g. {DEFAULT_BUCKETS}")
    parts = [part.strip() for part in text.split(",")] if isinstance(text, str) else []
    # ASCII digits only: str.isdigit alone also takes '²'
    check(0 < len(parts) <= MAX_BUCKETS and all(part.isascii() and part.isdigit() and len(part) <= 10 for part in parts),
          "buckets", expected, text)
    edges = tuple(int(part) for part in parts)
    check(1 <= edges[0] and edges[-1] <= MAX_BUCKET_EDGE and all(low < high for low, high in zip(edges, edges[1:])),
          "buckets", expected, text)
    return edges


def bucketed_size(num_samples: int, edges: tuple[int, ...]) -> int:
    """The largest bucket edge <= ``num_samples``; the smallest edge for a size below it (0 stays 0)."""
    if num_samples <= 0:
        return 0
    return max((edge for edge in edges if edge <= num_samples), default=edges[0])


def noisy_size(num_samples: int, noise_scale: float, rng: np.random.Generator) -> int:
    """``max(1, round(num_samples + Laplace(0, noise_scale)))`` (0 stays 0): rounding and the floor are
    post-processing, so the Laplace mechanism's guarantee holds, and every weight stays positive."""
    if num_samples <= 0:
        return 0
    return max(1, int(round(num_samples + rng.laplace(0.0, noise_scale))))


def reported_size(settings: object, seed: int, client_id: str, num_samples: int) -> int:
    """The size a client uploads with its update: exact unless ``settings`` has a private weighting.

    Args:
        settings: an algorithm's settings (those without ``weighting`` report the exact size).
        seed: the run's root seed (``Federation.seed``); with ``client_id`` and the size it seeds the noise.
        client_id: the client's id.
        num_samples: its exact number of training samples (this round's, under a temporal schedule).
    """
    weighting = getattr(settings, "weighting", None)
    if weighting == "bucketed":
        return bucketed_size(int(num_samples), settings.bucket_edges)
    if weighting == "noisy":
        return noisy_size(int(num_samples), settings.noise_scale, numpy_rng(seed, "noisy_size", client_id, int(num_samples)))
    return int(num_samples)


def federation_shares(settings: WeightingSettings, client_sizes: Mapping[str, int], seed: int) -> dict[str, float]:
    """Every client's fixed share of the server mean (:func:`client_weights`), from the sizes the clients report:
    exact for ``samples``, ``uniform`` and ``capped``, the bucketed or noisy ones otherwise (a deployment learns them
    from each client's uploads; the simulation computes them with the clients' own rule, so they are equal)."""
    reported = {client_id: reported_size(settings, seed, client_id, size) for client_id, size in client_sizes.items()}
    return client_weights(reported, settings.weighting, settings.cap)


def client_weights(client_sizes: Mapping[str, int], weighting: str, cap: float = 1.0) -> dict[str, float]:
    """Each client's share p_i of the server mean (shares sum to 1 over the whole federation).

    ``samples`` (and ``bucketed``, ``noisy``, whose ``client_sizes`` are the reported ones): p_i = n_i/n;
    ``uniform``: p_i = 1/N; ``capped``: p_i = n_i/n, but a client above
    ``cap`` gets exactly ``cap`` and the excess goes to the others in proportion to their sizes,
    repeated (water-filling) until no share exceeds the cap. A round's mean over the sampled clients
    S is Σ_S p_i·Δ_i / Σ_S p_i. Hand-written: no library offers capped proportional shares.

    Raises:
        TaskHetError: ``cap < 1/N`` (no shares can sum to 1), naming the setting.
    """
    ids = list(client_sizes)
    if weighting == "uniform" or not ids:
        return {client_id: 1.0 / len(ids) for client_id in ids}
    total = sum(client_sizes.values())
    if total <= 0:  # a federation without training rows (a check-only build): every client counts the same
        return {client_id: 1.0 / len(ids) for client_id in ids}
    shares = {client_id: client_sizes[client_id] / total for client_id in ids}
    if weighting != "capped":
        return shares
    if cap * len(ids) < 1 - 1e-12:
        raise TaskHetError(f"setting cap must be >= 1/N = {1 / len(ids):.6g} for N = {len(ids)} clients (capped "
                           f"shares must sum to 1), got {cap!r}")
    capped: set[str] = set()
    while True:
        free = [client_id for client_id in ids if client_id not in capped]
        free_size = sum(client_sizes[client_id] for client_id in free)
        left = 1.0 - cap * len(capped)
        for client_id in free:
            shares[client_id] = left * client_sizes[client_id] / free_size if free_size else left / len(free)
        over = {client_id for client_id in free if shares[client_id] > cap}
        if not over:
            return shares
        capped |= over
        for client_id in over:
            shares[client_id] = cap


def upload_weight(weighting: str, shares: Mapping[str, float], client_id: str, num_samples: int) -> float:
    """An upload's weight in a round's mean: the size it carries (``samples``: exactly n_i; ``bucketed``, ``noisy``:
    the reported size, the only one the server sees) or its client's share (``uniform``, ``capped``)."""
    return num_samples if weighting in SIZE_WEIGHTINGS else shares[client_id]


@dataclass(frozen=True)
class ServerOptSettings(WeightingSettings):
    """Settings of the server step that applies the mean client update (shared by every model-averaging algorithm)."""

    server_opt: str = setting("sgd", "server optimizer: sgd (FedAvg; η_g = 1 is plain averaging), momentum (FedAvgM), "
                                     "adam (FedAdam)", choices=SERVER_OPTIMIZERS)
    server_lr: float = setting(1.0, "server learning rate η_g (parameters only; buffers take the plain mean)")
    server_momentum: float = setting(0.9, "FedAvgM's β: v ← β·v + Δ̄")
    server_beta1: float = setting(0.9, "FedAdam's β1 (first moment)")
    server_beta2: float = setting(0.99, "FedAdam's β2 (second moment)")
    server_tau: float = setting(1e-3, "FedAdam's adaptivity τ in m / (√v + τ)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.server_opt in SERVER_OPTIMIZERS, "server_opt", f"one of {', '.join(SERVER_OPTIMIZERS)}", self.server_opt)
        check(self.server_lr > 0, "server_lr", "> 0", self.server_lr)
        check(0 <= self.server_momentum < 1, "server_momentum", "in [0, 1)", self.server_momentum)
        check(0 <= self.server_beta1 < 1, "server_beta1", "in [0, 1)", self.server_beta1)
        check(0 <= self.server_beta2 < 1, "server_beta2", "in [0, 1)", self.server_beta2)
        check(self.server_tau > 0, "server_tau", "> 0", self.server_tau)


def init_server_optimizer(settings: ServerOptSettings, global_weights: Weights, param_keys: Iterable[str]) -> Weights:
    """The server optimizer's initial state: zeros per parameter (empty for plain SGD; buffers never have any)."""
    prefixes = {"sgd": (), "momentum": (MOMENTUM_PREFIX,), "adam": (ADAM_M_PREFIX, ADAM_V_PREFIX)}[settings.server_opt]
    return {prefix + key: torch.zeros_like(global_weights[key]) for prefix in prefixes for key in param_keys}


def server_step(global_weights: Weights, mean_delta: Weights, server_state: Weights, settings: ServerOptSettings,
                param_keys: Iterable[str]) -> tuple[Weights, Weights]:
    """Apply the mean client update ``mean_delta`` (client minus global) with a server optimizer.

    Treats ``-mean_delta`` of the *parameters* as a pseudo-gradient (Reddi et al. 2021,
    "Adaptive Federated Optimization"): ``sgd``: x + η_g·Δ (η_g = 1 is FedAvg);
    ``momentum`` (FedAvgM, Hsu et al. 2019): v = β·v + Δ, x + η_g·v; ``adam`` (FedAdam,
    Reddi et al. Alg. 2, no bias correction, adaptivity τ): m = β1·m + (1−β1)·Δ,
    v = β2·v + (1−β2)·Δ², x + η_g·m/(√v + τ).

    Every other entry of ``mean_delta`` (BatchNorm running statistics, counters) is a
    buffer, not a parameter: it takes the plain mean, x + Δ, whatever the optimizer
    and η_g (momentum or scaling would push a running variance below zero). Counters
    are rounded. Keys absent from ``mean_delta`` do not move.

    Args:
        param_keys: the model's parameter names (``ModelLayout.param_keys``).

    Returns:
        ``(new_global_weights, new_server_state)``; the inputs are not modified.
    """
    params = set(param_keys)
    buffers = {key: value for key, value in mean_delta.items() if key not in params}
    new_weights = apply_update(global_weights, buffers)
    new_state = dict(server_state)
    for key, delta in mean_delta.items():
        if key not in params:
            continue
        if settings.server_opt == "sgd":
            step = delta
        elif settings.server_opt == "momentum":
            step = new_state[MOMENTUM_PREFIX + key] = settings.server_momentum * server_state[MOMENTUM_PREFIX + key] + delta
        else:
            beta1, beta2 = settings.server_beta1, settings.server_beta2
            first = new_state[ADAM_M_PREFIX + key] = beta1 * server_state[ADAM_M_PREFIX + key] + (1 - beta1) * delta
            second = new_state[ADAM_V_PREFIX + key] = beta2 * server_state[ADAM_V_PREFIX + key] + (1 - beta2) * delta * delta
            step = first / (second.sqrt() + settings.server_tau)
        new_weights[key] = _cast_like(global_weights[key] + settings.server_lr * step, global_weights[key])
    return new_weights, new_state


def client_summary(values: list[float], higher_is_better: bool = False) -> dict[str, float]:
    """How a metric spreads over clients: its mean and the fairness measures of q-FFL (Li et al. 2020) and Jain.

    ``mean``, population ``std`` and ``variance``; ``worst`` and ``best`` (the single worst and best
    client); ``worst_decile`` and ``best_decile`` (the mean of the ceil(10 %) worst or best clients,
    q-FFL's "worst/best 10 % of devices": with fewer than 10 clients, one client); ``jain``, Jain's
    index (Σx)²/(N·Σx²) in [1/N, 1] (1: every client equal), only for non-negative values not all 0.
    ``higher_is_better`` says which end is worst (False for a loss, True for an accuracy).
    """
    if not values:
        raise ValueError("client_summary needs at least one value")
    ordered = torch.tensor(sorted(values, reverse=not higher_is_better), dtype=torch.float64)  # worst first
    decile = max(1, -(-len(values) // 10))
    summary = {"mean": float(ordered.mean()), "std": float(ordered.std(unbiased=False)),
               "variance": float(ordered.var(unbiased=False)), "worst": float(ordered[0]), "best": float(ordered[-1]),
               "worst_decile": float(ordered[:decile].mean()), "best_decile": float(ordered[-decile:].mean())}
    squares = float((ordered * ordered).sum())
    if bool((ordered >= 0).all()) and squares > 0:
        summary["jain"] = float(ordered.sum()) ** 2 / (len(values) * squares)
    return summary


def _work_dtype(reference: Tensor) -> torch.dtype:
    return reference.dtype if reference.is_floating_point() else torch.float32


def _cast_like(value: Tensor, reference: Tensor) -> Tensor:
    return value.to(reference.dtype) if reference.is_floating_point() else value.round().to(reference.dtype)
