"""MOCHA's multi-task relationship regulariser (Smith, Chiang, Sanjabi, Talwalkar, "Federated Multi-Task
Learning", NeurIPS 2017) for neural networks: the primal form on the classifier layer.

The authors' code is convex (hinge loss, SDCA on the dual). For a network, TaskHet keeps the
paper's objective in its primal form, on the head:

    min Σ_k F_k(body, w_k) + (λ/2)·tr(W Ω Wᵀ),   W = [w_1 … w_m] (one flattened head per client),

* The body is shared and averaged (the model-averaging server: ``weighting``, server optimiser).
* Each client keeps its own head w_k, but uploads its change: the server stores every client's
  head (server tensors ``head/<id>/<entry>``) to learn the task relationships. Client and server
  both update their copy as old + change, the same floating-point operations, so the two copies
  are equal bit for bit on any CPU (old + (new − old) can differ from new in the last bit).
* Ω = Σ⁻¹ with Σ = (WᵀW)^{1/2} / tr((WᵀW)^{1/2}) (the closed-form minimiser of the objective in Σ,
  Zhang & Yeung 2010), recomputed on the server after every round from the stored heads, by an
  eigendecomposition; Σ's eigenvalues are floored at ``eps`` so Ω stays finite when heads are
  (nearly) collinear. Before round 1 it is Σ = I/m (Ω = m·I).
* Client k's regulariser is (λ/2)·(Ω_kk·‖w_k‖² + 2·w_k·c_k) with c_k = Σ_{j≠k} Ω_kj·w_j, which the
  server sends it (``Algorithm.client_broadcast``): its gradient λ·(Ω W)_k is the full
  regulariser's gradient in w_k. It is computed on the live head parameters, so it has a
  gradient (checked by finite differences).

Two public implementations build Ω from a matrix of ones (so they penalise ‖Σ_k w_k‖², not the
learned relationships) and compute the regulariser on detached tensors (so it never acts);
both are tested against here. A model without a head (``head_keys()``) is refused.

**Numerical safety.** The client's regulariser is a quadratic in w_k of curvature λ·Ω_kk, and
weight decay adds its own, h = λ·Ω_kk + weight_decay. The local step (torch's heavy-ball SGD,
v ← β·v + g, w ← w − lr·v) on a quadratic of curvature h contracts only while

    lr·h < 2·(1 + β)            (plain SGD, β = 0: lr·h < 2),

the roots of z² − (1 + β − lr·h)·z + β lying inside the unit circle. Ω_kk is at most 1/eps and
comes near it whenever heads are nearly collinear, which partial participation makes common:
clients not yet picked all hold the starting head. A convex task loss only adds curvature, so
the condition is necessary for the head's iteration to be stable, though not sufficient.
Two guards, both ending the run with one ``error:`` line (a :class:`MochaDivergence`, which the
engines report as a non-finite run, naming the round and client) that names lam, eps, lr and
momentum and says what to change:

* the condition is enforced per client and round, on the actual Ω_kk and the round's lr
  (:func:`check_local_step`), before the client trains. Not at construction: the algorithm never
  sees the lr (an engine setting, which a schedule changes by round), and the worst case 1/eps
  is far from every run (full participation with wide heads keeps Ω_kk near m), so refusing
  lr·λ/eps ≥ 2·(1 + β) up front would refuse runs that are stable. Not by clamping Ω_kk either:
  that changes the paper's objective silently, exactly where it is used. The message suggests
  values that satisfy the worst case, so the rerun cannot stop again for this reason.
* divergence the condition cannot see (the task's own curvature, a non-convex body) is caught
  after each local training (:func:`check_head`): a head that is not finite, or whose norm
  exceeds ``HEAD_GROWTH_LIMIT`` times max(the starting head's norm, 1). The regulariser bounds
  ‖W‖² by 2/λ times the objective (Ω's eigenvalues are at least 1), so a thousandfold head is
  a diverging run, not a learning one.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import Tensor, nn

from network.aggregation import ServerOptSettings, Weights, WeightedMean, apply_update, server_step, subtract
from network.algorithms.base import (ALGORITHMS, GLOBAL_MODEL, Bundle, ClientConfig, ClientResult, Federation,
                                     ServerState, Upload, copy_state, load_weights, require, trainable)
from network.algorithms.skeleton import DELTA, ModelAveraging, Phase, run_phases
from network.settings import check, setting
from utils.errors import NonFiniteLossError, TaskHetError

HEAD_DELTA = "head_delta"  # upload group: w_k(new) − w_k(old)
COUPLING = "coupling"  # broadcast group: c_k = Σ_{j≠k} Ω_kj·w_j, by head entry
OMEGA_KK = "omega_kk"  # broadcast group {"value": Ω_kk}
OMEGA = "omega"  # server tensor: Ω, m × m in the federation's client order
HEAD_PREFIX = "head/{}/"  # server tensors: client k's head
HEAD_GROWTH_LIMIT = 1000.0  # a head norm above this × max(starting head norm, 1) has diverged


class MochaDivergence(NonFiniteLossError):
    """The heads' local step is unstable or has diverged; the run stops (it keeps its last good checkpoint)."""


