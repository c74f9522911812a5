"""Task models: encoders (registry by name), task heads and :class:`TaskModel`.

``build_task_model`` builds one from names; ``load_task_model`` rebuilds one
from a step-2 checkpoint (``best.pt``). A frozen pretrained encoder is named in a checkpoint by
its source and hash instead of being stored (:mod:`models.frozen_encoder`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from models import efficientnet, encoders, heads, tasks, vit_dino  # noqa: F401  (explicit imports register every entry)
from models.encoders import build_encoder, list_encoders
from models.frozen_encoder import FrozenEncoder, restore_frozen_encoder
from models.task_model import TaskModel
from models.tasks import get_task, list_tasks
from utils.errors import TaskHetError
from utils.run_dir import load_checkpoint
from utils.seeding import derive_seed

__all__ = ["TaskModel", "build_task_model", "load_task_model", "list_encoders", "list_tasks", "get_task"]


def build_task_model(task: str, encoder: str = "resnet50", weights: str = "none", num_classes: int | None = None,
                     embedding_grid: int = 0, embedding_layer: str = "penultimate", seed: int | None = None,
                     freeze_encoder: bool = False, decoder_width: int | None = None) -> TaskModel:
    """Build the model of a task.

    Args:
        task: task name (see :func:`list_tasks`).
        encoder: encoder name (see :func:`list_encoders`).
        weights: encoder weights: "none" (random), "imagenet", "clip" or a file path.
        num_classes: the head's outputs where the data family gives them (``DataFamily.output_channels``): K of a
            classification task, the channels or classes of a dense task without its own ``out_channels``;
            ignored for the other dense tasks.
        embedding_grid: grid side of the pooled embedding (0 = global average only).
        embedding_layer: "penultimate" or "bottleneck" (see :mod:`models.task_model`).
        seed: when given, the random initialisation is drawn from a generator derived
            from it (the global RNG's state is restored afterwards).
        freeze_encoder: keep the encoder fixed (no gradient, eval mode): only the decoder and head train. With
            pretrained ``weights`` the model keeps the encoder's name, source and hash (``model.frozen_encoder``),
            and its checkpoints leave the encoder out (:mod:`models.frozen_encoder`).
        decoder_width: channels of a dense task's decoder at strides >= 4 (half at 2 and 1); None: the encoder's
            default. Its cost grows with the square of the width (a frozen encoder leaves the decoder most of the work).

    Returns:
        The model, on the CPU, in training mode.

    Raises:
        TaskHetError: unknown task or encoder, missing ``num_classes`` for a classification task,
            or weights that cannot be found or do not match the encoder.
    """
    spec = get_task(task)
    if spec.kind == "classification":
        if num_classes is None or num_classes < 2:
            raise TaskHetError(f"task {task} needs num_classes >= 2 (its data family's classes), got {num_classes}")
        out_channels = num_classes
    elif spec.out_channels is None:  # a folder family's dense target: the data declares its channels or classes
        if num_classes is None or num_classes < 1:
            raise TaskHetError(f"task {task} needs num_classes >= 1 (its target's channels or classes, from the data "
                               f"family's manifest), got {num_classes}")
        out_channels = num_classes
    else:
        out_channels = spec.out_channels
    if decoder_width is not None and decoder_width < 2:
        raise TaskHetError(f"decoder_width must be >= 2, got {decoder_width}")
    config = {"task": task, "encoder": encoder, "weights": weights, "num_classes": num_classes,
              "embedding_grid": embedding_grid, "embedding_layer": embedding_layer, "decoder_width": decoder_width}
    if seed is None:
        model = TaskModel(spec, build_encoder(encoder, weights), out_channels, embedding_grid, embedding_layer, config)
    else:
        # torch initialises modules from its global RNG; fork it so a seeded build
        # neither depends on nor disturbs the global state.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(seed, "init", task, encoder))
            model = TaskModel(spec, build_encoder(encoder, weights), out_channels, embedding_grid, embedding_layer, config)
    if not freeze_encoder:
        return model
    if weights != "none":  # random weights have no source to rebuild them from: such checkpoints stay whole
        model.frozen_encoder = FrozenEncoder(encoder, weights, model.encoder.state_dict())
    return model.freeze_encoder_()


def load_task_model(checkpoint_path: Path, what: str = "checkpoint") -> TaskModel:
    """Rebuild a model from a finished step's checkpoint (``{"model": state_dict, "model_config": config, ...}``).

    A checkpoint from a run folder marked ``INCOMPLETE`` (a step 2 that failed or is still running) is refused.
    A checkpoint that leaves out its frozen encoder gets it back from the recorded source, hash checked
    (a mismatch is one error line), and the model keeps it as ``frozen_encoder``; every other entry must be
    in the file (strict loading). A whole checkpoint (the format before, or a trained encoder) loads as it is.
    """
    checkpoint = load_checkpoint(checkpoint_path, what, keys=("model", "model_config"), finished=True)
    frozen = restore_frozen_encoder(checkpoint, checkpoint_path, what)
    try:
        config = dict(checkpoint["model_config"])
        # the checkpoint (with its encoder restored) holds every weight; no pretrained file is read twice
        model = build_task_model(**{**config, "weights": "none"})
        model.config = config
        model.load_state_dict(checkpoint["model"])
    except (TypeError, ValueError, RuntimeError, KeyError) as error:
        raise TaskHetError(f"{what} {checkpoint_path} does not hold a task model this code can rebuild "
                           f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})") from None
    if frozen is not None and config.get("freeze_encoder"):
        model.frozen_encoder = frozen
    return model
