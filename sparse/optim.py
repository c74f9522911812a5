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
from torch.optim.optimizer import _default_to_fused_or_foreach
from torch.optim.sgd import sgd

from utils.errors import TaskHetError

MASK = "mask"  # optimizer state key: the 0/1 mask as a float tensor of the parameter's dtype
# A mask at most this dense steps through the indices of its trainable entries (per-tensor loop, foldable options):
# int64 indices cost 8 B × density per entry, no more than the float mask's 4 B.
INDEXED_UP_TO = 0.5


class SparseSGDM(torch.optim.SGD):
    """SGD with momentum (torch's pseudo-code, every option) that never changes an entry whose mask is 0.

    Three paths; on every one a frozen entry keeps its exact bits and an all-ones mask is
    ``torch.optim.SGD`` bit for bit (tests/test_sparse_optim.py):

    * **Indexed** (the per-tensor loop, torch's CPU default; momentum > 0, dampening 0, no
      nesterov; a mask at most ``INDEXED_UP_TO`` = 50 % dense). torch's step on the trainable
      entries only: gather ``d = ±g + wd·θ`` at their flat indices, ``b ← μ·b + d`` on a
      compact buffer, ``θ.index_add_(−lr·b)``. Frozen entries are never read or written, and
      at density 0.1 it moves far less memory than torch's dense step (bench/bench_sparse.py).
    * **Folded** (the same options, denser masks or the foreach path). torch's own ops with
      the mask folded into the buffer pass: ``b ← μ·b + d·m`` (``addcmul_`` where torch does
      ``b ← μ·b + d``), ``θ ← θ − lr·b``: no extra pass, one extra read (the mask). With
      ``m = 1``, ``d·1`` is exact and ``b + d·1`` rounds as torch's ``b + d``; the first
      step's ``b = d·m`` is torch's ``b = clone(d)``.
    * **Masked direction** (every other option). ``d·m`` first (one extra multiply), then
      torch's own update with ``weight_decay=0`` (its ``sgd`` kernel on the foreach path, its
      per-tensor loop op for op otherwise). Folding is not exact there: with dampening τ,
      torch computes ``b + (1−τ)·d`` as one fused multiply-add on CPU, ``addcmul`` rounds
      ``(1−τ)·d`` first; nesterov's ``d + μ·b`` and momentum 0's ``θ − lr·d`` would use the
      unmasked ``d``.

    The per-tensor loop handles one parameter at a time, as torch's does, so ``d`` is still
    in cache when the buffer and the parameter use it. On the folded and masked paths a
    frozen entry's direction is ±0, so ``b`` stays ±0 there and its value never changes
    (θ − lr·(±0) = θ; only a parameter that is exactly 0 may flip the sign of its zero).
    The mask is kept as a float tensor of the parameter's dtype (one parameter-sized copy):
    on CPU, ``masked_fill_`` or ``where`` with a bool mask took 7–8× as long as a multiply.
    The price: a non-finite gradient at a frozen entry gives 0·inf = NaN there. Such a
    gradient means training has diverged; the local loop stops on the next non-finite loss
    (``NonFiniteLossError``).

    Momentum buffer: it accumulates the *masked* direction. On the folded and masked paths
    it is parameter-sized and exactly 0 at frozen entries; on the indexed path it holds the
    trainable entries only (in flat order), which is the same buffer without its zeros.
    TaLoS's AdamW keeps its moments from the full gradient and masks the step instead;
    because SGD's buffer is element-wise, both choices give the same updates on every
    trainable entry. They differ only at frozen entries, where a masked buffer holds no
    hidden velocity (that would move an entry the moment its mask is relaxed, e.g. between
    calibration rounds or in a later phase), and masking the buffer is what lets the mask
    ride in torch's buffer pass, or lets the indexed path drop frozen entries altogether.

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
        self._indices: dict[Tensor, Tensor | None] = {}  # param -> flat trainable indices (from MASK), or None

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state: a SparseSGDM's (its masks replace ours) or a dense SGD's, e.g. ``torch.optim.SGD``'s, which
        has no masks: ours are kept, and its full-size buffers are masked so that no velocity is left at frozen
        entries (otherwise they would move at the next step, and a dense state would silently drop the masks)."""
        own = {param: state[MASK] for param, state in self.state.items() if MASK in state}
        super().load_state_dict(state_dict)
        for param, mask in own.items():
            state = self.state[param]
            state.setdefault(MASK, mask)
            buffer = state.get("momentum_buffer")
            if buffer is not None and buffer.shape == param.shape:
                state["momentum_buffer"] = buffer * state[MASK]
        self._indices.clear()  # the loaded masks may differ

    def _indices_of(self, param: Tensor) -> Tensor | None:
        """Flat indices of the trainable entries when the mask is sparse enough (cached), else None."""
        if param not in self._indices:
            mask = self.state[param].get(MASK)
            sparse = mask is not None and param.is_contiguous() and float(mask.mean()) <= INDEXED_UP_TO
            self._indices[param] = mask.reshape(-1).nonzero().squeeze(1) if sparse else None
        return self._indices[param]

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
            if isinstance(group["lr"], Tensor) and not group["fused"]:
                group = {**group, "lr": group["lr"].item()}  # torch's own unfused steps read it as a number too
            masks = [self.state[param].get(MASK) for param in params]
            buffers = buffers or [None] * len(params)  # torch lists no buffers without momentum
            foreach = group["foreach"]
            if foreach is None:  # torch's own default: foreach on CUDA, the per-tensor loop on CPU
                _, foreach = _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)
            if group["fused"]:
                sgd(params, self._masked(_directions(params, grads, group), grads, masks), buffers, weight_decay=0.0,
                    momentum=group["momentum"], lr=group["lr"], dampening=group["dampening"],
                    nesterov=group["nesterov"], maximize=False, has_sparse_grad=False, foreach=False, fused=True,
                    grad_scale=None, found_inf=None)
            elif foreach:
                _foreach_step(params, grads, masks, buffers, group)
            else:
                indexed = [self._indices_of(param) for param in params]
                _single_tensor_steps(params, grads, masks, indexed, buffers, group)
            if group["momentum"] != 0:
                for param, buffer in zip(params, buffers):
                    self.state[param]["momentum_buffer"] = buffer
        return loss

    @staticmethod
    def _masked(directions: list[Tensor], grads: list[Tensor], masks: list[Tensor | None]) -> list[Tensor]:
        """``d·m``: in place in our own tensors, a new tensor where ``d`` is the caller's gradient."""
        return [direction if mask is None else direction * mask if direction is grad else direction.mul_(mask)
                for direction, grad, mask in zip(directions, grads, masks)]


