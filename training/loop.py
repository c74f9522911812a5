"""The training loop's pieces, written once: a seeded loader, one batch, one evaluation.

``train_one_batch`` is step 2's optimisation step (the federated clients train
with ``network.local_train.local_train``, which takes FedProx's extra loss and
SCAFFOLD's gradient hook); ``evaluate`` is every step's evaluation of a split (step 2's
epochs, step 4's rounds); ``make_loader`` gives every step a loader whose order has its own
generator. Step 2's epoch loop with its run folder and checkpoints is :mod:`training.fit`.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, SequentialSampler
from tqdm import tqdm

from datasets.batch_reads import batch_reader
from models.tasks import TaskSpec, get_task
from utils.device import autocast, to_device
from utils.errors import TaskHetError
from utils.seeding import torch_generator

# accelerate is imported only for annotations: a Flower node, which imports this module in each message's process,
# never uses it.
if TYPE_CHECKING:
    from accelerate import Accelerator

METRICS_COLUMNS = ("epoch", "split", "metric", "value")
TRAIN_SPLIT, VAL_SPLIT, TEST_SPLIT = "train", "val", "test"
# What "selected" best.pt when no split did: data without validation rows keeps the last epoch (step 2's
# --last_epoch); the test split never selects.
LAST_EPOCH = "last"


def task_spec(task: TaskSpec | str) -> TaskSpec:
    """The task's spec, given it or its name."""
    return get_task(task) if isinstance(task, str) else task


def make_loader(dataset: Dataset, batch_size: int, shuffle: bool, seed: int, num_workers: int = 0,
                collate_fn=None, batch_reads: bool = True) -> DataLoader:
    """A DataLoader whose order comes from its own generator derived from ``seed`` (never the global RNG).

    The generator is ``loader.generator``: its state after an epoch decides the
    next epoch's order, which is what a checkpoint saves. ``collate_fn`` (default: torch's)
    builds a batch from items: a client's skews (partitioning/skews.py) transform it there.

    Without a ``collate_fn``, a dataset that reads whole batches (``read_batch``, see
    :mod:`datasets.batch_reads`) gets each batch in one read: the sampler is the one
    ``DataLoader(shuffle=...)`` builds, on the same generator, so the batches are the same.
    ``batch_reads=False`` keeps item reads: for a loader that ``accelerate`` prepares, whose
    ``split_batches`` needs torch's automatic batching (a ``batch_size``).
    """
    generator = torch_generator(seed, "loader")
    options = dict(generator=generator, num_workers=num_workers, persistent_workers=num_workers > 0,
                   pin_memory=torch.cuda.is_available())
    reader = batch_reader(dataset) if collate_fn is None and batch_reads else None
    if reader is not None:
        order = RandomSampler(dataset, generator=generator) if shuffle else SequentialSampler(dataset)
        return DataLoader(reader, batch_size=None, sampler=BatchSampler(order, batch_size, drop_last=False), **options)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, collate_fn=collate_fn, **options)


def train_one_batch(model: nn.Module, batch: dict, task: TaskSpec | str, optimizer: torch.optim.Optimizer,
                    device: torch.device, *, input_key: str, accelerator: Accelerator | None = None) -> float:
    """One optimisation step on one batch; the model must already be in training mode and on ``device``.

    Args:
        model: a :class:`models.TaskModel` (``model(images) -> (prediction, embedding)``).
        batch: a batch dict (``input_key`` plus the task's target and an optional ``"mask"``).
        task: the task (spec or name) whose loss is minimised.
        optimizer: steps the model's parameters.
        device: where the model lives; the batch is moved there.
        input_key: batch key of the model input (the data family's ``input_key``).
        accelerator: step 2's; ``model`` and ``optimizer`` are then the ones it prepared: the model's forward
            autocasts to its mixed precision, the backward scales fp16 losses, and under ``accelerate launch``
            each process holds one slice of the global batch.

    Returns:
        The loss of the batch as a float; with an accelerator, the mean over the processes (the global batch's
        loss when the slices are equal), the same number in every process.
    """
    spec = task_spec(task)
    batch = to_device(batch, device)
    with _forward_autocast(device, accelerator is None):
        prediction, _ = model(batch[input_key])
    # the loss in float32: bf16 sums over many pixels lose precision
    loss = spec.loss(prediction.float(), batch)
    optimizer.zero_grad(set_to_none=True)
    if accelerator is None:
        loss.backward()
    else:
        accelerator.backward(loss)
    optimizer.step()
    loss = loss.detach()
    if accelerator is not None:
        loss = accelerator.reduce(loss, reduction="mean")
    return float(loss)


def _forward_autocast(device: torch.device, own: bool) -> contextlib.AbstractContextManager:
    """utils.device's autocast (bf16 on CUDA), or none for a model prepared by accelerate (its forward autocasts)."""
    return autocast(device) if own else contextlib.nullcontext()


@torch.inference_mode()
def evaluate(model: nn.Module, loader: DataLoader, task: TaskSpec | str, device: torch.device, *,
             input_key: str, progress: bool = True, class_groups: dict[str, list[int]] | None = None,
             own_autocast: bool = True) -> dict[str, float]:
    """Loss and task metrics over a whole split (the model's train/eval mode is restored afterwards).

    ``input_key`` is the batch key of the model input (the data family's); ``progress=False``
    hides the bar (the federated engine evaluates every client per round). ``class_groups`` (a classifier's
    head/middle/tail classes, ``datasets.long_tail.class_groups``) adds each group's top-1.
    ``own_autocast=False`` is for a model prepared by accelerate, whose forward already autocasts to step 2's
    ``--mixed_precision`` (utils.device's bf16 autocast would override ``--mixed_precision no``).

    Returns:
        ``{"loss": ..., **task metrics}``. The loss is the mean of the batch
        losses weighted by batch size; the metrics accumulate over every valid
        pixel or sample of the split (see :mod:`models.metrics`).
    """
    spec = task_spec(task)
    was_training = model.training
    model.eval()
    metrics = spec.new_metrics(class_groups=class_groups) if class_groups else spec.new_metrics()
    loss_sum, count = 0.0, 0
    for batch in tqdm(loader, desc="evaluate", leave=False, dynamic_ncols=True, disable=not progress):
        batch = to_device(batch, device)
        with _forward_autocast(device, own_autocast):
            prediction, _ = model(batch[input_key])
        prediction = prediction.float()
        size = prediction.shape[0]
        loss_sum += float(spec.loss(prediction, batch)) * size
        count += size
        metrics.update(prediction, batch)
    model.train(was_training)
    if count == 0:
        raise TaskHetError("evaluation split is empty: the manifest has no samples in it")
    return {"loss": loss_sum / count, **metrics.compute()}