@dataclass(frozen=True)
class MochaSettings(ServerOptSettings):
    lam: float = setting(0.01, "λ of the regulariser (λ/2)·tr(W Ω Wᵀ) over the clients' heads")
    eps: float = setting(1e-3, "floor of Σ's eigenvalues (Ω's are at most 1/eps)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.lam >= 0, "lam", ">= 0", self.lam)
        check(0 < self.eps < 1, "eps", "in (0, 1)", self.eps)


def task_covariance(heads: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(Σ, Ω) from the heads as columns of ``heads`` (d × m): Σ = (WᵀW)^{1/2}/tr(·), eigenvalues floored at ``eps``."""
    gram = heads.T.double() @ heads.double()
    values, vectors = torch.linalg.eigh(gram)
    roots = values.clamp(min=0).sqrt()
    total = roots.sum()
    shares = roots / total if total > 0 else torch.full_like(roots, 1.0 / len(roots))
    shares = shares.clamp(min=eps)
    sigma = vectors @ torch.diag(shares) @ vectors.T
    omega = vectors @ torch.diag(1.0 / shares) @ vectors.T
    return sigma, omega


@ALGORITHMS.register("mocha")
class Mocha(ModelAveraging):
    """Shared body; personal heads coupled by a learned task-relationship regulariser (λ/2)·tr(W Ω Wᵀ)."""

    name = "mocha"
    use_when = "tasks related through their classifiers, relationships to learn"
    Settings = MochaSettings
    personalized = True

    def __init__(self, settings: MochaSettings, federation: Federation) -> None:
        super().__init__(settings, federation)
        if not self._head:
            raise TaskHetError("mocha couples the clients' classifier heads: the model needs a head (head_keys()), "
                               "and this one declares none")
        self.order = list(federation.client_sizes)  # Ω's rows and columns, by client id

    @functools.cached_property
    def _head(self) -> tuple[str, ...]:
        layout = self.federation.layout
        return tuple(key for key in layout.state_keys if key in layout.head_keys and key in layout.param_keys
                     and key not in layout.fixed_keys)

    def shared_keys(self) -> tuple[str, ...]:
        return tuple(key for key in self.federation.layout.varying_keys if key not in self._head)

    def init_server(self, weights: Weights) -> ServerState:
        server = super().init_server(weights)
        heads = {HEAD_PREFIX.format(client_id) + key: weights[key].clone() for client_id in self.order
                 for key in self._head}
        count = len(self.order)
        omega = count * torch.eye(count, dtype=torch.float64)
        return ServerState(server.models, {**server.tensors, **heads, OMEGA: omega})

    def client_broadcast(self, server: ServerState, broadcast: Bundle, client_id: str) -> Bundle:
        index = self.order.index(client_id)
        row = server.tensors[OMEGA][index]
        coupling = {}
        for key in self._head:
            stored = [server.tensors[HEAD_PREFIX.format(other) + key].double() for other in self.order]
            coupling[key] = sum(row[j] * value for j, value in enumerate(stored) if j != index).to(stored[0].dtype)
        return {**broadcast, COUPLING: coupling, OMEGA_KK: {"value": row[index].clone()}}

    def client_update(self, model: nn.Module, broadcast: Bundle, client_state: Weights,
                      loader: Iterable[dict], cfg: ClientConfig) -> ClientResult:
        global_weights = broadcast[GLOBAL_MODEL]
        load_weights(model, global_weights)
        load_weights(model, client_state)
        old_head = copy_state(model, self._head)
        omega_kk = float(broadcast[OMEGA_KK]["value"])
        check_local_step(self.settings, omega_kk, cfg)
        term = regulariser(model, broadcast[COUPLING], omega_kk, self.settings.lam)
        metrics = run_phases(model, [Phase(extra_loss=term if self.settings.lam else None)], loader, cfg)
        state = model.state_dict()
        check_head({key: state[key] for key in self._head}, {key: global_weights[key] for key in self._head},
                   self.settings, omega_kk, cfg)
        head_delta = subtract(state, old_head, self._head)
        upload = {DELTA: subtract(state, global_weights, self.shared_keys()), HEAD_DELTA: head_delta}
        # The client keeps old + (new − old), the very operations the server runs on its copy, not the trained
        # head itself: in floating point a + (b − a) need not be b (it is whenever b − a is exact, which depends on
        # the last bits of training and so on the CPU's kernels), and the server's Ω and couplings must be built
        # from the heads the clients hold, bit for bit, on every machine.
        return ClientResult(upload, apply_update(old_head, head_delta), metrics, cfg.num_samples)

    def aggregate(self, server: ServerState, uploads: Iterable[Upload]) -> ServerState:
        mean, tensors = WeightedMean(), dict(server.tensors)
        for upload in uploads:
            mean.add(upload.tensors[DELTA], self.upload_weight(upload))
            prefix = HEAD_PREFIX.format(upload.client_id)
            stored = {key: tensors[prefix + key] for key in self._head}
            tensors.update({prefix + key: value for key, value in apply_update(stored, upload.tensors[HEAD_DELTA]).items()})
        weights, tensors = server_step(server.models[GLOBAL_MODEL], mean.mean(), tensors, self.settings,
                                       self._averaged_params)
        _, tensors[OMEGA] = task_covariance(self.head_matrix(tensors), self.settings.eps)
        return ServerState({GLOBAL_MODEL: weights}, tensors)

    def head_matrix(self, tensors: Weights) -> Tensor:
        """W: one column per client (its flattened head), in ``self.order``."""
        return torch.stack([torch.cat([tensors[HEAD_PREFIX.format(client_id) + key].double().flatten()
                                       for key in self._head]) for client_id in self.order], dim=1)


def regulariser(model: nn.Module, coupling: Weights, omega_kk: float, lam: float):
    """``extra_loss``: (λ/2)·(Ω_kk·‖w_k‖² + 2·w_k·c_k) over the live head parameters (gradient λ·(Ω W)_k)."""
    params = trainable(model, coupling)
    require(set(params) == set(coupling), f"mocha: the coupling names {sorted(coupling)}, the head trains "
                                          f"{sorted(params)}")
    names = list(params)

    def term(_: nn.Module) -> Tensor:
        total = 0.0
        for name in names:
            weight = params[name]
            total = total + omega_kk * weight.pow(2).sum() + 2 * (weight * coupling[name].to(weight)).sum()
        return 0.5 * lam * total

    return term


def lr_curvature(settings: MochaSettings, omega_kk: float, cfg: ClientConfig) -> float:
    """lr·h, h = λ·Ω_kk + weight_decay: the regulariser's curvature in units of the local step."""
    return cfg.lr * (settings.lam * omega_kk + cfg.weight_decay)


def stability_bound(cfg: ClientConfig) -> float:
    """2·(1 + β): heavy-ball SGD on a quadratic contracts while lr·h stays below it."""
    return 2 * (1 + cfg.momentum)


def check_local_step(settings: MochaSettings, omega_kk: float, cfg: ClientConfig) -> None:
    """Refuse a round whose local step diverges on the regulariser alone: lr·(λ·Ω_kk + weight_decay) ≥ 2·(1 + β).

    Raises:
        MochaDivergence: naming the settings and values that satisfy the worst case Ω_kk = 1/eps.
    """
    if settings.lam == 0:  # no regulariser: weight decay alone is every algorithm's concern, not MOCHA's
        return
    size, bound = lr_curvature(settings, omega_kk, cfg), stability_bound(cfg)
    if size < bound:
        return
    raise MochaDivergence(
        f"mocha: the local step on the heads' regulariser is unstable: lr·(lam·Ω_kk + weight_decay) = {size:.4g} is "
        f"not below 2·(1 + momentum) = {bound:.4g} ({_described(settings, cfg)}, Ω_kk {omega_kk:.4g}; nearly equal "
        f"heads, as those of clients not yet picked are, bring Ω_kk up to 1/eps = {1 / settings.eps:.4g}): "
        f"{_remedy(settings, cfg)}")


def check_head(head: Weights, start: Weights, settings: MochaSettings, omega_kk: float, cfg: ClientConfig) -> None:
    """Refuse a head that is not finite or whose norm exceeds ``HEAD_GROWTH_LIMIT`` × max(‖starting head‖, 1).

    Args:
        head: the client's head entries after its local training.
        start: the same entries of the run's starting model (the global model's head, which never trains).

    Raises:
        MochaDivergence: naming the norms, the settings and what to change.
    """
    norms = torch.stack([torch.cat([value.double().flatten() for value in weights.values()]).norm()
                         for weights in (head, start)]).tolist()  # one device sync
    norm, start_norm = norms
    if math.isfinite(norm) and norm <= HEAD_GROWTH_LIMIT * max(start_norm, 1.0):
        return
    if settings.lam and lr_curvature(settings, omega_kk, cfg) >= stability_bound(cfg) / 2:
        advice = _remedy(settings, cfg)
    else:  # the regulariser's step contracts fast: the task's own curvature is too large for this lr
        advice = "lower lr (the regulariser's own step was stable, so the task's curvature is too large for it)"
    raise MochaDivergence(
        f"mocha: a head diverged in local training: its norm is {norm:.4g}, above {HEAD_GROWTH_LIMIT:g} × max(the "
        f"starting head's norm {start_norm:.4g}, 1) ({_described(settings, cfg)}, Ω_kk {omega_kk:.4g}): {advice}")


def _described(settings: MochaSettings, cfg: ClientConfig) -> str:
    decay = f", weight_decay {cfg.weight_decay:g}" if cfg.weight_decay else ""
    return f"lam {settings.lam:g}, eps {settings.eps:g}, lr {cfg.lr:g}, momentum {cfg.momentum:g}{decay}"


def _remedy(settings: MochaSettings, cfg: ClientConfig) -> str:
    """Values meeting lr·(lam/eps + weight_decay) < 2·(1 + momentum), the worst case Ω_kk = 1/eps, one at a time."""
    bound = stability_bound(cfg)
    lr_limit = _three_digits(bound / (settings.lam / settings.eps + cfg.weight_decay), up=False)
    room = bound / cfg.lr - cfg.weight_decay  # the regulariser curvature lam/eps the step can take
    if room <= 0:
        return f"lower lr below {lr_limit} or weight_decay (weight decay alone makes the step unstable)"
    lower = f"lower lam below {_three_digits(room * settings.eps, up=False)} or lr below {lr_limit}"
    if settings.lam / room < 1:  # eps must stay below 1
        lower = f"raise eps above {_three_digits(settings.lam / room, up=True)}, or {lower}"
    return lower + " (then lr·(lam/eps + weight_decay) < 2·(1 + momentum))"


def _three_digits(value: float, up: bool) -> str:
    """``value`` to three significant digits, rounded away from the unsafe side (up for a floor, down for a cap)."""
    scale = 10.0 ** (math.floor(math.log10(value)) - 2)
    steps = value / scale  # 0.076 / 1e-5 is 7599.999…: a relative 1e-9 keeps a three-digit value as it is
    rounded = (math.ceil(steps * (1 - 1e-9)) if up else math.floor(steps * (1 + 1e-9))) * scale
    return f"{rounded:.3g}"
