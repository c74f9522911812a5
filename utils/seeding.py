"""Seeds derived from one root seed; no global RNG is ever reseeded.

Every random choice (split, partition, sampling, init, loader order, each client's
training) gets its own generator from ``derive_seed(root_seed, "purpose", ...)``,
so adding a random draw in one place never shifts the draws of another.
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch
# torch is imported by the two functions that use it: the partition code seeds numpy generators only, and
# partitioning/flwr_partitioners.py serves Flower Datasets users without torch.


def derive_seed(root_seed: int, *keys: object) -> int:
    """A 63-bit seed that depends on the root seed and the keys (stable across runs and platforms)."""
    text = "/".join([str(root_seed), *map(str, keys)])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def numpy_rng(root_seed: int, *keys: object) -> np.random.Generator:
    """A numpy Generator for one purpose."""
    return np.random.default_rng(derive_seed(root_seed, *keys))


def torch_generator(root_seed: int, *keys: object) -> torch.Generator:
    """A CPU torch.Generator for one purpose (loader order, dropout-free inits)."""
    import torch

    generator = torch.Generator()
    generator.manual_seed(derive_seed(root_seed, *keys))
    return generator


def set_deterministic(enabled: bool) -> None:
    """Ask torch for deterministic kernels (bit-identical reruns on one machine)."""
    import torch

    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled, warn_only=False)
    torch.backends.cudnn.benchmark = not enabled
