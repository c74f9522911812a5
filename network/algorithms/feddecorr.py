"""FedDecorr (Yujun Shi, Jian Liang, Wenqing Zhang, Vincent Y. F. Tan & Song Bai, "Towards Understanding and
Mitigating Dimensional Collapse in Heterogeneous Federated Learning", ICLR 2023).

Local loss per batch of N representations z_1..z_N ∈ R^d (the paper's Sec. 4):

    ℓ = ℓ_task + β·L_FedDecorr,   L_FedDecorr = (1/d²)·‖K‖_F²,   K = (1/N)·Ẑᵀ Ẑ,

Ẑ the batch's representations with every dimension standardised over the batch: ẑ_ij = (z_ij − μ_j)/√(σ_j² + ε),
μ_j = (1/N)·Σ_i z_ij, σ_j² = (1/N)·Σ_i (z_ij − μ_j)² (the biased variance, so K is the batch's correlation matrix:
K_jj = σ_j²/(σ_j² + ε) ≈ 1), ε = 1e-8 (the authors' code's). Upload: Δ = y − x of the model; server: FedAvg's
sample-weighted mean and server optimizer (``ModelAveraging``). β = 0 is FedAvg exactly.

Choices and where the authors' code (bytedance/FedDecorr, loss.py) differs:

* The paper's term is implemented. The code instead standardises with the unbiased variance, takes ẐᵀẐ without 1/N,
  averages the squares of its d(d−1) off-diagonal entries only, and divides by N: L_code =
  ((N−1)²/N)·Σ_{j≠k} K_jk²/(d(d−1)). The diagonal of the paper's ‖K‖_F² is ≈ d, constant (its gradient is O(ε)), so
  both push the same off-diagonal correlations to 0, but the code's term is ≈ (N − 2)·d/(d − 1) times larger: β = 0.1
  in the authors' scripts (every dataset) with batch 64 weighs like β ≈ 6 here.
* z (``network.algorithms.representation``): the pooled encoder output of a TaskModel (the code's "features", the
  backbone's pooled output that feeds the classifier), the head's input otherwise; a frozen encoder is refused.
* A batch of one sample has no correlation to measure (σ = 0, Ẑ = 0): the term is 0 with no gradient, as in the
  code (which returns 0 for N = 1; its unbiased variance would divide by 0).
* β >= 0, default 0.1 (the value of every run script of the authors' code); above 1 is allowed, since the code's
  term is about (N − 2)·d/(d − 1) times the paper's (above).
* ‖K‖_F² is computed as ‖ẐẐᵀ‖_F²/N² when N < d (the same number: ‖AᵀA‖_F = ‖AAᵀ‖_F), so the cost is N²·d, not N·d².
"""

from __future__ import annotations

import math

from dataclasses import dataclass

from torch import Tensor, nn

from network.aggregation import ServerOptSettings
from network.algorithms.base import ALGORITHMS, Bundle, ClientConfig, Weights
from network.algorithms.representation import RepresentationAveraging, RepresentationTap
from network.algorithms.skeleton import DELTA, Phase
from network.settings import check, setting

EPS = 1e-8  # ε under the square root of the standardisation (the authors' code's)


@dataclass(frozen=True)
class FedDecorrSettings(ServerOptSettings):
    beta: float = setting(0.1, "weight β of the decorrelation term (1/d²)·‖K‖_F², >= 0")

    def __post_init__(self) -> None:
        super().__post_init__()
        check(0 <= self.beta and math.isfinite(self.beta), "beta", ">= 0", self.beta)


def decorrelation_loss(z: Tensor) -> Tensor:
    """(1/d²)·‖K‖_F² of a batch of representations ``[N, d]``; 0 for a batch of one."""
    samples, dims = z.shape
    if samples < 2:
        return z.new_zeros(())
    centred = z - z.mean(dim=0)
    standardised = centred / (centred.pow(2).mean(dim=0) + EPS).sqrt()  # biased σ²: K is the correlation matrix
    # ‖ẐᵀẐ‖_F = ‖ẐẐᵀ‖_F: the N×N Gram matrix when the batch is smaller than d (N·d² flops become N²·d: a 4096-d
    # representation at batch 32 cost 12× a FedAvg step the d×d way)
    gram = standardised @ standardised.T if samples < dims else standardised.T @ standardised
    return (gram / samples).pow(2).sum() / dims**2


class DecorrelationTerm:
    """An ``extra_loss``: β·L_FedDecorr of this step's representations."""

    def __init__(self, tap: RepresentationTap, beta: float) -> None:
        self.tap, self.beta = tap, beta

    def __call__(self, _: nn.Module) -> Tensor:
        return self.beta * decorrelation_loss(self.tap.take())


@ALGORITHMS.register("feddecorr")
class FedDecorr(RepresentationAveraging):
    """Model averaging whose clients decorrelate their representation's dimensions (‖correlation‖_F² penalty)."""

    name = "feddecorr"
    Settings = FedDecorrSettings
    verb = "decorrelated"
    use_when = "label skew collapses each client's representation into a few dimensions"
    dp_groups = (DELTA,)  # client-level DP: its uploads are FedAvg's (only the local loss differs)

    def phases(self, model: nn.Module, broadcast: Bundle, client_state: Weights, cfg: ClientConfig) -> list[Phase]:
        if self.settings.beta == 0:
            return [Phase()]
        return [Phase(extra_loss=DecorrelationTerm(cfg.loss_fn, self.settings.beta))]
