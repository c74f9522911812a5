"""Seeded client sampling and per-client seeds.

Nothing here keeps state: the clients of round r and the seed a client trains with
in round r are functions of (root seed, round, client), so a resumed run, another
engine, or a rerun of one client draw exactly the same values.
"""

from __future__ import annotations

from typing import Sequence, TypeVar

from utils.errors import TaskHetError
from utils.seeding import derive_seed, numpy_rng

ClientId = TypeVar("ClientId")


def clients_per_round(num_clients: int, fraction: float) -> int:
    """max(1, round(fraction·N)) clients (McMahan et al.'s m = max(C·K, 1))."""
    if not 0 < fraction <= 1:
        raise TaskHetError(f"--client_fraction must be in (0, 1], got {fraction}")
    return max(1, round(fraction * num_clients))


def sample_clients(client_ids: Sequence[ClientId], fraction: float, seed: int, round_index: int) -> list[ClientId]:
    """The clients that train in ``round_index``: a uniform draw without replacement.

    Args:
        client_ids: every client, in a fixed order.
        fraction: the share of clients per round, in (0, 1]; 1 means all of them.
        seed: the run's root seed.
        round_index: the round (1-based).

    Returns:
        The sampled ids in the order of ``client_ids`` (so the training order, and with
        it the floating-point summation order, does not depend on the draw's order).
    """
    count = clients_per_round(len(client_ids), fraction)
    if count == len(client_ids):
        return list(client_ids)
    chosen = numpy_rng(seed, "sampling", round_index).choice(len(client_ids), size=count, replace=False)
    return [client_ids[index] for index in sorted(chosen)]


def client_seed(seed: int, round_index: int, client_id: object) -> int:
    """The seed of one client's training in one round (loader order, dropout, …)."""
    return derive_seed(seed, "client", round_index, client_id)
