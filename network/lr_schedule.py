"""The local learning rate of each round: a function of the round only, the same for every client and engine."""

from __future__ import annotations

import math
from functools import partial
from typing import Callable

from partitioning.temporal import MAX_ROUNDS
from utils.cli import floats, ints
from utils.errors import TaskHetError

# A schedule decays (or keeps) the rate: a factor above 1 would grow it geometrically over up to MAX_ROUNDS rounds.
DECAY_FACTORS = floats(0.0, 1.0, low_open=True)
STEP_PERIODS = ints(1, MAX_ROUNDS)
LR_SCHEDULE_HELP = (f"constant | cosine | exponential:RATE | step:EVERY:GAMMA (per round; RATE and GAMMA numbers in "
                    f"{DECAY_FACTORS}, EVERY an integer in {STEP_PERIODS})")


def make_lr_schedule(spec: str, init_lr: float, n_rounds: int) -> Callable[[int], float]:
    """The local learning rate of round r (1-based), the same for every client.

    ``constant``; ``cosine`` (init_lr at round 1, towards 0 at round n_rounds + 1);
    ``exponential:RATE`` (init_lr·RATE^(r−1), the original code's per-round decay);
    ``step:EVERY:GAMMA`` (init_lr·GAMMA^⌊(r−1)/EVERY⌋). Numbers are ASCII digits in the ranges of
    :data:`LR_SCHEDULE_HELP`, so every rate is finite and at most ``init_lr``.

    Raises:
        TaskHetError: an unknown form, or a number outside its range (naming ``--lr_schedule``).
    """
    name, *params = str(spec).split(":")
    where = f"--lr_schedule {spec!r}:"
    schedules = {("constant", 0): lambda: partial(_constant, init_lr), ("cosine", 0): lambda: partial(_cosine, init_lr, n_rounds),
                 ("exponential", 1): lambda: partial(_exponential, init_lr, DECAY_FACTORS.read(params[0], f"{where} RATE")),
                 ("step", 2): lambda: partial(_step, init_lr, STEP_PERIODS.read(params[0], f"{where} EVERY"),
                                              DECAY_FACTORS.read(params[1], f"{where} GAMMA"))}
    make = schedules.get((name, len(params)))
    if make is None:
        raise TaskHetError(f"--lr_schedule {spec!r} is not one of: {LR_SCHEDULE_HELP}")
    return make()


def _constant(init_lr: float, round_index: int) -> float:
    return init_lr


def _cosine(init_lr: float, n_rounds: int, round_index: int) -> float:
    return init_lr * 0.5 * (1 + math.cos(math.pi * (round_index - 1) / max(n_rounds, 1)))


def _exponential(init_lr: float, rate: float, round_index: int) -> float:
    return init_lr * rate ** (round_index - 1)


def _step(init_lr: float, every: int, gamma: float, round_index: int) -> float:
    return init_lr * gamma ** ((round_index - 1) // every)
