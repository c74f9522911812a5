"""Oracles shared by the algorithm tests: a least-squares federation with known optima, and hand-run helpers.

Clients hold heterogeneous least-squares objectives f_i(w) = ‖A_i w − b_i‖² / (2 n_i) (different
data, curvature and local optima) whose global optima are known in closed form: argmin Σ n_i f_i
(the pooled least-squares solution, what sample-weighted algorithms aim at) and argmin Σ f_i (what
uniform averaging aims at). They run through the same engine and algorithms as TaskModels.
"""

from __future__ import annotations

import torch
from torch import nn

from network.algorithms import build_algorithm
from network.algorithms.base import ClientConfig
from network.client import ClientData
from network.engine_sequential import EngineConfig, SequentialEngine
from network.lr_schedule import make_lr_schedule

CPU = torch.device("cpu")
DIM = 5


def least_squares_clients(sizes=(30, 30, 30, 30), seed=0, shift=None):
    """Per client (A_i, b_i). ``shift``: per-client offsets of the local optima (e.g. two clusters)."""
    generator = torch.Generator().manual_seed(seed)
    data = []
    for index, size in enumerate(sizes):
        curvature = torch.exp(0.5 * torch.randn(DIM, generator=generator, dtype=torch.float64))
        features = torch.randn(size, DIM, generator=generator, dtype=torch.float64) * curvature
        local_optimum = 3 * torch.randn(DIM, generator=generator, dtype=torch.float64)
        if shift is not None:
            local_optimum = shift[index] + 0.1 * local_optimum
        targets = features @ local_optimum + 0.1 * torch.randn(size, generator=generator, dtype=torch.float64)
        data.append((features, targets))
    return data


def pooled_optimum(data) -> torch.Tensor:
    """argmin Σ_i n_i f_i: least squares on the pooled data."""
    a, b = torch.cat([a for a, _ in data]), torch.cat([b for _, b in data])
    return torch.linalg.lstsq(a, b.unsqueeze(1)).solution.squeeze(1)


def uniform_optimum(data) -> torch.Tensor:
    """argmin Σ_i f_i: every client's mean loss counts once."""
    hessian = sum(a.T @ a / len(b) for a, b in data)
    gradient_at_zero = sum(a.T @ b / len(b) for a, b in data)
    return torch.linalg.solve(hessian, gradient_at_zero)


def max_curvature(data) -> float:
    return max(torch.linalg.eigvalsh(a.T @ a / len(a)).max().item() for a, _ in data)


def least_squares_loss(model: nn.Module, batch: dict, reduction: str = "mean") -> torch.Tensor:
    squared = 0.5 * (model(batch["x"]).squeeze(-1) - batch["y"]) ** 2
    return squared.mean() if reduction == "mean" else squared


def mean_loss(model: nn.Module, loader) -> dict[str, float]:
    batches = list(loader)
    return {"loss": float(sum(least_squares_loss(model, batch) for batch in batches) / len(batches))}


def linear_model() -> nn.Linear:
    model = nn.Linear(DIM, 1, bias=False, dtype=torch.float64)
    nn.init.zeros_(model.weight)
    return model


def oracle_clients(data) -> list[ClientData]:
    return [ClientData(str(index), len(b), lambda seed, a=a, b=b: [{"x": a, "y": b}], [{"x": a, "y": b}])
            for index, (a, b) in enumerate(data)]


def run_oracle(tmp_path, name, rounds, steps, lr, data, fraction=1.0, momentum=0.0, model=None, **settings):
    """Run ``name`` on the least-squares federation; returns (final global weight vector, engine)."""
    clients = oracle_clients(data)
    pooled = [{"x": torch.cat([a for a, _ in data]), "y": torch.cat([b for _, b in data])}]
    algorithm, worker = build_algorithm(name, model or linear_model(),
                                        {client.client_id: client.num_samples for client in clients}, settings)
    config = EngineConfig(out_dir=tmp_path / name, n_rounds=rounds, lr_schedule=make_lr_schedule("constant", lr, rounds),
                          local_steps=steps, client_fraction=fraction, eval_every=rounds, momentum=momentum,
                          progress=False, plots=False)  # the oracles read numbers, never a picture
    engine = SequentialEngine(worker, algorithm, clients, least_squares_loss, mean_loss, pooled, config, CPU)
    final = engine.run()
    return (final["weight"].squeeze(0) if "weight" in final else final), engine


