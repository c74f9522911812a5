"""Several classifier heads on one backbone pass: the shared machinery of FedLoGe and FedRoD.

Both methods replace the model's output layer (the ``head`` module, a Linear classifier: the
``head_keys()`` of the TaskModel interface) by a module holding several heads, and train all of
them in one local step on one backbone pass, the extra heads on *detached* features so that only
the main loss reaches the backbone. The local loop (``network.local_train``) knows one
``loss_fn(model, batch)``; :func:`multi_head_loss` turns the engine's task loss into the sum of
that loss over every head, with the backbone run once per batch:

* during the step, the head module *collects*: its forward computes every head's logits from the
  same features and keeps them (:attr:`MultiHead.collected`);
* :class:`HeadRouter` calls the model once for the batch's input and hands ``loss_fn`` one view
  per head that returns the model's output with that head's logits in place of the served ones.

The task loss is reused as it is (its label key, masks and reduction stay the task's), so these
methods work with any classification family. Outside the step (evaluation, ``--finetune_steps``)
the head module returns its *served* logits (:meth:`MultiHead.served_logits`).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import Tensor, nn

from network.algorithms.base import LossFn, require

HEAD_MODULE = "head"  # the TaskModel's output layer (models/task_model.py HEAD_MODULE; TinyNet's too)


def classifier_head(model: nn.Module, name: str) -> nn.Linear:
    """The model's Linear output layer; an error for a dense task or a model without a Linear classifier head."""
    task = getattr(model, "task", None)
    require(task is None or task.kind == "classification",
            f"{name} trains classifier heads, but --task {getattr(task, 'name', '?')} is a {getattr(task, 'kind', '?')} "
            "task; use a classification task (class_scene, digit_class, cifar_class)")
    head = getattr(model, HEAD_MODULE, None)
    require(isinstance(head, nn.Linear) and head.out_features >= 2,
            f"{name} needs a model whose output layer '{HEAD_MODULE}' is a Linear classifier over >= 2 classes, "
            f"got {type(head).__name__ if head is not None else 'none'}")
    return head


def copy_linear(layer: nn.Linear) -> nn.Linear:
    """A new Linear with ``layer``'s shape and values (on its device and dtype)."""
    copy = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                     device=layer.weight.device, dtype=layer.weight.dtype)
    copy.load_state_dict(layer.state_dict())
    return copy


class MultiHead(nn.Module):
    """Base of a head module with several heads; subclasses give ``collect_logits`` and ``served_logits``."""

    def __init__(self) -> None:
        super().__init__()
        self.collecting = False
        self.collected: dict[str, Tensor] = {}

    def collect_logits(self, features: Tensor) -> dict[str, Tensor]:
        """Every trained head's logits for the local step (extra heads on ``features.detach()``)."""
        raise NotImplementedError

    def served_logits(self, features: Tensor) -> Tensor:
        """The logits the model predicts with (evaluation, fine-tuning)."""
        raise NotImplementedError

    def forward(self, features: Tensor) -> Tensor:
        if self.collecting:
            self.collected = self.collect_logits(features)
            return next(iter(self.collected.values()))
        return self.served_logits(features)


class HeadRouter:
    """Runs ``model`` once per input and answers, per head, with that head's logits in the model's output."""

    def __init__(self, model: nn.Module, head: MultiHead) -> None:
        self.model, self.head = model, head
        self._input: Tensor | None = None
        self._output = None

    def view(self, name: str) -> Callable[[Tensor], object]:
        """A stand-in for the model whose logits are head ``name``'s."""
        def forward(inputs: Tensor):
            if inputs is not self._input:  # the first head of this batch: one backbone pass for all heads
                self._input, self._output = inputs, self.model(inputs)
            logits = self.head.collected[name]
            return (logits, *self._output[1:]) if isinstance(self._output, tuple) else logits
        return forward

    @contextlib.contextmanager
    def collecting(self) -> Iterator[None]:
        self.head.collecting = True
        try:
            yield
        finally:  # the next batch (or an evaluation) never sees this batch's graph
            self.head.collecting, self.head.collected = False, {}
            self._input = self._output = None


def multi_head_loss(loss_fn: LossFn, model: nn.Module, head: MultiHead, names: tuple[str, ...]) -> LossFn:
    """``Σ_name loss_fn(head name's view, batch)``: the task loss of every head, from one backbone pass."""
    router = HeadRouter(model, head)

    def loss(_: nn.Module, batch: dict, reduction: str = "mean") -> Tensor:
        with router.collecting():
            return sum(loss_fn(router.view(name), batch, reduction) for name in names)

    return loss
