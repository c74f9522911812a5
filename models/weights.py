"""Weights files: where a named source lives, fetching it, checking its published hash, reading it safely.

A named source (``WeightSource``) is read from its library's cache (torch hub for
torchvision, ``~/.cache/clip`` for the ``clip`` package, the Hugging Face cache for timm)
and downloaded there if missing; offline it is a :class:`TaskHetError` saying which file
to put where. Files are read with ``torch.load(weights_only=True)`` or as safetensors;
TorchScript only for a caller that vouches for the file (the hash-checked CLIP archives).
Mapping a file's tensors onto an encoder is ``models.encoders.match_state_dict``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from utils.errors import TaskHetError
from utils.hashing import file_sha256
from utils.loaders import error_summary

# The checkpoint entry that names a frozen encoder left out of the file (models/frozen_encoder.py writes it).
FROZEN_ENCODER = "frozen_encoder"


@dataclass(frozen=True)
class WeightSource:
    """One published weights file and the library cache it lives in.

    ``library`` is ``torchvision`` or ``clip`` (a URL cached under a folder by its
    basename) or ``timm`` (a Hugging Face repo file in the HF cache).
    """

    description: str
    library: str
    url: str = ""
    repo_id: str = ""
    filename: str = "model.safetensors"

    def cache_path(self) -> Path | None:
        """The file in the library's cache where it would be; for HF the snapshot file if cached."""
        if self.library == "torchvision":
            return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(self.url)
        if self.library == "clip":
            # the clip package's own default download_root
            return Path(os.path.expanduser("~/.cache/clip")) / os.path.basename(self.url)
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(self.repo_id, self.filename, cache_dir=hf_cache_dir())
        return Path(found) if isinstance(found, str) else None

    def cached(self) -> Path | None:
        """The cached file if it exists."""
        path = self.cache_path()
        return path if path is not None and path.is_file() else None

    def download(self) -> Path:
        """Fetch into the library's cache (raises when offline)."""
        if self.library == "timm":
            from huggingface_hub import hf_hub_download

            return Path(hf_hub_download(self.repo_id, self.filename, cache_dir=hf_cache_dir()))
        target = self.cache_path()
        target.parent.mkdir(parents=True, exist_ok=True)
        torch.hub.download_url_to_file(self.url, str(target), progress=True)
        return target

    def published_sha256(self) -> str | None:
        """The SHA-256 (or its prefix) the source publishes for its file, or None.

        CLIP's URLs carry the full SHA-256 as a path segment, torchvision's file names end in
        its first hex digits (``resnet50-11ad3fa6.pth``); timm's Hugging Face files publish none here.
        """
        if self.library == "clip":
            return self.url.rstrip("/").split("/")[-2]
        if self.library == "torchvision":
            match = re.search(r"-([0-9a-f]{8,64})\.pth$", self.url)
            return match.group(1) if match else None
        return None

    def verify(self, path: Path) -> None:
        """Check ``path`` against the published hash (a :class:`TaskHetError` naming both on a mismatch)."""
        published = self.published_sha256()
        if published is None:
            return
        digest = file_sha256(path)
        if not digest.startswith(published):
            raise TaskHetError(f"{path} is not the published {self.description} file: its SHA-256 "
                               f"{digest[:16]}… does not start with {published[:16]}; delete it and retry")

    def where(self) -> str:
        """How to provide the file by hand."""
        if self.library == "timm":
            cache = hf_cache_dir()
            return (
                f"{self.filename} of https://huggingface.co/{self.repo_id} into the Hugging Face cache {cache} "
                f"(`hf download {self.repo_id} {self.filename} --cache-dir {cache}` where there is internet)"
            )
        return f"{self.url} at {self.cache_path()}"


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, resolved from the environment at call time."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    cache_home = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    return Path(cache_home) / "huggingface" / "hub"


