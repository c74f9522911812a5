"""CPU, CUDA and MPS behind one helper; nothing else in the code assumes a GPU."""

from __future__ import annotations

import contextlib
import os

import torch

VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


def pick_device(use_accelerator: bool = True) -> torch.device:
    """CUDA if present, else MPS if present, else CPU; ``use_accelerator=False`` forces CPU."""
    if use_accelerator and torch.cuda.is_available():
        return torch.device("cuda")
    if use_accelerator and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def visible_gpu_ids() -> list[str]:
    """The GPUs this process may use, named as ``CUDA_VISIBLE_DEVICES`` names them (indices, ``GPU-<uuid>``, MIG ids).

    Set: its comma-separated entries up to the first that hides the rest (CUDA stops at an entry starting with
    ``-``, such as ``-1``); empty: none. Unset: ``0 .. n-1`` for torch's device count, which asks NVML and makes no
    CUDA context, so a pool's workers can still be given their own devices.
    """
    names = os.environ.get(VISIBLE_DEVICES)
    if names is None:
        return [str(index) for index in range(torch.cuda.device_count())]
    visible = []
    for name in (entry.strip() for entry in names.split(",")):
        if not name or name.startswith("-"):
            break
        visible.append(name)
    return visible


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA (faster, no loss scaling needed); a no-op elsewhere."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def prepare_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Move a model to the device; channels_last on CUDA, where convolutions run faster with it.

    The CPU keeps the default layout although channels_last is faster there too (a training step 1.00-1.52x,
    docs/BENCHMARKS.md): its convolutions round differently, so a sequential run would no longer equal its
    vectorised twin (which must use the default layout: ``vmap`` cannot ask a channels_last tensor whether it is
    contiguous, as GroupNorm and BatchNorm do; the engine converts its model back) nor resume bit for bit in
    another number of processes.
    """
    model = model.to(device)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    return model


def to_device(batch: dict, device: torch.device) -> dict:
    """Move every tensor of a batch dict, and of its lists (cached feature maps), to the device; other values unchanged."""
    def move(value):
        if torch.is_tensor(value):
            return value.to(device, non_blocking=True)
        if isinstance(value, list) and value and all(torch.is_tensor(item) for item in value):
            return [item.to(device, non_blocking=True) for item in value]
        return value
    return {key: move(value) for key, value in batch.items()}
