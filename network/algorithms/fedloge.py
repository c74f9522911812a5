"""FedLoGe (Xiao et al., "FedLoGe: Joint Local and Generic Federated Learning under Long-tailed Data", ICLR 2024).

One backbone, trained through a fixed sparse equiangular-tight-frame classifier (SSE-C), serves
three models: a universal one (backbone + SSE-C), a realigned global one (backbone + the averaged
auxiliary head g_aux after GLA-FR) and one personalised model per client (backbone + its local head
l_k + the realigned auxiliary head).

SSE-C (:func:`sse_c_weight`, built once by the server from the run seed in ``init_server``):
1. the ETF M = √(C/(C−1))·P(I − 11ᵀ/C), P the orthonormal d×C factor of the QR of a seeded
   standard-normal d×C matrix (d ≥ C): unit columns, pairwise cosines exactly −1/(C−1);
2. a fraction ``beta`` of its entries is zeroed at seeded random positions;
3. the non-zeros are refined with Adam (``etf_lr``, ``etf_steps`` steps) on
   Σ_c (‖m_c‖ − 0.1)² − mean_c arccos(max_{j≠c} cos(m_c, m_j)), the zeros staying zero.
The layer never trains: its parameters have ``requires_grad`` False from the start, so the layout
marks them fixed (never uploaded, kept exactly by every server model) and no optimizer holds them.
Its bias is kept as FedLoGe keeps it: a fixed random one, drawn from the run seed like a Linear's
default bias (uniform in ±1/√d).

Local step (one phase, the local budget): z = backbone(x), then the task loss of three heads from
that one pass (``network.algorithms.multihead``): CE(SSE-C(z), y) trains the backbone only (SSE-C is
fixed); CE(g_aux(z.detach()), y) trains g_aux; CE(l_k(z.detach()), y) trains the local head l_k.
The reported ``train_loss`` is the sum of the three. Uploads: Δ of the backbone and g_aux; l_k is a
private entry (client state) and never leaves the client; the inference-mode buffer never travels.

GLA-FR, at every evaluation (the stored g_aux is not changed, training goes on from it):
* global: each g_aux row w_c ← τ·w_c/‖w_c‖ (bias unchanged);
* local: w̃_c = (w_c^aux/‖w_c^aux‖)·‖w_c^{l_k}‖, and client k predicts argmax[l_k(z) + z·w̃ᵀ]
  (w̃ carries no bias; l_k keeps its own).
The absent-class mask is not applied here: the evaluation applies the protocol's one rule to every
method alike (``network.client.AbsentClassMask``, the ``_masked`` rows).

Server models: ``global`` is the trained model (backbone, raw g_aux, SSE-C: what clients receive);
after every aggregation the server derives the two served models from it, ``realigned`` (GLA-FR's
global model) and ``universal`` (backbone + SSE-C), so both engines evaluate and send them by name.
Rows of metrics.csv: ``test`` of client ``global`` (and ``model:realigned``) is the realigned global
model, ``model:universal`` the universal SSE-C model, ``client_test_personal`` the personalised
models; ``client_test`` is the realigned global model on each client's test set; best.pt's
``model`` is the realigned global model (the worker model's entries, not a plain TaskModel's).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import Tensor, nn

from network.aggregation import ServerOptSettings
from network.algorithms.base import (ALGORITHMS, GLOBAL_MODEL, ClientConfig, ClientResult, Federation, ServerState,
                                     Upload, Weights, require)
from network.algorithms.multihead import HEAD_MODULE, MultiHead, classifier_head, copy_linear, multi_head_loss
from network.algorithms.skeleton import ModelAveraging
from network.settings import check, setting
from utils.seeding import torch_generator

UNIVERSAL, REALIGNED, PERSONAL = 0, 1, 2  # inference modes (the head's ``mode`` buffer)
# Server models: GLOBAL_MODEL is the trained one (backbone, raw g_aux, SSE-C; what clients receive); the two
# served ones are derived from it after every aggregation.
REALIGNED_MODEL, UNIVERSAL_MODEL = "realigned", "universal"
HEADS = ("sse", "aux", "local")  # trained in every local step, in this order
NORM_TARGET = 0.1  # the SSE-C refinement's target column norm (FedLoGe's)
SSE_WEIGHT, SSE_BIAS = f"{HEAD_MODULE}.sse.weight", f"{HEAD_MODULE}.sse.bias"
AUX_WEIGHT, MODE = f"{HEAD_MODULE}.aux.weight", f"{HEAD_MODULE}.mode"
LOCAL_KEYS = frozenset({f"{HEAD_MODULE}.local.weight", f"{HEAD_MODULE}.local.bias"})


@dataclass(frozen=True)
class FedLoGeSettings(ServerOptSettings):
    beta: float = setting(0.6, "SSE-C sparsity: the fraction of ETF entries set to zero, in [0, 1)")
    tau: float = setting(1.7, "GLA-FR: the norm every realigned global head row gets (> 0)")
    etf_steps: int = setting(10000, "Adam steps refining the sparse ETF's non-zeros (0: none)")
    etf_lr: float = setting(1e-4, "Adam learning rate of the SSE-C refinement")

    def __post_init__(self) -> None:
        super().__post_init__()
        check(0 <= self.beta < 1, "beta", "in [0, 1)", self.beta)
        check(self.tau > 0 and math.isfinite(self.tau), "tau", "> 0", self.tau)
        check(self.etf_steps >= 0, "etf_steps", ">= 0", self.etf_steps)
        check(self.etf_lr > 0, "etf_lr", "> 0", self.etf_lr)


# ----- SSE-C -----
def etf(dim: int, num_classes: int, generator: torch.Generator) -> Tensor:
    """M = √(C/(C−1))·P(I − 11ᵀ/C) in float64, ``[d, C]``, P from the QR of a seeded normal matrix."""
    require(num_classes >= 2 and dim >= num_classes,
            f"SSE-C needs at least 2 classes and a feature dimension >= the number of classes, got d={dim}, "
            f"C={num_classes}")
    basis, _ = torch.linalg.qr(torch.randn(dim, num_classes, generator=generator, dtype=torch.float64))
    centring = torch.eye(num_classes, dtype=torch.float64) - 1.0 / num_classes
    return math.sqrt(num_classes / (num_classes - 1)) * basis @ centring


def sparsity_mask(shape: tuple[int, int], beta: float, generator: torch.Generator) -> Tensor:
    """Bool mask with exactly round(β·numel) False entries at seeded random positions."""
    numel = shape[0] * shape[1]
    mask = torch.ones(numel, dtype=torch.bool)
    mask[torch.randperm(numel, generator=generator)[:round(beta * numel)]] = False
    return mask.view(shape)


def sse_c_objective(matrix: Tensor) -> Tensor:
    """Σ_c (‖m_c‖ − 0.1)² − mean_c arccos(max_{j≠c} cos(m_c, m_j)) over the columns m_c of ``matrix``."""
    norms = matrix.norm(dim=0)
    unit = matrix / norms.clamp_min(1e-12)
    cosines = unit.T @ unit
    cosines = cosines - 3.0 * torch.eye(cosines.shape[0], dtype=cosines.dtype)  # j ≠ c: the diagonal drops out
    nearest = cosines.max(dim=1).values.clamp(-1 + 1e-7, 1 - 1e-7)  # arccos' slope is infinite at ±1
    return ((norms - NORM_TARGET) ** 2).sum() - torch.arccos(nearest).mean()


def refine(matrix: Tensor, mask: Tensor, steps: int, lr: float) -> Tensor:
    """Adam on the non-zeros of ``matrix`` (``mask``) against :func:`sse_c_objective`; masked entries stay 0.

    Hand-written: a few lines of torch; the zeros stay exact because their gradient is exactly 0
    (the objective sees ``values·mask``), so Adam's moments and steps there are exactly 0.
    """
    values = (matrix * mask).clone().requires_grad_(True)
    optimizer = torch.optim.Adam([values], lr=lr)
    with torch.enable_grad():
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            sse_c_objective(values * mask).backward()
            optimizer.step()
    return (values * mask).detach()


def sse_c_weight(dim: int, num_classes: int, beta: float, steps: int, lr: float, seed: int,
                 device: torch.device | str = "cpu") -> Tensor:
    """The SSE-C layer's weight ``[C, d]`` (rows = classes): a seeded ETF, sparsified by β, refined on ``device``
    (the draws are on the CPU, so the matrix is the same on every device up to the refinement's rounding)."""
    matrix = etf(dim, num_classes, torch_generator(seed, "sse_c", "etf"))
    mask = sparsity_mask(matrix.shape, beta, torch_generator(seed, "sse_c", "mask"))
    return refine((matrix * mask).to(device), mask.to(device), steps, lr).T.contiguous()


def sse_c_bias(dim: int, num_classes: int, seed: int) -> Tensor:
    """FedLoGe's fixed random bias: uniform in ±1/√d (a Linear's default), from the run seed."""
    bound = 1.0 / math.sqrt(dim)
    return (torch.rand(num_classes, generator=torch_generator(seed, "sse_c", "bias"), dtype=torch.float64) * 2 - 1) * bound


# ----- GLA-FR -----
def realigned_global(weight: Tensor, tau: float) -> Tensor:
    """w_c ← τ·w_c/‖w_c‖ for every row."""
    return tau * weight / weight.norm(dim=1, keepdim=True).clamp_min(1e-12)


def realigned_local(aux_weight: Tensor, local_weight: Tensor) -> Tensor:
    """w̃_c = (w_c^aux/‖w_c^aux‖)·‖w_c^{l_k}‖: the aux direction with the local head's row norm."""
    return realigned_global(aux_weight, 1.0) * local_weight.norm(dim=1, keepdim=True)


class FedLoGeHead(MultiHead):
    """SSE-C (fixed), the global auxiliary head and the client's local head; ``mode`` picks the served model."""

    def __init__(self, head: nn.Linear) -> None:
        super().__init__()
        self.sse = copy_linear(head).requires_grad_(False)  # values set by the server (init_server)
        self.aux = copy_linear(head)
        self.local = copy_linear(head)
        self.register_buffer("mode", torch.tensor(REALIGNED))

    def collect_logits(self, features: Tensor) -> dict[str, Tensor]:
        detached = features.detach()  # g_aux and l_k learn on the features but send no gradient into them
        return {"sse": self.sse(features), "aux": self.aux(detached), "local": self.local(detached)}

    def served_logits(self, features: Tensor) -> Tensor:
        mode = int(self.mode)
        if mode == UNIVERSAL:
            return self.sse(features)
        if mode == REALIGNED:
            return self.aux(features)
        return self.local(features) + features @ realigned_local(self.aux.weight, self.local.weight).T


@ALGORITHMS.register("fedloge")
class FedLoGe(ModelAveraging):
    """Backbone trained through a fixed sparse ETF (SSE-C); GLA-FR serves a realigned global and personal heads."""

    name = "fedloge"
    use_when = "a long-tailed global class distribution, with realigned global and personal models"
    Settings = FedLoGeSettings
    personalized = True
    needs_classifier = True

    @classmethod
    def worker_model(cls, model: nn.Module, settings: FedLoGeSettings) -> nn.Module:
        head = classifier_head(model, cls.name)
        etf(head.in_features, head.out_features, torch.Generator())  # refuse a bad shape before any work
        setattr(model, HEAD_MODULE, FedLoGeHead(head))
        return model

    def __init__(self, settings: FedLoGeSettings, federation: Federation) -> None:
        super().__init__(settings, federation)
        require(SSE_WEIGHT in federation.layout.fixed_keys,
                f"{self.name} needs its worker model (FedLoGe.worker_model) with the fixed SSE-C layer")

    def private_keys(self) -> frozenset[str]:
        return LOCAL_KEYS

    def shared_keys(self) -> tuple[str, ...]:
        return tuple(key for key in super().shared_keys() if key != MODE)

    def init_server(self, weights: Weights) -> ServerState:
        classes, dim = weights[SSE_WEIGHT].shape
        seed, settings = self.federation.seed, self.settings
        sse = {SSE_WEIGHT: sse_c_weight(dim, classes, settings.beta, settings.etf_steps, settings.etf_lr, seed,
                                        weights[SSE_WEIGHT].device),
               SSE_BIAS: sse_c_bias(dim, classes, seed)}
        weights = {**weights, **{key: value.to(weights[key]) for key, value in sse.items()}}
        return self.with_served_models(super().init_server(weights))

    def client_update(self, model: nn.Module, broadcast, client_state: Weights, loader: Iterable[dict],
                      cfg: ClientConfig) -> ClientResult:
        loss = multi_head_loss(cfg.loss_fn, model, getattr(model, HEAD_MODULE), HEADS)
        return super().client_update(model, broadcast, client_state, loader, dataclasses.replace(cfg, loss_fn=loss))

    def aggregate(self, server: ServerState, uploads: Iterable[Upload]) -> ServerState:
        return self.with_served_models(super().aggregate(server, uploads))

    def with_served_models(self, server: ServerState) -> ServerState:
        """The state plus the two served models derived from the trained one (GLA-FR's global, the universal):
        server models, so that every engine evaluates and transports them by name."""
        weights = server.models[GLOBAL_MODEL]
        realigned = {**weights, AUX_WEIGHT: realigned_global(weights[AUX_WEIGHT], self.settings.tau),
                     MODE: torch.full_like(weights[MODE], REALIGNED)}
        universal = {**weights, MODE: torch.full_like(weights[MODE], UNIVERSAL)}
        return ServerState({GLOBAL_MODEL: weights, REALIGNED_MODEL: realigned, UNIVERSAL_MODEL: universal},
                           server.tensors)

    def evaluated_models(self, server: ServerState) -> dict[str, Weights]:
        return {name: server.models[name] for name in (REALIGNED_MODEL, UNIVERSAL_MODEL)}

    def personal_model(self, models: dict[str, Weights], client_state: Weights) -> Weights | None:
        if not client_state:
            return None
        weights = models[GLOBAL_MODEL]
        return {**weights, **client_state, MODE: torch.full_like(weights[MODE], PERSONAL)}