def relative_error(weights, optimum) -> float:
    return float((weights - optimum).norm() / optimum.norm())


def client_config(num_samples: int, lr: float = 0.01, steps: int = 5, **overrides) -> ClientConfig:
    return ClientConfig(**{"lr": lr, "loss_fn": least_squares_loss, "device": CPU, "num_samples": num_samples,
                           "local_steps": steps, **overrides})


def gradient(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """∇ of ‖A w − b‖²/(2n) at w (a vector)."""
    return a.T @ (a @ w - b) / len(b)


class TwoLayer(nn.Module):
    """A linear body and a linear head (float64), split by name as TaskModel does."""

    def __init__(self, hidden: int = 3) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.body = nn.Linear(DIM, hidden, bias=False, dtype=torch.float64)
        self.head = nn.Linear(hidden, 1, bias=False, dtype=torch.float64)
        with torch.no_grad():
            self.body.weight.copy_(0.3 * torch.randn(hidden, DIM, generator=generator, dtype=torch.float64))
            self.head.weight.copy_(0.3 * torch.randn(1, hidden, generator=generator, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def head_keys(self) -> list[str]:
        return ["head.weight"]


def manual_sgd(weights: dict, train: set, batches: list[dict], lr: float, steps: int, extra=None) -> dict:
    """Plain SGD written out: ``steps`` steps on ``train`` entries of a TwoLayer's weights (others fixed)."""
    current = {key: value.clone().requires_grad_(key in train) for key, value in weights.items()}
    for step in range(steps):
        batch = batches[step % len(batches)]
        prediction = batch["x"] @ current["body.weight"].T @ current["head.weight"].T
        loss = 0.5 * ((prediction.squeeze(-1) - batch["y"]) ** 2).mean()
        if extra is not None:
            loss = loss + extra(current)
        grads = torch.autograd.grad(loss, [current[key] for key in sorted(train)])
        with torch.no_grad():
            for key, grad in zip(sorted(train), grads):
                current[key] -= lr * grad
    return {key: value.detach() for key, value in current.items()}


def batched_clients(batch_sizes: tuple[tuple[int, ...], ...], seed: int) -> list[list[dict]]:
    """Least-squares clients as fixed lists of distinct batches of the given sizes (what each loader yields every
    pass, in that order): for methods that read several batches a step (Per-FedAvg's D, D', D'')."""
    data = least_squares_clients(sizes=tuple(sum(sizes) for sizes in batch_sizes), seed=seed)
    return [[{"x": x, "y": y} for x, y in zip(a.split(sizes), b.split(sizes))]
            for (a, b), sizes in zip(data, batch_sizes)]


def run_batched(out_dir, name, batches, rounds, steps, lr, **settings):
    """Run ``name`` on :func:`batched_clients` through the sequential engine; returns (the final weight vector in
    numpy, the engine)."""
    clients = [ClientData(str(index), sum(len(batch["y"]) for batch in own), lambda seed, own=own: own, own)
               for index, own in enumerate(batches)]
    algorithm, worker = build_algorithm(name, linear_model(), {c.client_id: c.num_samples for c in clients}, settings)
    config = EngineConfig(out_dir=out_dir, n_rounds=rounds, lr_schedule=make_lr_schedule("constant", lr, rounds),
                          local_steps=steps, eval_every=rounds, progress=False, plots=False)
    engine = SequentialEngine(worker, algorithm, clients, least_squares_loss, mean_loss,
                              [batch for own in batches for batch in own], config, CPU)
    return engine.run()["weight"].squeeze(0).numpy(), engine


def numpy_gradient(w, batch):
    """∇ of ‖A w − b‖²/(2n) at ``w`` (a numpy vector) on one batch, in numpy."""
    a, b = batch["x"].numpy(), batch["y"].numpy()
    return a.T @ (a @ w - b) / len(b)