def _folds(mask: Tensor | None, group: dict) -> bool:
    """Whether ``m`` folds exactly into torch's buffer update ``b ← μ·b + d`` (see the class docstring)."""
    return mask is not None and group["momentum"] != 0 and group["dampening"] == 0 and not group["nesterov"]


def _single_tensor_steps(params: list[Tensor], grads: list[Tensor], masks: list[Tensor | None],
                         indexed: list[Tensor | None], buffers: list[Tensor | None], group: dict) -> None:
    """torch's per-tensor SGD loop (``_single_tensor_sgd``, op for op), masked; fills ``buffers``.

    One parameter at a time, as torch does, so ``d`` is still in cache when the buffer and the
    parameter use it; the group's settings are read once (the loop's Python cost is a few
    percent of a step of a small model).
    """
    momentum, lr, decay, maximize = group["momentum"], group["lr"], group["weight_decay"], group["maximize"]
    keep_up = 1 - group["dampening"]
    foldable = momentum != 0 and group["dampening"] == 0 and not group["nesterov"]
    for index, (param, grad, mask, where) in enumerate(zip(params, grads, masks, indexed)):
        if foldable and where is not None:
            buffers[index] = _indexed_step(param, grad, where, buffers[index], group)
            continue
        direction = -grad if maximize else grad
        if decay != 0:
            direction = direction.add(param, alpha=decay)
        folds = foldable and mask is not None
        if mask is not None and not folds:
            direction = direction * mask if direction is grad else direction.mul_(mask)
        if momentum != 0:
            buffer = buffers[index]
            if buffer is None:  # torch: b = clone(d)
                buffer = buffers[index] = direction * mask if folds else direction.detach().clone()
            elif folds:
                buffer.mul_(momentum).addcmul_(direction, mask)
            else:
                buffer.mul_(momentum).add_(direction, alpha=keep_up)
            direction = direction.add(buffer, alpha=momentum) if group["nesterov"] else buffer
        param.add_(direction, alpha=-lr)


