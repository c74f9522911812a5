"""Unequal local work: each client's own number of local steps per round (stragglers, or steps drawn per client).

Real federations do not train alike: a phone on battery does fewer steps than a server. FedNova exists for this
setting, and FL-bench offers it as a straggler ratio. Two seeded ways to set it, fixed for the whole run and
recorded in clients.csv (``local_step_budget``):

* stragglers: a share ``straggler_fraction`` of the clients (``floor(F·K + 1/2)`` of K clients, drawn once from the
  run seed) take ``max(1, floor(S·J))`` steps, S = ``straggler_share``; the others take J (``--local_steps``);
* a range ``LOW:HIGH``: every client's steps are drawn once, uniformly from the integers LOW..HIGH (both included),
  from the run seed.

Clients are drawn in sorted-id order, so the budgets depend on the seed and the ids only, never on the engine, the
order of the assignment file or the machine. Unequal work counts steps: with ``--local_epochs`` the clients' steps
already differ with their sizes, so combining the two is refused.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable

from utils.errors import TaskHetError
from utils.seeding import numpy_rng

RANGE_PATTERN = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$", re.ASCII)  # ASCII digits only, as every number flag


@dataclass(frozen=True)
class LocalWork:
    """How local steps differ between clients (the defaults: every client takes ``--local_steps``).

    Attributes:
        straggler_fraction: share of the clients that are stragglers, in [0, 1].
        straggler_share: share of the local steps a straggler takes, in (0, 1].
        steps_range: ``(LOW, HIGH)``: each client's steps drawn once from LOW..HIGH; None: not drawn.
    """

    straggler_fraction: float = 0.0
    straggler_share: float = 0.5
    steps_range: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.straggler_fraction <= 1:
            raise TaskHetError(f"--straggler_fraction must be in [0, 1], got {self.straggler_fraction}")
        if not 0 < self.straggler_share <= 1:
            raise TaskHetError(f"--straggler_share must be in (0, 1], got {self.straggler_share}")
        if self.steps_range is not None:
            low, high = self.steps_range
            if not 1 <= low <= high:
                raise TaskHetError(f"--local_steps_range must be LOW:HIGH with 1 <= LOW <= HIGH, got {low}:{high}")
            if self.straggler_fraction > 0:
                raise TaskHetError("pass one of --straggler_fraction and --local_steps_range, not both")

    @property
    def is_equal(self) -> bool:
        """Whether every client takes the same steps (no straggler, no range)."""
        return self.straggler_fraction == 0 and self.steps_range is None


def parse_steps_range(text: str | None) -> tuple[int, int] | None:
    """``"LOW:HIGH"`` -> ``(LOW, HIGH)`` (None stays None); anything else is one error naming the flag."""
    if text is None or text == "":
        return None
    match = RANGE_PATTERN.match(str(text))
    if match is None:
        raise TaskHetError(f"--local_steps_range must be LOW:HIGH (two whole numbers, e.g. 10:50), got {text!r}")
    return int(match.group(1)), int(match.group(2))


def straggler_steps(local_steps: int, share: float) -> int:
    """A straggler's steps: ``max(1, floor(share·J))``."""
    return max(1, math.floor(share * local_steps))


def client_step_budgets(work: LocalWork, local_steps: int | None, client_ids: Iterable[str],
                        seed: int) -> dict[str, int] | None:
    """Each client's local steps per round, by client id; None when every client takes ``local_steps``.

    Args:
        work: the run's unequal-work settings.
        local_steps: J (``--local_steps``); None when the budget is ``--local_epochs``.
        client_ids: the federation's clients.
        seed: the run's root seed.
    """
    if work.is_equal:
        return None
    if local_steps is None:
        raise TaskHetError("unequal local work (--straggler_fraction, --local_steps_range) counts steps: "
                           "use --local_steps, not --local_epochs")
    ids = sorted(str(client_id) for client_id in client_ids)
    if work.steps_range is not None:
        low, high = work.steps_range
        drawn = numpy_rng(seed, "local_steps_range").integers(low, high + 1, size=len(ids))
        return {client_id: int(steps) for client_id, steps in zip(ids, drawn)}
    count = math.floor(work.straggler_fraction * len(ids) + 0.5)
    stragglers = {ids[index] for index in numpy_rng(seed, "stragglers").permutation(len(ids))[:count]}
    short = straggler_steps(local_steps, work.straggler_share)
    return {client_id: short if client_id in stragglers else local_steps for client_id in ids}


def check_not_lockstep(unequal: bool, lockstep: bool) -> None:
    """Refuse unequal local work in a lock-step chunk (``--vectorize_clients``), which takes the same steps for all."""
    if unequal and lockstep:
        raise TaskHetError("--vectorize_clients trains a chunk of clients in lock-step, step for step, so its clients "
                           "cannot do unequal local work (--straggler_fraction, --local_steps_range)")
