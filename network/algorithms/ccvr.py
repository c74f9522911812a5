"""CCVR (Luo, Chen, Hu, Zhang, Liang & Feng, "No Fear of Heterogeneity: Classifier Calibration for Federated Learning with Non-IID Data", NeurIPS 2021).

Training is FedAvg's (sample-weighted mean of Δ, optional server optimizer). On top of it the server
serves a *calibrated* model: the same backbone with its Linear classifier ``head`` retrained on
virtual representations drawn from the clients' class-conditional feature statistics.

Client k, every round, after its local training: with the model it RECEIVED (x_t, in eval mode, no
gradient, one extra pass over its training data) it takes the head's input z = f(x) of every sample
and, for every class c it holds, uploads N_{c,k} (its samples of c), μ_{c,k} (their mean feature)
and Σ_{c,k} (their unbiased covariance, 1/(N_{c,k}−1)·Σ(z−μ)(z−μ)ᵀ; 0 when N_{c,k} = 1), besides Δ.
Nothing else leaves the client: no feature, no sample, only these per-class moments (the paper's
privacy note). The label of a sample is read from the task's own loss, so its label key and masks
are the task's: at all-zero logits the cross-entropy's gradient is 1/C − e_y, whose argmin is y; a
sample the loss ignores (zero gradient) is left out.

Server, after FedAvg's step, from the uploads of the round (the paper's Eq. for the global moments):

    N_c = Σ_k N_{c,k},   μ_c = Σ_k (N_{c,k}/N_c)·μ_{c,k},
    Σ_c = Σ_k (N_{c,k}−1)/(N_c−1)·Σ_{c,k} + Σ_k N_{c,k}/(N_c−1)·μ_{c,k}μ_{c,k}ᵀ − N_c/(N_c−1)·μ_cμ_cᵀ,

exactly the mean and unbiased covariance of the pooled features (accumulated one upload at a time as
Σ_k N_{c,k}μ_{c,k} and Σ_k [(N_{c,k}−1)Σ_{c,k} + N_{c,k}μ_{c,k}μ_{c,k}ᵀ]). It draws M_c = ``num_virtual``
virtual features per class from N(μ_c, Σ_c) (μ_c + ε·(V·√Λ)ᵀ with Σ_c = VΛVᵀ, ε standard normal,
negative rounding eigenvalues clamped to 0, so a singular Σ_c is fine), and retrains the head
(weight and bias, nothing else) from x_t's head: ``calib_epochs`` epochs of minibatch SGD
(``calib_batch``, ``calib_lr``, momentum ``calib_momentum``, torch.optim.SGD's rule) on the mean
cross-entropy of the virtual features, reshuffled every epoch. ``covariance diagonal`` uploads and
pools only the variances (d numbers per class instead of d²) and draws with a diagonal Σ_c. The draws
and the shuffles come from generators seeded by the run seed and the round (a counter in the server
tensors), so a resumed run and both engines draw the same.

Served models (``evaluated_models``, the first is the one reports, best.pt and the client splits use):
``calibrated`` = the backbone of x_t — the model the statistics of round t were computed with, i.e.
the global model BEFORE round t's aggregation — plus the calibrated head; ``global`` = x_{t+1}, the
FedAvg model clients train from (the calibration never feeds back into training, as in the paper's
post-hoc calibration). The engines have no "after the last round" hook, so the paper's one final
calibration becomes a calibration every round, one round behind the trained model; before round 1
``calibrated`` is the initial model.

Choices where the paper is ambiguous or an engine constraint applies:
* the statistics of round t are those of the clients sampled in round t (all clients with
  ``--client_fraction 1``, the paper's setting);
* a class no sampled client holds gets no virtual features: its head row is moved only as a
  negative class of the others; a class with N_c = 1 has Σ_c = 0 (every virtual feature is μ_c);
  a round without any statistics keeps the previous calibrated model;
* defaults: M_c = 2000, 10 epochs, batch 64, lr 0.001, momentum 0.9 follow the public re-implementation
  smduan/Fed-CCVR (``retrain``: num_vr 2000, epoch 10, lr 0.001, its SGD momentum 0.9); they were not
  checked against the paper's appendix. The virtual set holds C·M_c·d numbers on the server;
* the per-class counts reveal each client's exact size, so under ``weighting bucketed`` or ``noisy``
  CCVR does NOT keep n_k private (the paper's statistics need the counts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import Tensor, nn

from network.aggregation import ServerOptSettings
from network.algorithms.base import (ALGORITHMS, GLOBAL_MODEL, ClientConfig, ClientResult, Federation, LossFn,
                                     ServerState, Upload, Weights, load_weights, require)
from network.algorithms.multihead import HEAD_MODULE, classifier_head
from network.algorithms.skeleton import ModelAveraging
from network.settings import check, setting
from utils.device import to_device
from utils.seeding import torch_generator

STATS = "stats"  # upload group: the per-class feature moments of the received model
CALIBRATED_MODEL = "calibrated"  # served: x_t's backbone + the head calibrated on virtual features
ROUND = "ccvr/round"  # server tensor: the number of aggregations so far (seeds each round's draws)
COVARIANCES = ("full", "diagonal")
HEAD_WEIGHT, HEAD_BIAS = f"{HEAD_MODULE}.weight", f"{HEAD_MODULE}.bias"


@dataclass(frozen=True)
class CCVRSettings(ServerOptSettings):
    num_virtual: int = setting(2000, "M_c: virtual features drawn per class for the head's calibration",
                               high=100_000)  # the server holds C·M_c·d numbers
    calib_epochs: int = setting(10, "epochs of SGD over the virtual features (0: the calibrated model is the "
                                    "uncalibrated one)", high=1000)
    calib_batch: int = setting(64, "minibatch size of the calibration SGD")
    calib_lr: float = setting(0.001, "learning rate of the calibration SGD")
    calib_momentum: float = setting(0.9, "momentum of the calibration SGD")
    covariance: str = setting("full", "class covariances uploaded, pooled and sampled: full (d×d) or diagonal (the "
                                      "variances only)", choices=COVARIANCES)

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.num_virtual >= 1, "num_virtual", ">= 1", self.num_virtual)
        check(self.calib_epochs >= 0, "calib_epochs", ">= 0", self.calib_epochs)
        check(self.calib_batch >= 1, "calib_batch", ">= 1", self.calib_batch)
        check(self.calib_lr > 0, "calib_lr", "> 0", self.calib_lr)
        check(0 <= self.calib_momentum < 1, "calib_momentum", "in [0, 1)", self.calib_momentum)
        check(self.covariance in COVARIANCES, "covariance", f"one of {', '.join(COVARIANCES)}", self.covariance)


# ----- client: the per-class moments of the received model -----
def probe_labels(model: nn.Module, batch: dict, loss_fn: LossFn) -> tuple[Tensor, Tensor]:
    """Each sample's label and whether the task loss counts it, read from ``loss_fn`` at all-zero logits.

    The model runs once, without gradient (a hook on the head may record its input); the loss sees zero logits
    of the model's shape, whose cross-entropy gradient is 1/C − e_y (times the sample's weight): negative only at y.
    """
    probes: list[Tensor] = []

    def zero_logits(inputs: Tensor):
        with torch.no_grad():
            output = model(inputs)
        logits = output[0] if isinstance(output, tuple) else output
        probes.append(torch.zeros_like(logits, requires_grad=True))
        return (probes[-1], *output[1:]) if isinstance(output, tuple) else probes[-1]

    with torch.enable_grad():
        per_sample = loss_fn(zero_logits, batch, reduction="none")
        require(len(probes) == 1, f"ccvr reads labels from one model call per batch, the task loss made {len(probes)}")
        (slope,) = torch.autograd.grad(per_sample.sum(), probes[0])
    return slope.argmin(dim=1), slope.min(dim=1).values < 0


def labelled_features(model: nn.Module, loader: Iterable[dict], cfg: ClientConfig) -> tuple[Tensor, Tensor]:
    """The head's input (float64) and label of every counted training sample, with the model in eval mode."""
    head = getattr(model, HEAD_MODULE)
    captured: list[Tensor] = []
    handle = head.register_forward_pre_hook(lambda module, inputs: captured.append(inputs[0].detach()))
    was_training = model.training
    model.eval()  # the model's inference features: no dropout, BatchNorm's running statistics untouched
    features, labels = [], []
    try:
        for batch in loader:
            label, counted = probe_labels(model, to_device(batch, cfg.device), cfg.loss_fn)
            feature = captured.pop()
            require(feature.dim() == 2, f"ccvr needs [batch, features] at the head's input, got {tuple(feature.shape)}")
            where = torch.device("cpu") if feature.device.type == "mps" else feature.device  # MPS has no float64
            features.append(feature[counted].to(where, torch.float64))
            labels.append(label[counted].to(where))
    finally:
        handle.remove()
        model.train(was_training)
    return torch.cat(features), torch.cat(labels)


