"""Why heterogeneity biases FedAvg, on quadratics where every quantity has a closed form.

Client k holds F_k(x) = ½ (x − c_k)ᵀ A_k (x − c_k); the federation minimises
F = Σ_k p_k F_k, whose optimum is x* = (Σ p_k A_k)⁻¹ Σ p_k A_k c_k. One FedAvg round
(full participation, E full-batch gradient steps of size η per client, plain averaging)
maps the global model x to

    x' = Σ_k p_k [c_k + M_k (x − c_k)],   M_k = (I − η A_k)^E,

an affine map whose fixed point x_∞ = (I − M̄)⁻¹ Σ_k p_k (I − M_k) c_k (M̄ = Σ p_k M_k)
is where FedAvg ends however many rounds it runs. Two facts follow and the explainer shows
them: with one local step (E = 1) FedAvg *is* gradient descent on F, so x_∞ = x*; with
E > 1 and clients that disagree at x* (gradient dissimilarity G² = Σ p_k ‖∇F_k(x*)‖² > 0)
x_∞ ≠ x*, and the squared distance grows like η²E²G² for small η — the bias term of
FedAvg's convergence bounds. Equal curvatures (A_k = A for all k) make M_k equal and
x_∞ = x* again, so the worked example gives each client a stiffer direction of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from network.heterogeneity import dissimilarity
from utils.cli import floats
from utils.errors import TaskHetError

# The worked example's scale s (client optima s·e_k): G² grows as s², and every distance and G² stays a finite
# float for s up to 10^6 (explain_heterogeneity.py --scales).
MAX_SCALE = 1e6
SCALES = floats(0.0, MAX_SCALE, low_open=True)


@dataclass(frozen=True)
class QuadraticFederation:
    """Clients' Hessians ``hessians[k]`` (d×d, symmetric positive definite), optima ``optima[k]`` (d) and weights p_k."""

    hessians: tuple[np.ndarray, ...]
    optima: tuple[np.ndarray, ...]
    weights: np.ndarray

    @property
    def dim(self) -> int:
        return len(self.optima[0])

    def mean_hessian(self) -> np.ndarray:
        return sum(p * a for p, a in zip(self.weights, self.hessians))

    def largest_curvature(self) -> float:
        """L_max: local gradient descent is stable for η < 2 / L_max."""
        return max(float(np.linalg.eigvalsh(a).max()) for a in self.hessians)


def worked_example(scale: float = 1.0, stiffness: float = 3.0) -> QuadraticFederation:
    """K = 4 clients in R⁴ with optima ``scale``·e_1..e_4 and Hessians I + ``stiffness``·e_k e_kᵀ, equal weights.

    Client k is stiffer along its own optimum's direction; with equal Hessians FedAvg would
    have no fixed-point bias at all (see the module docstring).
    """
    if not SCALES.contains(scale):
        raise TaskHetError(f"the worked example's scale must be in {SCALES}, got {scale!r}")
    eye = np.eye(4)
    hessians = tuple(eye + stiffness * np.outer(eye[k], eye[k]) for k in range(4))
    return QuadraticFederation(hessians, tuple(scale * eye[k] for k in range(4)), np.full(4, 0.25))


def iid_control(federation: QuadraticFederation) -> QuadraticFederation:
    """Every client holds the global loss F itself: same Hessian Σ p_k A_k and optimum x*, so G² = 0."""
    hessian, optimum = federation.mean_hessian(), global_optimum(federation)
    count = len(federation.hessians)
    return QuadraticFederation((hessian,) * count, (optimum,) * count, federation.weights)


def global_optimum(federation: QuadraticFederation) -> np.ndarray:
    """x* = (Σ p_k A_k)⁻¹ Σ p_k A_k c_k."""
    pulled = sum(p * a @ c for p, a, c in zip(federation.weights, federation.hessians, federation.optima))
    return np.linalg.solve(federation.mean_hessian(), pulled)


def client_gradients(federation: QuadraticFederation, x: np.ndarray) -> list[np.ndarray]:
    """∇F_k(x) = A_k (x − c_k) for every client."""
    return [a @ (x - c) for a, c in zip(federation.hessians, federation.optima)]


def gradient_dissimilarity(federation: QuadraticFederation) -> float:
    """G² = Σ p_k ‖∇F_k(x*) − ∇F(x*)‖² at the global optimum (∇F(x*) = 0), via the meter's own formula."""
    gradients = [torch.from_numpy(g) for g in client_gradients(federation, global_optimum(federation))]
    return dissimilarity(gradients, list(federation.weights)).g2


def round_map(federation: QuadraticFederation, eta: float, local_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """(M̄, b) with one FedAvg round x' = M̄ x + b (E = ``local_steps`` full-batch steps of size ``eta``)."""
    eye = np.eye(federation.dim)
    local = [np.linalg.matrix_power(eye - eta * a, local_steps) for a in federation.hessians]
    mean_map = sum(p * m for p, m in zip(federation.weights, local))
    offset = sum(p * (eye - m) @ c for p, m, c in zip(federation.weights, local, federation.optima))
    return mean_map, offset


def fixed_point(federation: QuadraticFederation, eta: float, local_steps: int) -> np.ndarray:
    """x_∞ = (I − M̄)⁻¹ b: where FedAvg with these settings ends."""
    mean_map, offset = round_map(federation, eta, local_steps)
    return np.linalg.solve(np.eye(federation.dim) - mean_map, offset)


def run_fedavg(federation: QuadraticFederation, eta: float, local_steps: int, rounds: int,
               start: np.ndarray | None = None) -> np.ndarray:
    """Simulate FedAvg step by step (no closed form): the global model after each round, shape [rounds + 1, d]."""
    x = np.zeros(federation.dim) if start is None else np.asarray(start, dtype=float)
    trajectory = [x]
    for _ in range(rounds):
        updates = []
        for a, c in zip(federation.hessians, federation.optima):
            local = x.copy()
            for _ in range(local_steps):
                local = local - eta * a @ (local - c)
            updates.append(local)
        x = sum(p * u for p, u in zip(federation.weights, updates))
        trajectory.append(x)
    return np.stack(trajectory)
