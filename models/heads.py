"""Task heads: a multi-scale dense decoder for pixel tasks and a classifier for class_scene.

The dense decoder is U-Net/FPN style: each encoder map is reduced by a 1x1
"lateral" convolution; starting from the coarsest stride, the decoder doubles
the resolution stage by stage, concatenates the laterals of that stride (U-Net
skip) and applies a 3x3 conv-GroupNorm-ReLU block, down to stride 1 (the input
resolution). ViT encoders give all maps at one stride; their laterals are summed
at the start (DPT-style fusion of depths) and the stages only upsample.

Upsampling is nearest-neighbour followed by a convolution: it has a
deterministic CUDA backward (bilinear does not), which ``--deterministic`` needs.
"""

from __future__ import annotations

import math
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

# Typical indoor depth in metres (Taskonomy depth is at most ~15.6 m, mostly 1-6 m).
DEPTH_SCALE_METRES = 4.0


class DepthSoftplus(nn.Module):
    """``scale * softplus(x)``: positive depth in metres.

    The depth loss is L1 in metres, whose gradient has the same size at every
    pixel; without the scale an untrained head (output ~0.7 m) needs hundreds of
    steps just to reach the scene's depth range. With it, the untrained model
    predicts ~2.8 m and a unit change of the pre-activation moves metres.
    """

    def __init__(self, scale: float = DEPTH_SCALE_METRES) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * F.softplus(x)


ACTIVATIONS = MappingProxyType(
    {"identity": nn.Identity, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh, "depth_softplus": DepthSoftplus}
)


def make_activation(name: str) -> nn.Module:
    """The output activation called ``name`` (identity, sigmoid, tanh, depth_softplus)."""
    return ACTIVATIONS[name]()


def group_norm(channels: int) -> nn.GroupNorm:
    """GroupNorm with 8 groups (fewer when the channels do not divide)."""
    return nn.GroupNorm(math.gcd(8, channels), channels)


def conv_block(in_channels: int, out_channels: int, stride: int = 1) -> nn.Sequential:
    """3x3 convolution, GroupNorm, ReLU.

    GroupNorm, not BatchNorm: no running statistics, so a model behaves the same
    in training and evaluation even after few steps on small batches, and
    federated averaging has no batch statistics to average across non-IID
    clients (Hsieh et al., 2020, "The Non-IID Data Quagmire").
    """
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False),
        group_norm(out_channels),
        nn.ReLU(inplace=True),
    )


def decoder_width_at(stride: int, width: int) -> int:
    """Channels at a stride: ``width`` from stride 4 up, half of it at strides 2 and 1."""
    return width if stride >= 4 else max(width // 2, 8)


class DenseDecoder(nn.Module):
    """Feature pyramid -> feature map at the input resolution (the penultimate layer of a dense task).

    Args:
        channels: channels of each encoder map, finest first.
        strides: stride of each map (powers of two).
        width: decoder channels at strides >= 4 (half at strides 2 and 1).
    """

    def __init__(self, channels: tuple[int, ...], strides: tuple[int, ...], width: int) -> None:
        super().__init__()
        self.strides = tuple(strides)
        self.coarsest = max(strides)
        self.laterals = nn.ModuleList(nn.Conv2d(c, decoder_width_at(s, width), 1) for c, s in zip(channels, strides))
        top_width = decoder_width_at(self.coarsest, width)
        self.top = conv_block(top_width, top_width)
        self.stage_strides = [self.coarsest >> level for level in range(1, int(math.log2(self.coarsest)) + 1)]
        stages, previous = [], top_width
        for stride in self.stage_strides:
            skips = sum(decoder_width_at(stride, width) for s in strides if s == stride)
            stages.append(conv_block(previous + skips, decoder_width_at(stride, width)))
            previous = decoder_width_at(stride, width)
        self.stages = nn.ModuleList(stages)
        self.out_channels = previous
        self.bottleneck_channels = top_width

    def forward(self, features: list[torch.Tensor], output_size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (penultimate map ``[B, out_channels, *output_size]``, bottleneck map at the coarsest stride)."""
        skips: dict[int, list[torch.Tensor]] = {}
        for lateral, feature, stride in zip(self.laterals, features, self.strides):
            skips.setdefault(stride, []).append(lateral(feature))
        bottleneck = self.top(torch.stack(skips[self.coarsest]).sum(0))
        x = bottleneck
        for stride, stage in zip(self.stage_strides, self.stages):
            if stride in skips:
                size = skips[stride][0].shape[-2:]
            elif stride == 1:
                size = output_size
            else:
                size = (math.ceil(output_size[0] / stride), math.ceil(output_size[1] / stride))
            x = stage(torch.cat([F.interpolate(x, size=size, mode="nearest"), *skips.get(stride, [])], dim=1))
        return x, bottleneck


class PreLogits(nn.Module):
    """Global average pool of the coarsest encoder map, then Linear + ReLU: the features a classifier reads.

    ``hidden=None`` skips the Linear + ReLU, so the classifier is linear in the pooled map
    (a ViT's CLS token feeding a linear head, as in DINO's linear evaluation).
    """

    def __init__(self, in_channels: int, hidden: int | None = 512) -> None:
        super().__init__()
        self.fc = nn.Linear(in_channels, hidden) if hidden else None
        self.out_channels = hidden or in_channels

    def forward(self, features: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (pre-logit features ``[B, out_channels]``, the coarsest encoder map)."""
        coarsest = features[-1]
        pooled = coarsest.mean(dim=(2, 3))
        return (F.relu(self.fc(pooled)) if self.fc is not None else pooled), coarsest
