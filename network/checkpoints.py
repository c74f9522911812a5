"""Step-4 checkpoints: which run a checkpoint belongs to, and loading one for ``--resume``.

With a frozen pretrained encoder the engine writes checkpoint.pt and best.pt without it (the model, every
server model and client state that holds an unchanged copy): ``models.frozen_encoder`` names it by source and
hash, and :func:`load_resumable` puts it back, refusing an encoder whose hash differs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from models.frozen_encoder import FrozenEncoder, load_full_checkpoint
from utils.errors import TaskHetError

if TYPE_CHECKING:  # the engine imports this module, so only the type is needed here
    from network.algorithms.base import Algorithm
    from network.engine_config import EngineConfig

CHECKPOINT_FILE, BEST_FILE = "checkpoint.pt", "best.pt"


DROPPED_STATES = "dropped_client_states"  # clients whose states a finished run left out of its checkpoint
PRIVACY_STATE = "privacy"  # client-level DP's server state (its current C, the rounds released); None without DP


def run_fingerprint(algorithm: Algorithm, config: EngineConfig, client_ids: list[str]) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: algorithm, settings, seed, client ids and the run's signature."""
    fingerprint = {"algorithm": algorithm.name, "settings": dataclasses.asdict(algorithm.settings), "seed": config.seed,
                   "clients": list(client_ids), "signature": dict(config.signature or {})}
    if config.client_steps is not None:  # unequal local work changes what every round computes
        fingerprint["client_steps"] = {str(key): int(value) for key, value in sorted(config.client_steps.items())}
    return fingerprint


def load_resumable(path: Path, fingerprint: dict[str, Any], frozen: FrozenEncoder | None = None) -> dict[str, Any]:
    """The checkpoint at ``path`` if it is a whole step-4 checkpoint of the run ``fingerprint`` describes.

    Callers check before writing anything into the folder, so a refused resume leaves it as it was. A left-out
    frozen encoder is put back from ``frozen`` (the run's own; it must have the recorded hash) or, without it,
    rebuilt from the recorded source.
    """
    checkpoint = load_full_checkpoint(path, "--resume: step-4 checkpoint",
                                      keys=("run", "round", "server", "client_states", "rng", "best_loss"), known=frozen)
    if checkpoint["run"] != fingerprint:
        raise TaskHetError(f"{path} belongs to a different run ({checkpoint['run']}); use --no-resume or another --out")
    return checkpoint