def fetch_weights(encoder_name: str, weights: str, sources: list[WeightSource]) -> tuple[Path, WeightSource]:
    """The first cached source's file, else a download of the first source; an error saying what to put where."""
    for source in sources:
        path = source.cached()
        if path is not None:
            return path, source
    try:
        return source_download(sources[0]), sources[0]
    except TaskHetError as error:
        # a source that cannot be downloaded (an uninstalled package) says itself what to do
        raise TaskHetError(f"--weights {weights} for encoder {encoder_name}: {error}") from error
    except Exception as error:  # noqa: BLE001 - any failure to fetch (offline, proxy, HTTP) gets the same advice
        raise TaskHetError(
            f"--weights {weights} for encoder {encoder_name}: no cached file and the download failed ({error}). "
            f"Put {sources[0].where()}, or pass --weights PATH to a local file (or --weights none for random init)"
        ) from error


def source_download(source: WeightSource) -> Path:
    """Download one source (a seam that tests replace to simulate being offline)."""
    return source.download()


def read_weights_file(path: Path, torchscript: bool = False) -> dict[str, torch.Tensor]:
    """Tensors of a weights file: safetensors or a torch pickle (plain, ``{"state_dict"}``, ``{"model"}``).

    ``torch.load(weights_only=True)`` never runs code from the file. A TorchScript archive
    can, so it is read only with ``torchscript=True``: the caller passes that for the CLIP
    files the clip package names, after checking their published SHA-256, never for a PATH.
    A TaskHet checkpoint that leaves out its frozen encoder (``models.frozen_encoder``) is refused
    with the source it names, which holds exactly that encoder.

    Raises:
        TaskHetError: naming the file: missing, empty, truncated or not a weights file, or a checkpoint
            without its frozen encoder.
    """
    path = Path(path)
    if not path.is_file():
        raise TaskHetError(f"--weights {path}: no such file (expected none, imagenet, clip or a path to a weights file)")
    if path.stat().st_size == 0:
        raise TaskHetError(f"--weights {path} is empty (0 bytes): expected a safetensors file or a torch state dict")
    if path.suffix == ".safetensors":
        return _read_safetensors(path)
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - truncated, not a torch file, or a pickle needing more than tensors
        if not torchscript:
            raise TaskHetError(f"--weights {path} is not a torch state dict that loads with weights_only=True "
                               f"({error_summary(error)}): expected a safetensors file or such a state dict; a truncated "
                               "download reads so too. TorchScript archives are read only for the CLIP files the clip "
                               "package names (after checking their published SHA-256)") from None
        loaded = torch.jit.load(str(path), map_location="cpu").state_dict()
    if isinstance(loaded, dict) and isinstance(loaded.get(FROZEN_ENCODER), dict):
        raise TaskHetError(frozen_checkpoint_message(path, loaded[FROZEN_ENCODER]))
    for key in ("model", "state_dict"):
        if isinstance(loaded, dict) and isinstance(loaded.get(key), dict):
            loaded = loaded[key]
    if not isinstance(loaded, dict) or not all(torch.is_tensor(value) for value in loaded.values()):
        raise TaskHetError(f"--weights {path}: expected a dict of tensors (a state dict)")
    return {key.removeprefix("module."): value for key, value in loaded.items()}


def frozen_checkpoint_message(path: Path, record: dict) -> str:
    """The one line refusing ``--weights`` of a checkpoint that names its frozen encoder instead of holding it."""
    name, weights, sha256 = (str(record.get(field, "?")) for field in ("name", "weights", "sha256"))
    return (f"--weights {path} holds no encoder: it names its frozen encoder {name} (SHA-256 {sha256[:16]}…) by its "
            f"source; pass --weights {weights}, which is that encoder")


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors; a garbage, truncated or foreign file is a TaskHetError naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, ValueError, TypeError, OSError) as error:
        raise TaskHetError(f"--weights {path} is not a readable safetensors file ({error_summary(error)}); "
                           "a truncated download reads so too") from None