def class_moments(features: Tensor, labels: Tensor, diagonal: bool) -> Weights:
    """``count.c``, ``mean.c`` and ``cov.c`` (``var.c`` when ``diagonal``) of every class c present: N, μ and the
    unbiased covariance (0 for a single sample)."""
    moments = {}
    for label in labels.unique().tolist():
        mine = features[labels == label]
        count, mean = len(mine), mine.mean(dim=0)
        centred = mine - mean
        spread = (centred * centred).sum(dim=0) if diagonal else centred.T @ centred
        moments.update({f"count.{label}": torch.tensor(count, device=mean.device), f"mean.{label}": mean,
                        f"{'var' if diagonal else 'cov'}.{label}": spread / max(count - 1, 1)})
    return moments


# ----- server: pooled moments, virtual features, the head's SGD -----
class PooledMoments:
    """The global per-class mean and covariance of the round's uploads, folded one upload at a time."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.first: dict[int, Tensor] = {}  # Σ_k N_{c,k}·μ_{c,k}
        self.second: dict[int, Tensor] = {}  # Σ_k (N_{c,k}−1)·Σ_{c,k} + N_{c,k}·μ_{c,k}μ_{c,k}ᵀ (diagonal: elementwise)

    def add(self, moments: Weights) -> None:
        for key, value in moments.items():
            if not key.startswith("count.") or int(value) == 0:  # a zero count carries nothing (and no division)
                continue
            label, count = int(key.split(".")[1]), int(value)
            mean = moments[f"mean.{label}"].double()
            diagonal = f"var.{label}" in moments
            spread = moments[f"var.{label}" if diagonal else f"cov.{label}"].double()
            outer = mean * mean if diagonal else torch.outer(mean, mean)
            self.counts[label] = self.counts.get(label, 0) + count
            self.first[label] = self.first.get(label, 0) + count * mean
            self.second[label] = self.second.get(label, 0) + (count - 1) * spread + count * outer

    def gaussians(self) -> dict[int, tuple[Tensor, Tensor]]:
        """Class -> (μ_c, Σ_c) in float64, in class order; Σ_c = 0 for a class with one sample in all."""
        result = {}
        for label in sorted(self.counts):
            count = self.counts[label]
            mean = self.first[label] / count
            outer = mean * mean if self.second[label].dim() == 1 else torch.outer(mean, mean)
            spread = (self.second[label] - count * outer) / (count - 1) if count > 1 else torch.zeros_like(outer)
            result[label] = (mean, spread)
        return result


def virtual_features(gaussians: dict[int, tuple[Tensor, Tensor]], per_class: int,
                     generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``per_class`` draws of N(μ_c, Σ_c) per class (float64, the moments' device) and their labels, class by class.

    Σ_c a vector is a diagonal covariance. ε is drawn on the CPU from ``generator`` (the same on every device).
    """
    features, labels = [], []
    for label, (mean, spread) in gaussians.items():
        noise = torch.randn(per_class, len(mean), generator=generator, dtype=torch.float64).to(mean.device)
        if spread.dim() == 1:
            features.append(mean + noise * spread.clamp_min(0).sqrt())
        else:
            eigenvalues, eigenvectors = torch.linalg.eigh(spread)
            features.append(mean + noise @ (eigenvectors * eigenvalues.clamp_min(0).sqrt()).T)
        labels.append(torch.full((per_class,), label, dtype=torch.long, device=mean.device))
    return torch.cat(features), torch.cat(labels)


