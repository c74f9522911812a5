"""Federated algorithms, one file each, registered by name (docs/DESIGN.md §4).

Each module below registers itself in :data:`network.algorithms.base.ALGORITHMS`
when imported; they are imported explicitly so the registry is always complete.
"""

from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from network.algorithms import (ditto, fedavg, fedbabu, fedbn, fedloge, fedper, fedprox, fedrep, fedrod,  # noqa: F401
                                ifca, scaffold, sparse_finetune)  # (registration)
from network.algorithms import cfl, fedamp, fedem, local, mocha, pfedme, qfedavg  # noqa: F401  (registration; issue 21 toolbox)
from network.algorithms import (apfl, ccvr, fedala, feddecorr, feddyn, fedlc, fednova, lgfedavg, moon,  # noqa: F401
                                perfedavg)  # (registration: the standard non-IID baselines)
from network.algorithms.base import (ALGORITHMS, Algorithm, ClientConfig, ClientResult, Federation, ModelLayout,
                                     ServerState, Upload)
from network.settings import build_settings, settings_table


def build_algorithm(name: str, model: nn.Module, client_sizes: Mapping[str, int], settings: Mapping[str, Any] | None = None,
                    seed: int = 0, input_key: str = "x") -> tuple[Algorithm, nn.Module]:
    """The algorithm called ``name`` for a federation of ``client_sizes``, and the worker model it trains.

    Args:
        name: a registered algorithm.
        model: the task model (the worker model is built from it).
        client_sizes: client id -> number of training samples, for every client.
        settings: setting name -> value (strings or YAML scalars are converted); unknown
            or foreign names are an error listing the algorithm's settings.
        seed: the run's root seed.
        input_key: the batch key of the model input (the data family's; :class:`Federation`).
    """
    algorithm_class = ALGORITHMS.get(name)
    parsed = build_settings(algorithm_class.Settings, settings or {}, name)
    worker = algorithm_class.worker_model(model, parsed)
    federation = Federation({str(key): int(value) for key, value in client_sizes.items()}, ModelLayout.of(worker), seed,
                            input_key)
    return algorithm_class(parsed, federation), worker


def list_algorithms() -> list[str]:
    """Registered algorithm names, sorted."""
    return ALGORITHMS.names()


def describe_algorithms() -> str:
    """Every algorithm with its settings, as ``test_fed.py --list_methods`` prints them."""
    blocks = []
    for name in list_algorithms():
        algorithm_class = ALGORITHMS.get(name)
        summary = (algorithm_class.__doc__ or "").strip().splitlines()[0]
        lines = [f"{name}: {summary}"] + [f"  --{line}" for line in settings_table(algorithm_class.Settings)]
        blocks.append("\n".join(lines if len(lines) > 1 else lines + ["  (no settings)"]))
    return "\n\n".join(blocks)


__all__ = ["Algorithm", "ClientConfig", "ClientResult", "Federation", "ModelLayout", "ServerState", "Upload",
           "build_algorithm", "describe_algorithms", "list_algorithms"]
