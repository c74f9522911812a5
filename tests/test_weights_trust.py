"""Untrusted weight files (models/encoders.py): TorchScript only for hash-checked CLIP files, hashes checked."""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch import nn

from models.encoders import build_encoder
from models.weights import WeightSource, read_weights_file
from utils.errors import TaskHetError


def torchscript_file(tmp_path):
    path = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(nn.Linear(2, 2)), str(path))
    return path


def test_a_torchscript_path_is_refused_without_running_it(tmp_path, monkeypatch):
    path = torchscript_file(tmp_path)
    monkeypatch.setattr(torch.jit, "load", lambda *args, **kwargs: pytest.fail("torch.jit.load was called"))
    with pytest.raises(TaskHetError, match="TorchScript archives are read only for the CLIP files"):
        read_weights_file(path)
    with pytest.raises(TaskHetError, match="TorchScript archives are read only"):
        build_encoder("small_cnn", str(path))


def test_torchscript_is_read_when_the_caller_vouches_for_it(tmp_path):
    tensors = read_weights_file(torchscript_file(tmp_path), torchscript=True)
    assert set(tensors) == {"weight", "bias"}


def test_published_hashes_are_checked(tmp_path):
    path = tmp_path / "ViT-B-32.pt"
    path.write_bytes(b"not the weights")
    digest = hashlib.sha256(b"not the weights").hexdigest()
    WeightSource("CLIP", "clip", url=f"https://example.org/clip/models/{digest}/ViT-B-32.pt").verify(path)
    WeightSource("resnet", "torchvision", url=f"https://example.org/models/resnet50-{digest[:8]}.pth").verify(path)
    other = "0" * 64
    with pytest.raises(TaskHetError, match="is not the published CLIP file"):
        WeightSource("CLIP", "clip", url=f"https://example.org/clip/models/{other}/ViT-B-32.pt").verify(path)
    with pytest.raises(TaskHetError, match="is not the published resnet file"):
        WeightSource("resnet", "torchvision", url="https://example.org/models/resnet50-00000000.pth").verify(path)
    assert WeightSource("DINO", "timm", repo_id="timm/x").published_sha256() is None
