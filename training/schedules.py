"""Step 2's optimizers and per-epoch learning-rate schedules, built from torch.optim.

A schedule is stepped once per epoch, after the epoch, so epoch ``e`` (1-based) trains
with the rate below (``lr`` the initial rate, ``w`` the warmup epochs, ``k = e - 1 - w``
the epochs since the warmup ended):

- warmup (``e <= w``): ``lr * e / (w + 1)``, a straight line that reaches ``lr`` at epoch ``w + 1``;
- ``none``: ``lr``;
- ``cosine``: ``lr * (1 + cos(pi * k / (n_epochs - w))) / 2`` (never quite 0);
- ``step``: ``lr * gamma ** floor(k / step_size)``;
- ``exponential``: ``lr * decay_rate ** k``.

Each is torch's own scheduler (CosineAnnealingLR, StepLR, ExponentialLR), behind a
LinearLR joined by SequentialLR when there is a warmup, so a checkpoint's
``scheduler.state_dict()`` resumes it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import (CosineAnnealingLR, ExponentialLR, LinearLR, LRScheduler, SequentialLR,
                                      StepLR)

from utils.errors import TaskHetError
from utils.registry import Registry

OPTIMIZERS = ("sgd", "adamw")


@dataclass(frozen=True)
class ScheduleConfig:
    """What a schedule needs besides the optimizer.

    Attributes:
        n_epochs: epochs of the run, warmup included.
        warmup_epochs: epochs of linear warmup before the schedule (0 = none).
        step_size: the step schedule's epochs between decays.
        gamma: the step schedule's factor per decay.
        decay_rate: the exponential schedule's factor per epoch.
    """

    n_epochs: int
    warmup_epochs: int = 0
    step_size: int = 10
    gamma: float = 0.1
    decay_rate: float = 0.95


# name -> builder of the schedule after the warmup (None: a constant rate)
SCHEDULERS: Registry[Callable[[Optimizer, ScheduleConfig], LRScheduler | None]] = Registry("scheduler")


@SCHEDULERS.register("none")
def _constant(optimizer: Optimizer, config: ScheduleConfig) -> None:
    return None


@SCHEDULERS.register("cosine")
def _cosine(optimizer: Optimizer, config: ScheduleConfig) -> LRScheduler:
    return CosineAnnealingLR(optimizer, T_max=config.n_epochs - config.warmup_epochs)


@SCHEDULERS.register("step")
def _step(optimizer: Optimizer, config: ScheduleConfig) -> LRScheduler:
    return StepLR(optimizer, step_size=config.step_size, gamma=config.gamma)


@SCHEDULERS.register("exponential")
def _exponential(optimizer: Optimizer, config: ScheduleConfig) -> LRScheduler:
    return ExponentialLR(optimizer, gamma=config.decay_rate)


def list_schedulers() -> list[str]:
    """Registered schedule names, sorted."""
    return SCHEDULERS.names()


def make_scheduler(optimizer: Optimizer, name: str, config: ScheduleConfig) -> LRScheduler | None:
    """The per-epoch schedule ``name`` over ``optimizer``, behind ``config.warmup_epochs`` of linear warmup.

    Returns:
        The scheduler, or None for a constant rate without warmup.

    Raises:
        TaskHetError: an unknown name, or a warmup that leaves no epoch to the schedule (naming the flags).
    """
    build = SCHEDULERS.get(name)
    warmup = config.warmup_epochs
    if warmup and warmup >= config.n_epochs:
        raise TaskHetError(f"--warmup_epochs {warmup} must be below --n_epochs {config.n_epochs}")
    if not warmup:
        return build(optimizer, config)
    ramp = LinearLR(optimizer, start_factor=1.0 / (warmup + 1), end_factor=1.0, total_iters=warmup)
    after = build(optimizer, config)
    if after is None:  # LinearLR stays at end_factor once its ramp is over
        return ramp
    return SequentialLR(optimizer, schedulers=[ramp, after], milestones=[warmup])


def make_optimizer(name: str, parameters: Iterable[torch.nn.Parameter], lr: float, weight_decay: float,
                   momentum: float = 0.9) -> Optimizer:
    """``sgd`` (with ``momentum``) or ``adamw`` over ``parameters``; an unknown name is a TaskHetError."""
    if name == "adamw":
        return torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(parameters, lr=lr, momentum=momentum, weight_decay=weight_decay)
    raise TaskHetError(f"unknown optimizer {name!r}; choose one of: {', '.join(OPTIMIZERS)}")


def learning_rates(name: str, config: ScheduleConfig, lr: float = 1.0) -> list[float]:
    """The rate each epoch 1..n_epochs trains with under schedule ``name`` (for plots, reports and tests)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = make_scheduler(optimizer, name, config)
    rates = []
    for _ in range(config.n_epochs):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()  # a no-op (no gradients); torch warns about a schedule stepped before its optimizer
        if scheduler is not None:
            scheduler.step()
    return rates
