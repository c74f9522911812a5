"""``torch.optim.SGD``'s step as a function of stacked ``[C, ...]`` tensors (the lock-step engine's optimiser).

Every option of torch's per-tensor step (momentum, dampening, nesterov, weight decay, maximize),
with one flag per client saying whether its momentum buffer has started, so a client's first
*taken* step sets its buffer to the direction, as torch's first step does
(``tests/test_vectorized.py`` checks it against ``torch.optim.SGD`` over every option).
Hand-written because torch's SGD steps parameters in place and keeps its state per tensor, not
per client of a stacked tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor


@dataclass(frozen=True)
class SGDOptions:
    """``torch.optim.SGD``'s hyperparameters (one learning rate for the whole chunk)."""

    lr: float
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    maximize: bool = False


def sgd_step(params: Sequence[Tensor], grads: Sequence[Tensor], buffers: Sequence[Tensor | None],
             started: Tensor | bool, options: SGDOptions,
             masks: Sequence[Tensor | None] | None = None) -> tuple[list[Tensor], list[Tensor | None]]:
    """One step of ``torch.optim.SGD`` (its per-tensor code, op for op), as a function: new tensors, inputs untouched.

    The ops run as ``torch._foreach_*`` over the list (on CPU these call the very per-tensor kernels of torch's
    loop, once per tensor, so the arithmetic is the same; they only save a Python call per tensor and op).

    Args:
        params, grads: one tensor each per parameter (stacked ``[C, ...]`` or not).
        buffers: the momentum buffers (ignored where not ``started``; None with momentum 0).
        started: whether each buffer exists yet: a bool, or a bool tensor ``[C]`` (one per stacked
            client). Where False the new buffer is the direction itself, torch's first step.
        options: lr, momentum, dampening, weight decay, nesterov, maximize.
        masks: 0/1 masks in the parameters' dtype (None: dense): the direction is multiplied by its mask after
            weight decay, before momentum, as ``sparse.optim.SparseSGDM`` does, so a masked entry never moves.

    Returns:
        The new parameters and the new momentum buffers (None with momentum 0).
    """
    if not params:
        return [], []
    directions = list(grads)
    if options.maximize:
        directions = torch._foreach_neg(directions)
    if options.weight_decay != 0:
        directions = torch._foreach_add(directions, list(params), alpha=options.weight_decay)
    if masks is not None:
        directions = [direction if mask is None else direction * mask for direction, mask in zip(directions, masks)]
    new_buffers: list[Tensor | None] = list(buffers)
    if options.momentum != 0:
        if isinstance(started, bool) and started and all(buffer is not None for buffer in buffers):
            new_buffers = torch._foreach_add(torch._foreach_mul(list(buffers), options.momentum), directions,
                                             alpha=1 - options.dampening)
        elif isinstance(started, bool):  # torch's first step: the buffer is a copy of the direction
            new_buffers = [direction.detach().clone() for direction in directions]
        else:
            new_buffers = [momentum_step(direction, buffer, started, options)[1]
                           for direction, buffer in zip(directions, buffers)]
        directions = (torch._foreach_add(directions, new_buffers, alpha=options.momentum) if options.nesterov
                      else new_buffers)
    return torch._foreach_add(list(params), directions, alpha=-options.lr), new_buffers


def momentum_step(direction: Tensor, buffer: Tensor | None, started: Tensor | bool,
              options: SGDOptions) -> tuple[Tensor, Tensor]:
    """torch's momentum update of one tensor: (the step direction, the new buffer)."""
    if isinstance(started, bool):
        if not started or buffer is None:
            buffer = direction.detach().clone()
        else:
            buffer = buffer.mul(options.momentum).add(direction, alpha=1 - options.dampening)
    else:
        continued = buffer.mul(options.momentum).add(direction, alpha=1 - options.dampening)
        buffer = torch.where(per_client(started, direction), continued, direction)
    if options.nesterov:
        return direction.add(buffer, alpha=options.momentum), buffer
    return buffer, buffer


def per_client(flags: Tensor, like: Tensor) -> Tensor:
    """``[C]`` flags shaped to broadcast over a stacked ``[C, ...]`` tensor."""
    return flags.view(-1, *([1] * (like.dim() - 1)))
