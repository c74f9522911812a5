"""TaskModel: encoder + task decoder + output head, returning a prediction and an embedding.

Parameter groups for FedRep/FedPer are named here and nowhere else: the *head*
is the task-specific output layer (module ``head``: the 1x1 output convolution
of a dense task, the final Linear of class_scene); everything else (encoder and
decoder) is the *body*, the shared representation.

The embedding (what step 3 clusters) is read from one documented layer:

- ``embedding_layer="penultimate"`` (default): the decoder's last feature map,
  the input of the output head (for class_scene: the pre-logit features);
- ``embedding_layer="bottleneck"``: the decoder's coarsest fused map (for
  class_scene: the encoder's last map).

A feature map is pooled to a fixed-length vector: its global average, followed
by, if ``embedding_grid = g > 0``, the averages over a ``g x g`` grid of cells
(adaptive average pooling), so the dimension is ``C * (1 + g * g)`` whatever
the input size. class_scene's pre-logit features are already a vector and are
used as they are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from models.encoders import Encoder
from models.heads import DenseDecoder, PreLogits, make_activation
from models.tasks import TaskSpec
from utils.errors import TaskHetError

if TYPE_CHECKING:
    from models.frozen_encoder import FrozenEncoder

HEAD_MODULE = "head"
EMBEDDING_LAYERS = ("penultimate", "bottleneck")


def pool_embedding(feature_map: torch.Tensor, grid: int) -> torch.Tensor:
    """``[B, C, H, W]`` -> ``[B, C * (1 + grid**2)]``: global average, then the grid cells' averages."""
    pooled = [feature_map.mean(dim=(2, 3))]
    if grid > 0:
        pooled.append(F.adaptive_avg_pool2d(feature_map, grid).flatten(1))
    return torch.cat(pooled, dim=1)


class TaskModel(nn.Module):
    """Encoder, decoder (dense) or pre-logit layer (classification), and output head.

    ``forward(rgb)`` takes ``[B, 3, H, W]`` in [0, 1] (normalisation happens
    inside, with the encoder's mean/std) and returns ``(prediction, embedding)``:
    ``[B, out_channels, H, W]`` after the task's activation for dense tasks,
    logits ``[B, K]`` for class_scene; the embedding is ``[B, D]``.

    Args:
        task: the task.
        encoder: a built encoder (with its weights).
        out_channels: head outputs (the task's, or K for class_scene).
        embedding_grid: grid side of the pooled embedding (0 = global average only).
        embedding_layer: "penultimate" or "bottleneck" (see the module docstring).
        config: the arguments that rebuild this model (kept in checkpoints); its ``decoder_width``, when
            set, replaces the encoder's default width of the dense decoder.
    """

    def __init__(self, task: TaskSpec, encoder: Encoder, out_channels: int, embedding_grid: int,
                 embedding_layer: str, config: dict) -> None:
        super().__init__()
        if embedding_layer not in EMBEDDING_LAYERS:
            raise TaskHetError(f"embedding_layer {embedding_layer!r}: choose one of {', '.join(EMBEDDING_LAYERS)}")
        if embedding_grid < 0:
            raise TaskHetError(f"embedding_grid must be >= 0, got {embedding_grid}")
        self.task = task
        self.config = dict(config)
        self.embedding_grid = embedding_grid
        self.embedding_layer = embedding_layer
        self.encoder = encoder
        # Normalisation constants travel with the encoder's code, not in the state dict.
        self.register_buffer("mean", torch.tensor(encoder.mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(encoder.std).view(1, 3, 1, 1), persistent=False)
        if task.kind == "dense":
            self.decoder = DenseDecoder(encoder.channels, encoder.strides, config.get("decoder_width") or encoder.decoder_width)
            self.head = nn.Conv2d(self.decoder.out_channels, out_channels, 1)
        else:
            self.decoder = PreLogits(encoder.channels[-1], encoder.prelogit_hidden)
            self.head = nn.Linear(self.decoder.out_channels, out_channels)
        self.activation = make_activation(task.activation)
        # A frozen pretrained encoder's name, source and hash (set by build_task_model and load_task_model): its
        # checkpoints leave the encoder out (models/frozen_encoder.py). None: checkpoints hold the whole model.
        self.frozen_encoder: FrozenEncoder | None = None

    def normalise(self, rgb: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1] -> the encoder's input (its mean and std)."""
        return (rgb - self.mean) / self.std

    def forward(self, inputs: torch.Tensor | list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``inputs``: images ``[B, 3, H, W]`` in [0, 1], or the encoder's maps of them, finest first
        (a frozen encoder's cached features, ``datasets/encoded.py``); a dense output then has the
        finest map's size times its stride."""
        if torch.is_tensor(inputs):
            features, output_size = self.encoder(self.normalise(inputs)), inputs.shape[-2:]
        else:
            features = list(inputs)
            output_size = tuple(side * self.encoder.strides[0] for side in features[0].shape[-2:])
        if self.task.kind == "dense":
            penultimate, bottleneck = self.decoder(features, output_size)
        else:
            penultimate, bottleneck = self.decoder(features)
        prediction = self.activation(self.head(penultimate))
        chosen = penultimate if self.embedding_layer == "penultimate" else bottleneck
        embedding = chosen if chosen.dim() == 2 else pool_embedding(chosen, self.embedding_grid)
        return prediction, embedding

    def train(self, mode: bool = True) -> "TaskModel":
        """Train mode for everything except a frozen encoder, which stays in eval mode (its BatchNorm statistics fixed)."""
        super().train(mode)
        if self.config.get("freeze_encoder"):
            self.encoder.eval()
        return self

    def freeze_encoder_(self) -> "TaskModel":
        """Freeze the encoder: no gradient and eval mode, so training changes only the decoder and head.

        A pretrained encoder kept fixed: every optimizer (step 2's and each client's SGD) only sees
        parameters that require grad, and its BatchNorm statistics stay those of the pretrained weights
        (:meth:`train` keeps it in eval mode), so nothing under ``encoder`` changes and checkpoints can
        name it instead of storing it (``frozen_encoder``).
        """
        self.config["freeze_encoder"] = True
        self.encoder.requires_grad_(False)
        return self.train(self.training)

    def head_keys(self) -> list[str]:
        """State-dict keys of the task-specific output layer (personal in FedRep/FedPer)."""
        return [key for key in self.state_dict() if key.split(".", 1)[0] == HEAD_MODULE]

    def body_keys(self) -> list[str]:
        """State-dict keys of everything else (the shared representation)."""
        return [key for key in self.state_dict() if key.split(".", 1)[0] != HEAD_MODULE]