def _indexed_step(param: Tensor, grad: Tensor, where: Tensor, buffer: Tensor | None, group: dict) -> Tensor:
    """torch's step on the trainable entries only (gathered, updated, added back); returns the compact ``b``.

    Frozen entries are never read or written, so they keep their bits; the buffer holds
    the trainable entries only (a full-size buffer, e.g. loaded from a dense run, is
    gathered first).
    """
    flat = param.view(-1)
    direction = grad.reshape(-1).index_select(0, where)
    if group["maximize"]:
        direction.neg_()
    if group["weight_decay"] != 0:
        direction.add_(flat.index_select(0, where), alpha=group["weight_decay"])
    if buffer is None:
        buffer = direction  # torch: clone(d); this d is already our own tensor
    else:
        if buffer.numel() != where.numel():
            buffer = buffer.reshape(-1).index_select(0, where)
        buffer.mul_(group["momentum"]).add_(direction)
    flat.index_add_(0, where, buffer, alpha=-group["lr"])
    return buffer


def _directions(params: list[Tensor], grads: list[Tensor], group: dict) -> list[Tensor]:
    """``d = ±g + wd·θ`` with torch's foreach ops (the caller's gradients when that is just ``g``)."""
    if group["maximize"]:
        grads = torch._foreach_neg(grads)
    if group["weight_decay"] != 0:
        grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
    return list(grads)


def _foreach_step(params: list[Tensor], grads: list[Tensor], masks: list[Tensor | None],
                  buffers: list[Tensor | None], group: dict) -> None:
    """torch's foreach SGD step, masked: folded where exact, else the masked direction to torch's kernel."""
    directions = _directions(params, grads, group)
    folded = [index for index, mask in enumerate(masks) if _folds(mask, group)]
    if folded:
        # The first step's buffer is d·m (torch's clone(d)); later ones take b ← μ·b + d·m in torch's buffer pass.
        old = [index for index in folded if buffers[index] is not None]
        for index in folded:
            if buffers[index] is None:
                buffers[index] = directions[index] * masks[index]
        if old:
            torch._foreach_mul_([buffers[index] for index in old], group["momentum"])
            torch._foreach_addcmul_([buffers[index] for index in old], [directions[index] for index in old],
                                    [masks[index] for index in old])
        torch._foreach_add_([params[index] for index in folded], [buffers[index] for index in folded],
                            alpha=-group["lr"])
    done = set(folded)
    rest = [index for index in range(len(params)) if index not in done]
    if rest:
        masked = SparseSGDM._masked([directions[index] for index in rest], [grads[index] for index in rest],
                                    [masks[index] for index in rest])
        rest_buffers = [buffers[index] for index in rest]
        sgd([params[index] for index in rest], masked, rest_buffers, weight_decay=0.0, momentum=group["momentum"],
            lr=group["lr"], dampening=group["dampening"], nesterov=group["nesterov"], maximize=False,
            has_sparse_grad=False, foreach=True, fused=False, grad_scale=None, found_inf=None)
        for index, buffer in zip(rest, rest_buffers):
            buffers[index] = buffer
