"""Federated algorithms, one file each, registered by name (DESIGN.md §4).

Each module below registers itself in :data:`network.algorithms.base.ALGORITHMS`
when imported; they are imported explicitly so the registry is always complete.
"""

from __future__ import annotations

from dataclasses import fields, replace

from network.algorithms import fedavg, fedprox, fedrep, scaffold  # noqa: F401  (registration)
from network.algorithms.base import ALGORITHMS, Algorithm, AlgorithmConfig, ClientConfig, ClientResult
from utils.errors import TaskHetError


def get_algorithm(name: str, config: AlgorithmConfig | None = None, **hyperparameters: object) -> Algorithm:
    """The algorithm called ``name``, built from ``config`` and/or keyword hyperparameters.

    ``get_algorithm("fedprox", mu=0.1, num_clients=10)`` equals
    ``get_algorithm("fedprox", AlgorithmConfig(mu=0.1, num_clients=10))``; keywords override ``config``.
    Unknown names list the choices; unknown hyperparameters list the known ones.
    """
    algorithm = ALGORITHMS.get(name)
    known = {field.name for field in fields(AlgorithmConfig)}
    unknown = sorted(set(hyperparameters) - known)
    if unknown:
        raise TaskHetError(f"unknown hyperparameter(s) {', '.join(unknown)} for {name}; known: {', '.join(sorted(known))}")
    return algorithm(replace(config or AlgorithmConfig(), **hyperparameters))


def list_algorithms() -> list[str]:
    """Registered algorithm names, sorted."""
    return ALGORITHMS.names()


__all__ = ["Algorithm", "AlgorithmConfig", "ClientConfig", "ClientResult", "get_algorithm", "list_algorithms"]
