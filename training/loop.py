"""The training loop's pieces, written once: a seeded loader, one batch, one evaluation.

``train_one_batch`` is step 2's optimisation step (the federated clients train
with ``network.local_train.local_train``, which takes FedProx's extra loss and
SCAFFOLD's gradient hook); ``evaluate`` is every step's evaluation of a split (step 2's
epochs, step 4's rounds); ``make_loader`` gives every step a loader whose order has its own
generator; ``trivial_predictors`` and ``constant_loss`` are the loss of a model that learned nothing (step 2
writes them beside its curves). Step 2's epoch loop with its run folder and checkpoints is :mod:`training.fit`.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, SequentialSampler
from tqdm import tqdm

import losses
from datasets.batch_reads import batch_reader
from datasets.taskonomy_domains import SEGMENT_IGNORE_INDEX
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
# The trivial predictors' constants (trivial_predictors): "zero" is every output 0; "median" the training targets'
# median per channel (the L1 losses); "prior" the log of the training classes' frequencies (the cross-entropies).
ZERO, MEDIAN, PRIOR = "zero", "median", "prior"
# Step 2's metrics.csv holds their losses as rows (epoch 0, split "trivial_<split>", metric "<predictor>_loss"): a
# split of their own, so that no reader of a split's metrics at an epoch (training.selection) takes them for the model's.
TRIVIAL_SPLIT_PREFIX, TRIVIAL_METRIC_SUFFIX = "trivial_", "_loss"
# The losses whose targets are class ids (the prediction has one more dimension: the classes' logits).
CLASS_ID_LOSSES = (losses.segmentation_loss, losses.classification_loss)
# The training values the median of a channel is taken over: every valid one up to this count (1024 maps of 64×64
# pixels, 83 of 224×224; 16 MiB), beyond it every 2nd, then every 4th, ... value in loader order (a regular thinning:
# the median is then approximate, the loss of the constant still exact).
MEDIAN_VALUES = 2 ** 22


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


def trivial_predictors(task: TaskSpec | str, train_loader: DataLoader, channels: int,
                       device: torch.device) -> dict[str, torch.Tensor]:
    """The constants of the trivial predictors of ``task``, from one pass over the training targets, no model.

    Each is one value per output channel (``[channels]``), predicted at every pixel (or for every sample) whatever
    the input: :func:`constant_loss` gives its loss. ``zero``: every output 0 (for class logits: the uniform
    distribution, loss ln K). The second is the best constant under the task's own loss, over the same valid
    targets that loss reads (``batch["mask"]``; segmentation also drops ``SEGMENT_IGNORE_INDEX``):

    * L1 (``losses.dense_l1_loss``: depth, edges, keypoints, ...): ``median``, the median per channel of the
      valid training targets, which minimises their mean absolute error (the mean would minimise a squared error,
      which no task trains on); on a map that is 0 on over half its pixels it is 0 as well. The median of an even
      count is the lower middle value (any value between the two middles is as good).
    * L1 plus angle (``losses.normal_loss``): ``median`` too; it minimises the L1 part only, so the best constant
      may score a little lower (the report then sees a trivial loss no better than the true best's).
    * cross-entropy (``losses.segmentation_loss``, ``losses.classification_loss``): ``prior``, the logits
      ``log((n_c + 1) / (n + channels))`` of the training classes' counts ``n_c``: the class prior, add-one
      smoothed so that a class absent from training has a finite loss.
    * any other loss: ``zero`` alone.

    Args:
        task: the task (spec or name).
        train_loader: the training split's batches (any order; never a loader accelerate prepared, whose order
            and slices belong to training).
        channels: the model's output channels (``C`` of a dense map, ``K`` classes of a classifier).
        device: where the batches go (the model's device: the targets are compared where evaluation compares them).
    """
    spec = task_spec(task)
    predictors = {ZERO: torch.zeros(channels)}
    if spec.loss_fn in (losses.dense_l1_loss, losses.normal_loss):
        predictors[MEDIAN] = _median_per_channel(spec, train_loader, channels, device)
    elif spec.loss_fn in CLASS_ID_LOSSES:
        counts = torch.zeros(channels, dtype=torch.float64)
        for batch in train_loader:
            batch = to_device(batch, device)
            target = batch[spec.domain]
            if spec.loss_fn is losses.segmentation_loss:  # the pixels segmentation_loss reads
                target = target[losses.valid_pixels(batch, target.unsqueeze(1))[:, 0] & (target != SEGMENT_IGNORE_INDEX)]
            counts += torch.bincount(target.reshape(-1).cpu(), minlength=channels)[:channels].double()
        predictors[PRIOR] = torch.log((counts + 1.0) / (counts.sum() + channels)).float()
    return predictors


def _median_per_channel(spec: TaskSpec, loader: DataLoader, channels: int, device: torch.device) -> torch.Tensor:
    """The lower median per channel of the valid float targets ``[B, C, H, W]`` (see :data:`MEDIAN_VALUES`)."""
    kept: list[list[torch.Tensor]] = [[] for _ in range(channels)]
    step = 1  # every step-th valid value of each batch is kept
    for batch in loader:
        batch = to_device(batch, device)
        target = batch[spec.domain].float()
        valid = losses.valid_pixels(batch, target)
        for channel in range(channels):
            kept[channel].append(target[:, channel][valid[:, channel]][::step].cpu())
        while sum(len(values) for values in kept[0]) > MEDIAN_VALUES:
            kept = [[torch.cat(values)[::2]] for values in kept]
            step *= 2
    return torch.stack([torch.cat(values).median() if sum(map(len, values)) else torch.tensor(0.0)
                        for values in kept])


@torch.inference_mode()
def constant_loss(task: TaskSpec | str, constant: torch.Tensor, loader: DataLoader, device: torch.device) -> float:
    """The loss over a whole split of predicting ``constant`` (one value per output channel) everywhere.

    The same loss and average as :func:`evaluate`'s: the task's loss per batch (its mask and ignored values
    included), weighted by the batch size. A dense target ``[B, C, H, W]`` gets ``constant`` along its channels;
    class ids (``[B, H, W]`` or ``[B]``, the cross-entropies' targets) get logits ``[B, C, H, W]`` or ``[B, C]``.
    """
    spec = task_spec(task)
    loss_sum, count = 0.0, 0
    for batch in loader:
        batch = to_device(batch, device)
        target = batch[spec.domain]
        if spec.loss_fn in CLASS_ID_LOSSES:
            shape = (target.shape[0], len(constant), *target.shape[1:])
        else:
            shape = target.shape
        view = [1] * len(shape)
        view[1] = len(constant)
        prediction = constant.to(device).view(view).expand(shape)
        size = shape[0]
        loss_sum += float(spec.loss(prediction, batch)) * size
        count += size
    if count == 0:
        raise TaskHetError("evaluation split is empty: the manifest has no samples in it")
    return loss_sum / count


def trivial_losses(task: TaskSpec | str, train_loader: DataLoader, loaders: dict[str, DataLoader], channels: int,
                   device: torch.device) -> dict[str, dict[str, float]]:
    """Split -> predictor (:func:`trivial_predictors`) -> its loss on that split (:func:`constant_loss`)."""
    predictors = trivial_predictors(task, train_loader, channels, device)
    return {split: {name: constant_loss(task, constant, loader, device) for name, constant in predictors.items()}
            for split, loader in loaders.items()}
