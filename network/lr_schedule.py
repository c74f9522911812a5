"""The local learning rate of each round: a function of the round only, the same for every client and engine."""

from __future__ import annotations

import math
from functools import partial
from typing import Callable

from utils.errors import TaskHetError


def make_lr_schedule(spec: str, init_lr: float, n_rounds: int) -> Callable[[int], float]:
    """The local learning rate of round r (1-based), the same for every client.

    ``constant``; ``cosine`` (init_lr at round 1, towards 0 at round n_rounds + 1);
    ``exponential:RATE`` (init_lr·RATE^(r−1), the original code's per-round decay);
    ``step:EVERY:GAMMA`` (init_lr·GAMMA^⌊(r−1)/EVERY⌋).
    """
    name, *params = spec.split(":")
    try:
        values = [float(param) for param in params]
        schedules = {("constant", 0): partial(_constant, init_lr), ("cosine", 0): partial(_cosine, init_lr, n_rounds)}
        if name == "exponential" and len(values) == 1 and values[0] > 0:
            return partial(_exponential, init_lr, values[0])
        if name == "step" and len(values) == 2 and values[0] >= 1 and values[1] > 0:
            return partial(_step, init_lr, int(values[0]), values[1])
        return schedules[(name, len(values))]
    except (ValueError, KeyError):
        raise TaskHetError(f"--lr_schedule {spec!r} is not one of: constant, cosine, exponential:RATE, "
                           "step:EVERY:GAMMA") from None


def _constant(init_lr: float, round_index: int) -> float:
    return init_lr


def _cosine(init_lr: float, n_rounds: int, round_index: int) -> float:
    return init_lr * 0.5 * (1 + math.cos(math.pi * (round_index - 1) / max(n_rounds, 1)))


def _exponential(init_lr: float, rate: float, round_index: int) -> float:
    return init_lr * rate ** (round_index - 1)


def _step(init_lr: float, every: int, gamma: float, round_index: int) -> float:
    return init_lr * gamma ** ((round_index - 1) // every)
