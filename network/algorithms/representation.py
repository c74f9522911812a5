"""The representation z a local regulariser reads (MOON, FedDecorr), captured during the task loss's own forward pass.

Which z: for a TaskModel (models/task_model.py: an ``encoder`` module returning its feature maps, finest first) z is
the pooled encoder output, the global average of the encoder's deepest map (``[B, C]``), the representation every task
kind shares (a dense task's head input is a full-resolution decoder map). For a model without an ``encoder`` (the tiny
test models, the oracles' TwoLayer) z is the input of its ``head`` module, averaged over any axes after the channels.

How: :class:`RepresentationTap` wraps the engine's task loss. While the wrapped loss runs, a forward hook on the
representation's module keeps z and a forward pre-hook on the model keeps the model's input; both hooks are registered
at the call and removed in its ``finally``, so no hook outlives a step, an error or the client update. The local loop
(``network.local_train``) calls the loss, then the phase's ``extra_loss(model)``: the term reads the same step's z
(:meth:`RepresentationTap.take`), so the trained model runs once per step, and a fixed model (MOON's global and
previous ones) runs on the same input through :meth:`RepresentationTap.replay` (``torch.func.functional_call`` with
the fixed weights: no copy of the module).

A frozen encoder (``--freeze_encoder``, and ``--cache_features`` which needs it) is refused when the worker model is
built (:func:`require_trainable_representation`): its encoder never changes (with cached features it never even
runs), so a term on the pooled encoder output has nothing to move.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, ClassVar, Iterable, Iterator

import torch
from torch import Tensor, nn
from torch.func import functional_call

from network.algorithms.base import Bundle, ClientConfig, ClientResult, LossFn, Weights, require
from network.algorithms.skeleton import ModelAveraging
from utils.device import autocast
from utils.errors import TaskHetError

ENCODER_MODULE = "encoder"  # models/task_model.py's encoder
HEAD_MODULE = "head"  # the output layer (models/task_model.py HEAD_MODULE; the tiny models' too)


def representation_module(model: nn.Module, method: str) -> tuple[nn.Module, bool]:
    """The module z is read from, and whether z is its output (the encoder) rather than its input (the head)."""
    encoder = getattr(model, ENCODER_MODULE, None)
    if isinstance(encoder, nn.Module):
        return encoder, True
    head = getattr(model, HEAD_MODULE, None)
    if isinstance(head, nn.Module):
        return head, False
    raise TaskHetError(f"{method} needs a model with an '{ENCODER_MODULE}' (a TaskModel) or a '{HEAD_MODULE}' module: "
                       f"its representation is the pooled encoder output or the head's input; "
                       f"got {type(model).__name__}")


def require_trainable_representation(model: nn.Module, method: str, role: str) -> None:
    """Refuse, before any training, a model whose representation cannot change (a frozen encoder) or has none."""
    module, is_encoder = representation_module(model, method)
    if not is_encoder:
        return
    config = getattr(model, "config", None) or {}
    frozen = config.get("freeze_encoder") or not any(param.requires_grad for param in module.parameters())
    require(not frozen, f"{method} cannot train a model whose encoder is frozen (--freeze_encoder, --cache_features): "
                        f"the {role} representation, the pooled encoder output, cannot change; train the encoder")


def pooled(features: Tensor) -> Tensor:
    """``[B, C, ...]`` -> ``[B, C]`` (the mean over every axis after the channels), in at least float32.

    Under autocast a map comes out in bf16; the regularisers are computed outside autocast, in the parameters'
    precision (float64 stays float64: the oracles' exactness depends on it).
    """
    features = features.to(torch.promote_types(features.dtype, torch.float32))
    return features if features.dim() == 2 else features.flatten(2).mean(-1)


class Captured(Exception):
    """Raised by a replay's hook once z exists, to end a fixed model's forward there."""


class RepresentationTap:
    """A task loss that also keeps z and the model's input of its forward pass, for the step's ``extra_loss``.

    Args:
        model: the worker model being trained.
        loss_fn: the engine's task loss (``ClientConfig.loss_fn``).
        method: the algorithm's name, for messages.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, method: str) -> None:
        self.model, self.loss_fn, self.method = model, loss_fn, method
        self.module, self.is_encoder = representation_module(model, method)
        self._z: Tensor | None = None
        self._inputs: tuple[tuple, dict] | None = None

    def __call__(self, model: nn.Module, batch: dict, reduction: str = "mean") -> Tensor:
        with self.capturing():
            return self.loss_fn(model, batch, reduction)

    @contextlib.contextmanager
    def capturing(self, stop: bool = False) -> Iterator[None]:
        """Within the block, every forward of the model records its input and z (the last call wins); with ``stop``
        the forward ends as soon as z exists (:class:`Captured`): a fixed model runs no decoder and no head."""
        def keep_inputs(_: nn.Module, args: tuple, kwargs: dict) -> None:
            self._inputs = (args, kwargs)

        def keep_output(_: nn.Module, args: tuple, output) -> None:
            maps = output if isinstance(output, (list, tuple)) else [output]
            self._z = pooled(maps[-1])  # the encoder's maps, finest first: the deepest is the last
            if stop:
                raise Captured

        def keep_input(_: nn.Module, args: tuple) -> None:
            self._z = pooled(args[0])
            if stop:
                raise Captured

        handles = [self.model.register_forward_pre_hook(keep_inputs, with_kwargs=True),
                   self.module.register_forward_hook(keep_output) if self.is_encoder
                   else self.module.register_forward_pre_hook(keep_input)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def take(self) -> Tensor:
        """This step's z (with its graph), consumed: a step whose forward did not compute it is an error."""
        z, self._z = self._z, None
        if z is None:
            raise TaskHetError(f"{self.method}: the task loss's forward never computed the model's representation "
                               f"(its '{ENCODER_MODULE}' or '{HEAD_MODULE}' module)")
        return z

    def replay(self, weights: Weights, device: torch.device) -> Tensor:
        """z of the last recorded input under ``weights`` (a fixed model): eval mode, no gradient.

        Eval mode, as the MOON authors' code runs its global and previous models: BatchNorm reads the fixed model's
        running statistics and leaves them unchanged, and dropout draws nothing, so a fixed model is one function
        of the input for the whole round and the training RNG stream is untouched.
        """
        require(self._inputs is not None, f"{self.method}: no model input recorded to run a fixed model on")
        args, kwargs = self._inputs
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), autocast(device), self.capturing(stop=True):
                functional_call(self.model, weights, args, kwargs)
        except Captured:
            pass  # z is taken: the rest of the forward (a dense decoder, the head) would be thrown away
        finally:
            self.model.train(was_training)
        return self.take()


class RepresentationAveraging(ModelAveraging):
    """Model averaging whose local loss adds a term on z (MOON, FedDecorr): the worker model must have a trainable
    representation, and every client update runs the task loss through a :class:`RepresentationTap` (the phases'
    term reads it as ``cfg.loss_fn``)."""

    verb: ClassVar[str] = ""  # what the term does to z, for the refusal ("contrasted", "decorrelated")

    @classmethod
    def worker_model(cls, model: nn.Module, settings: Any) -> nn.Module:
        require_trainable_representation(model, cls.name, cls.verb)
        return model

    def client_update(self, model: nn.Module, broadcast: Bundle, client_state: Weights,
                      loader: Iterable[dict], cfg: ClientConfig) -> ClientResult:
        tap = RepresentationTap(model, cfg.loss_fn, self.name)
        return super().client_update(model, broadcast, client_state, loader, dataclasses.replace(cfg, loss_fn=tap))
