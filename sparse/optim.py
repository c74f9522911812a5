"""SparseSGDM: torch's SGD with momentum, restricted to the entries a 0/1 mask selects.

Sparse fine-tuning (TaLoS, Iurada et al., ICLR 2025) trains a small, fixed subset of a
pretrained model's entries. Zeroing the frozen entries' gradients is not enough with
torch's SGD: ``step()`` adds ``weight_decay · θ`` to the gradient itself, so decay
(and the momentum it feeds) would still move every frozen entry.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
from torch import Tensor
from torch.optim.sgd import sgd

from utils.errors import TaskHetError

MASK = "mask"  # optimizer state key: the 0/1 mask as a float tensor of the parameter's dtype


class SparseSGDM(torch.optim.SGD):
    """SGD with momentum (torch's pseudo-code, every option) that never changes an entry whose mask is 0.

    Each step builds the direction torch's SGD would start from, ``d = g + wd·θ`` (``−g`` with
    ``maximize``), multiplies it by the mask, and hands it to torch's own ``sgd`` kernel with
    ``weight_decay=0``; momentum, dampening, nesterov, ``foreach`` and ``fused`` then behave
    exactly as in ``torch.optim.SGD``. With an all-ones mask the result is bit-identical to
    ``torch.optim.SGD`` (d·1 = d); a frozen entry's direction is ±0, so its value never
    changes (θ − lr·(±0) = θ; only a parameter that is exactly 0 may flip the sign of its zero).

    The mask is kept as a float tensor of the parameter's dtype (one parameter-sized copy)
    and applied by one in-place ``_foreach_mul_``: on CPU, ``masked_fill_`` or ``where`` with
    a bool mask took 7–8× as long as the whole multiply and cost SparseSGDM most of its speed
    (bench/bench_sparse.py). The price: a non-finite gradient at a frozen entry gives
    0·inf = NaN there. Such a gradient means training has diverged; the local loop stops on the
    next non-finite loss (``NonFiniteLossError``).

    Momentum buffer: it accumulates the *masked* direction, so a frozen entry's buffer is
    and stays exactly 0. TaLoS's AdamW keeps its moments from the full gradient and masks
    the step instead; because SGD's buffer is element-wise, both choices give the same
    updates on every trainable entry. They differ only at frozen entries, where a masked
    buffer holds no hidden velocity (that would move an entry the moment its mask is
    relaxed, e.g. between calibration rounds or in a later phase).

    Args:
        params: parameters or parameter groups, as for ``torch.optim.SGD``.
        masks: one mask per parameter, in the order of ``params`` (groups flattened):
            a tensor of the parameter's shape (nonzero = trainable) or None (dense).
        lr, momentum, dampening, weight_decay, nesterov, maximize, foreach, fused: as for ``torch.optim.SGD``.
    """

    def __init__(self, params: Iterable, masks: Sequence[Tensor | None], lr: float = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, fused: bool | None = None) -> None:
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                         nesterov=nesterov, maximize=maximize, foreach=foreach, fused=fused)
        flat = [param for group in self.param_groups for param in group["params"]]
        masks = list(masks)
        if len(masks) != len(flat):
            raise TaskHetError(f"SparseSGDM needs one mask per parameter: {len(flat)} parameters, {len(masks)} masks")
        for index, (param, mask) in enumerate(zip(flat, masks)):
            if mask is None:
                continue
            if mask.shape != param.shape:
                raise TaskHetError(f"mask {index} has shape {tuple(mask.shape)}, its parameter {tuple(param.shape)}")
            self.state[param][MASK] = (mask.detach() != 0).to(device=param.device, dtype=param.dtype)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step; entries whose mask is 0 keep their exact bits (value, and a momentum buffer of 0)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[Tensor] = []
            grads: list[Tensor] = []
            buffers: list[Tensor | None] = []
            if self._init_group(group, params, grads, buffers):
                raise TaskHetError("SparseSGDM does not support sparse gradients")
            sgd(params, self._directions(params, grads, group), buffers, weight_decay=0.0,
                momentum=group["momentum"], lr=group["lr"], dampening=group["dampening"],
                nesterov=group["nesterov"], maximize=False, has_sparse_grad=False, foreach=group["foreach"],
                fused=group["fused"], grad_scale=None, found_inf=None)
            if group["momentum"] != 0:
                for param, buffer in zip(params, buffers):
                    self.state[param]["momentum_buffer"] = buffer
        return loss

    def _directions(self, params: list[Tensor], grads: list[Tensor], group: dict) -> list[Tensor]:
        """``(±g + wd·θ) · mask``: one in-place foreach multiply (a float mask; see the class docstring)."""
        fresh = group["maximize"] or group["weight_decay"] != 0
        if group["maximize"]:
            grads = torch._foreach_neg(grads)
        if group["weight_decay"] != 0:
            # The same op torch's SGD applies (grad.add(param, alpha=wd)), so all-ones masks stay bit-identical.
            grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
        grads = list(grads)
        masked = [index for index, param in enumerate(params) if MASK in self.state[param]]
        targets = [grads[index] for index in masked]
        masks = [self.state[params[index]][MASK] for index in masked]
        if fresh:  # our own tensors: multiply in place
            torch._foreach_mul_(targets, masks)
        else:
            targets = torch._foreach_mul(targets, masks)
        for index, product in zip(masked, targets):
            grads[index] = product
        return grads
