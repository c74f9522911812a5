"""Content hashes of files (stage keys, assignment records, downloaded weights) and of named tensors (frozen encoders)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Mapping

import torch


def file_sha256(path: Path) -> str:
    """The SHA-256 hex digest of one file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tensors_sha256(tensors: Mapping[str, torch.Tensor]) -> str:
    """The SHA-256 hex digest of named tensors (a state dict), independent of the mapping's order and devices.

    For each name in sorted order: one header line (name, dtype, shape, byte count), then the tensor's bytes in
    C order. The header keeps two tensors with the same bytes but another name, dtype or shape apart.
    """
    digest = hashlib.sha256()
    for name in sorted(tensors):
        value = tensors[name].detach().to("cpu").contiguous()
        raw = value.reshape(-1).view(torch.uint8).numpy()
        digest.update(f"{name}\0{value.dtype}\0{tuple(value.shape)}\0{raw.nbytes}\n".encode())
        digest.update(raw.data)
    return digest.hexdigest()
