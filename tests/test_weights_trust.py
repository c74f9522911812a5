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


def safetensors_file(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "whole.safetensors"
    save_file({"weight": torch.ones(64, 8)}, str(path))
    return path


def truncated(path, name):
    target = path.with_name(name)
    target.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return target


def beside(path, name, content: bytes):
    target = path.with_name(name)
    target.write_bytes(content)
    return target


@pytest.mark.parametrize("damage, message", [
    (lambda p: beside(p, "zero.safetensors", b""), "zero.safetensors is empty \\(0 bytes\\)"),
    (lambda p: beside(p, "garbage.safetensors", b"\x00garbage" * 40),
     "garbage.safetensors is not a readable safetensors file \\(SafetensorError: "),
    (lambda p: truncated(p, "half.safetensors"), "half.safetensors is not a readable safetensors file \\(SafetensorError: "),
])
def test_a_broken_safetensors_file_is_one_named_error(tmp_path, damage, message):
    path = damage(safetensors_file(tmp_path))
    with pytest.raises(TaskHetError, match=f"--weights .*{message}"):
        read_weights_file(path)
    with pytest.raises(TaskHetError, match=message):
        build_encoder("small_cnn", str(path))


@pytest.mark.parametrize("zipped", [True, False])
def test_a_truncated_pth_is_one_named_error_that_says_why(tmp_path, zipped):
    whole = tmp_path / "whole.pth"
    torch.save({"weight": torch.ones(64, 8)}, whole, _use_new_zipfile_serialization=zipped)
    with pytest.raises(TaskHetError, match="--weights .*half.pth is not a torch state dict that loads with "
                                           "weights_only=True \\(RuntimeError: "):
        read_weights_file(truncated(whole, "half.pth"))
    (tmp_path / "zero.pth").write_bytes(b"")
    with pytest.raises(TaskHetError, match="zero.pth is empty \\(0 bytes\\)"):
        read_weights_file(tmp_path / "zero.pth")
