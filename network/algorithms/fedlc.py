"""FedLC (Zhang, Li, Li, Xu, Wu, Ding & Wu, "Federated Learning with Label Distribution Skew via Logits Calibration", ICML 2022).

Client i trains with the logit-calibrated cross-entropy instead of the task loss. From the model's
logits z(x) (the output of its Linear classifier ``head``), every class y is shifted down by a
pairwise-independent margin that grows as the class gets rarer on the client:

    z̃_y = z_y − τ·n_{i,y}^{−1/4},    L_cal(x, y) = −log softmax(z̃)_y,

n_{i,y} the client's number of training samples of class y (``ClientConfig.class_counts``, as FedRoD
reads them) and τ ``lc_tau``. By hand, ∂L_cal/∂z = softmax(z̃) − e_y: a rare class's logit is pushed
up harder while the client trains, so its bias towards its frequent classes shrinks. The shift is
subtracted from the head's output by a forward hook installed only around each local step's loss
call, so the task's own loss (label key, masks, reduction) computes the cross-entropy, and
evaluation, fine-tuning and every served model see the raw logits. The reported ``train_loss`` is
the calibrated loss the client minimises.

Choices where the paper is ambiguous:
* the paper's equation writes the softmax denominator over y' ≠ y; like FL-bench (whose author
  reports that form collapses in training) we use the full softmax, i.e. plain cross-entropy of z̃;
* a class the client holds no sample of has n^{−1/4} = ∞; its count is clamped to 1e-8 as in
  FL-bench (max(n, 1e-8)), so its logit is shifted by exactly 100·τ: finite, and such a class is
  effectively never the client's prediction while it trains;
* τ defaults to 1.0 (FL-bench's default; τ = 0 is FedAvg exactly, bit for bit).

Server: FedAvg's (sample-weighted mean of Δ, optional server optimizer). Nothing but Δ leaves a
client; its class counts stay local.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from torch import Tensor, nn

from network.aggregation import ServerOptSettings
from network.algorithms.base import ALGORITHMS, ClientConfig, ClientResult, LossFn, Weights, require
from network.algorithms.multihead import HEAD_MODULE, classifier_head
from network.algorithms.skeleton import DELTA, ModelAveraging
from network.settings import check, setting

ABSENT_COUNT = 1e-8  # FL-bench's clamp of a class count of 0: its margin is τ·(1e-8)^{−1/4} = 100·τ


@dataclass(frozen=True)
class FedLCSettings(ServerOptSettings):
    lc_tau: float = setting(1.0, "τ of the calibrated logits z_y − τ·n_y^(−1/4) (n_y: the client's samples of class y; "
                                 "0: FedAvg)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.lc_tau >= 0 and math.isfinite(self.lc_tau), "lc_tau", ">= 0", self.lc_tau)


def calibration_margins(class_counts: Iterable[int], tau: float, dtype: torch.dtype = torch.float64) -> Tensor:
    """τ·max(n_y, 1e-8)^{−1/4} per class, in ``dtype`` (the logits' dtype: a float32 margin cast up is off by ~1e-8)."""
    counts = torch.tensor([float(count) for count in class_counts], dtype=dtype)
    return tau * counts.clamp_min(ABSENT_COUNT).pow(-0.25)


@contextlib.contextmanager
def shifted_logits(head: nn.Module, margins: Tensor) -> Iterator[None]:
    """Within the block the head outputs z − margins; the hook is gone afterwards (evaluation sees raw logits)."""
    handle = head.register_forward_hook(lambda module, inputs, output: output - margins.to(output))
    try:
        yield
    finally:
        handle.remove()


def calibrated_loss(loss_fn: LossFn, head: nn.Module, margins: Tensor) -> LossFn:
    """The task loss of the calibrated logits: ``loss_fn`` itself, with the head's output shifted while it runs."""
    def loss(model: nn.Module, batch: dict, reduction: str = "mean") -> Tensor:
        with shifted_logits(head, margins):
            return loss_fn(model, batch, reduction)

    return loss


@ALGORITHMS.register("fedlc")
class FedLC(ModelAveraging):
    """Model averaging whose clients train on logits calibrated by τ·n_y^(−1/4), their own class counts."""

    name = "fedlc"
    Settings = FedLCSettings
    needs_classifier = True  # the margins are per class of a Linear classifier head
    use_when = "label distributions differ across clients (classes rare or missing on some clients)"
    dp_groups = (DELTA,)  # client-level DP: its uploads are FedAvg's (only the local loss differs)

    @classmethod
    def worker_model(cls, model: nn.Module, settings: FedLCSettings) -> nn.Module:
        classifier_head(model, cls.name)  # a dense task or a model without a Linear classifier: one line, before training
        return model

    def client_update(self, model: nn.Module, broadcast, client_state: Weights, loader: Iterable[dict],
                      cfg: ClientConfig) -> ClientResult:
        head = getattr(model, HEAD_MODULE)
        require(cfg.class_counts is not None and len(cfg.class_counts) == head.out_features,
                f"{self.name} needs each client's training class counts over {head.out_features} classes "
                "(a classification task's data), got " + ("none" if cfg.class_counts is None
                                                          else f"{len(cfg.class_counts)} classes"))
        margins = calibration_margins(cfg.class_counts, self.settings.lc_tau, head.weight.dtype).to(cfg.device)
        loss = calibrated_loss(cfg.loss_fn, head, margins)
        return super().client_update(model, broadcast, client_state, loader, dataclasses.replace(cfg, loss_fn=loss))