def minibatches(count: int, batch: int, epochs: int, generator: torch.Generator) -> list[Tensor]:
    """Index batches of ``epochs`` passes over ``count`` samples, each pass a fresh permutation cut into ``batch``es."""
    return [part for _ in range(epochs) for part in torch.randperm(count, generator=generator).split(batch)]


def calibrate_head(head: Weights, features: Tensor, labels: Tensor, batches: list[Tensor], lr: float,
                   momentum: float) -> Weights:
    """The head's entries after SGD (torch.optim.SGD's momentum) on the mean cross-entropy of each index batch."""
    params = {key: value.detach().clone().requires_grad_(True) for key, value in head.items()}
    optimizer = torch.optim.SGD(list(params.values()), lr=lr, momentum=momentum)
    features, labels = features.to(params[HEAD_WEIGHT]), labels.to(params[HEAD_WEIGHT].device)
    with torch.enable_grad():
        for index in batches:
            index = index.to(features.device)
            logits = features[index] @ params[HEAD_WEIGHT].T
            if HEAD_BIAS in params:
                logits = logits + params[HEAD_BIAS]
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(logits, labels[index]).backward()
            optimizer.step()
    return {key: value.detach() for key, value in params.items()}


@ALGORITHMS.register("ccvr")
class CCVR(ModelAveraging):
    """FedAvg whose served head is recalibrated on virtual features drawn from the clients' per-class statistics."""

    name = "ccvr"
    Settings = CCVRSettings
    needs_classifier = True  # the calibrated layer is a Linear classifier head
    use_when = "label skew biases the classifier head more than the features (post-hoc head calibration)"

    @classmethod
    def worker_model(cls, model: nn.Module, settings: CCVRSettings) -> nn.Module:
        classifier_head(model, cls.name)  # a dense task or a model without a Linear classifier: one line, before training
        return model

    def __init__(self, settings: CCVRSettings, federation: Federation) -> None:
        super().__init__(settings, federation)
        self.head_keys = tuple(key for key in (HEAD_WEIGHT, HEAD_BIAS) if key in federation.layout.state_keys)
        require(HEAD_WEIGHT in self.head_keys and not set(self.head_keys) & federation.layout.fixed_keys,
                f"{self.name} calibrates a trainable Linear '{HEAD_MODULE}' head, the model has none")

    def init_server(self, weights: Weights) -> ServerState:
        state = super().init_server(weights)
        calibrated = {key: value.detach().clone() for key, value in weights.items()}  # before round 1: uncalibrated
        return ServerState({GLOBAL_MODEL: weights, CALIBRATED_MODEL: calibrated},
                           {**state.tensors, ROUND: torch.tensor(0, dtype=torch.long)})

    def client_update(self, model: nn.Module, broadcast, client_state: Weights, loader: Iterable[dict],
                      cfg: ClientConfig) -> ClientResult:
        result = super().client_update(model, broadcast, client_state, loader, cfg)  # FedAvg's training, unchanged
        load_weights(model, broadcast[GLOBAL_MODEL])  # the moments are those of the received model x_t
        features, labels = labelled_features(model, loader, cfg)
        result.upload[STATS] = class_moments(features, labels, self.settings.covariance == "diagonal")
        return result

    def aggregate(self, server: ServerState, uploads: Iterable[Upload]) -> ServerState:
        pooled = PooledMoments()

        def folding() -> Iterable[Upload]:  # one pass over the stream: the moments are folded as Δ is averaged
            for upload in uploads:
                pooled.add(upload.tensors[STATS])
                yield upload

        trained = super().aggregate(server, folding())
        round_index = int(server.tensors[ROUND]) + 1
        received = server.models[GLOBAL_MODEL]  # x_t: the model every upload's moments were computed with
        calibrated = (self.calibrated_model(received, pooled, round_index) if pooled.counts
                      else server.models[CALIBRATED_MODEL])
        return ServerState({GLOBAL_MODEL: trained.models[GLOBAL_MODEL], CALIBRATED_MODEL: calibrated},
                           {**trained.tensors, ROUND: torch.full_like(server.tensors[ROUND], round_index)})

    def calibrated_model(self, weights: Weights, pooled: PooledMoments, round_index: int) -> Weights:
        """``weights`` with its head retrained on virtual features of the pooled moments (draws seeded by the round)."""
        settings, seed = self.settings, self.federation.seed
        features, labels = virtual_features(pooled.gaussians(), settings.num_virtual,
                                            torch_generator(seed, "ccvr", "virtual", round_index))
        batches = minibatches(len(labels), settings.calib_batch, settings.calib_epochs,
                              torch_generator(seed, "ccvr", "order", round_index))
        head = calibrate_head({key: weights[key] for key in self.head_keys}, features, labels, batches,
                              settings.calib_lr, settings.calib_momentum)
        return {**weights, **{key: value.to(weights[key]) for key, value in head.items()}}

    def evaluated_models(self, server: ServerState) -> dict[str, Weights]:
        return {name: server.models[name] for name in (CALIBRATED_MODEL, GLOBAL_MODEL)}
