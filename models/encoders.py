"""Image encoders, registered by name, and their pretrained weights.

An encoder maps a normalised image ``[B, 3, H, W]`` to a feature pyramid: a list
of maps ``[B, channels[i], ~H/strides[i], ~W/strides[i]]``, finest first. CNNs
give one map per resolution (strides 2..32); ViTs give maps from several depths
at their one patch stride, which the decoder fuses (DPT-style) before it
upsamples. Each encoder names the normalisation its weights were trained with
(``mean``/``std``); :class:`models.task_model.TaskModel` applies it.

Weights (``--weights``): ``none`` (random init, only when asked for), a named
source (``imagenet``, ``clip``) read from the owning library's cache (torch hub
for torchvision, ``~/.cache/clip`` for the ``clip`` package, the Hugging Face
cache for timm) and downloaded there if missing, or from an installed pip package
that ships the file (``efficientnet_lite0``), or a file path. Without the
file and without a network the build stops with a :class:`TaskHetError` that
says which file to put where. A file whose tensors do not match the encoder is
an error too, never a partial load.
"""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from models.heads import conv_block
from models.weights import WeightSource, fetch_weights, read_weights_file
from utils.errors import TaskHetError
from utils.registry import Registry

LOGGER = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
NAMED_WEIGHTS = ("imagenet", "clip")


class Encoder(nn.Module):
    """Base class: a feature pyramid plus what a task model needs to know about it.

    Subclasses set ``channels``, ``strides`` (powers of two, finest first),
    ``mean``/``std``, ``decoder_width`` (the decoder's width that suits the
    encoder's capacity), ``pretrained`` (weight name -> sources, first cached
    one wins) and ``default_weights`` (what the CLI uses without ``--weights``).
    """

    channels: tuple[int, ...]
    strides: tuple[int, ...]
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    decoder_width: int = 128
    # Width of the Linear + ReLU between the last map and a classifier's Linear; None: the classifier is linear.
    prelogit_hidden: int | None = 512
    default_weights: str = "none"
    # Keys of published checkpoints that this encoder drops (classifier, final norm).
    ignored_keys: tuple[str, ...] = ()
    # Prefix under which published checkpoints nest this encoder's tensors ("visual." in CLIP's).
    file_prefix: str = ""
    # Prefix of this module's own keys that published checkpoints lack ("vit." around a timm model).
    module_prefix: str = ""

    @property
    def pretrained(self) -> dict[str, list[WeightSource]]:
        """Named weights this encoder can load: name -> candidate sources."""
        return {}

    def rename_file_keys(self, tensors: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
        """A published file's tensors under the names this encoder's architecture uses.

        Applied after ``file_prefix`` is stripped and before ``ignored_keys`` and
        ``module_prefix`` apply; the default keeps the names as they are.
        """
        return tensors

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:  # pragma: no cover - abstract
        raise NotImplementedError


ENCODERS: Registry[type[Encoder]] = Registry("encoder")


def list_encoders() -> list[str]:
    """Registered encoder names."""
    return ENCODERS.names()


# --------------------------------------------------------------------------- loading weights into an encoder


def match_state_dict(encoder: Encoder, name: str, tensors: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """Map a file's tensors onto the encoder's keys; a :class:`TaskHetError` on any mismatch."""
    if any(key.startswith("encoder.") for key in tensors):
        # a TaskHet checkpoint (best.pt): the encoder's own keys under "encoder."
        tensors = {key.removeprefix("encoder."): value for key, value in tensors.items() if key.startswith("encoder.")}
    else:
        prefix = encoder.file_prefix
        if prefix and any(key.startswith(prefix) for key in tensors):
            tensors = {key.removeprefix(prefix): value for key, value in tensors.items() if key.startswith(prefix)}
        tensors = encoder.rename_file_keys(tensors, path)
        ignored = re.compile("|".join(encoder.ignored_keys)) if encoder.ignored_keys else None
        tensors = {encoder.module_prefix + key: value for key, value in tensors.items()
                   if not (ignored and ignored.match(key))}
    expected = encoder.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong_shape = [key for key in expected if key in tensors and tensors[key].shape != expected[key].shape]
    if missing or unexpected or wrong_shape:
        problems = []
        if missing:
            problems.append(f"{len(missing)} missing tensors (e.g. {missing[0]})")
        if unexpected:
            problems.append(f"{len(unexpected)} unexpected tensors (e.g. {unexpected[0]})")
        if wrong_shape:
            key = wrong_shape[0]
            shapes = f"file {list(tensors[key].shape)} vs encoder {list(expected[key].shape)}"
            problems.append(f"{len(wrong_shape)} shape mismatches (e.g. {key}: {shapes})")
        raise TaskHetError(f"weights file {path} does not match encoder {name}: {'; '.join(problems)}")
    return tensors


def check_weights_name(encoder: Encoder, name: str, weights: str) -> None:
    """What :func:`load_encoder_weights` refuses before it reads a byte: a weight name the encoder does not offer, or
    a path that is no file. The pipeline calls it before step 0 (:func:`check_weights`)."""
    if weights == "none" or weights in encoder.pretrained:
        return
    if weights in NAMED_WEIGHTS:
        offered = ", ".join(["none", *encoder.pretrained, "PATH"])
        raise TaskHetError(f"--weights {weights}: encoder {name} has no {weights} weights; choose one of: {offered}")
    if not Path(weights).is_file():
        raise TaskHetError(missing_file_message(encoder, name, Path(weights)))


def encoder_outline(name: str) -> Encoder:
    """The registered encoder ``name`` on PyTorch's meta device: its attributes (the weights it offers, its channels)
    without a weight allocated or initialised. A real build only to read them took 0.2 s for ResNet-50 and 2.6 s for
    CLIP ViT-B/32 on the 2-core machine, and drew from torch's global RNG."""
    with torch.device("meta"):
        return ENCODERS.get(name)()


def check_weights(name: str, weights: str) -> None:
    """:func:`check_weights_name` for the registered encoder ``name`` (its :func:`encoder_outline`)."""
    check_weights_name(encoder_outline(name), name, weights)


def load_encoder_weights(encoder: Encoder, name: str, weights: str) -> None:
    """Load ``weights`` (a name from ``encoder.pretrained`` or a file path) into ``encoder`` in place."""
    check_weights_name(encoder, name, weights)
    torchscript = False
    if weights in encoder.pretrained:
        path, source = fetch_weights(name, weights, encoder.pretrained[weights])
        source.verify(path)
        torchscript = source.library == "clip"  # OpenAI ships CLIP as TorchScript; its hash was just checked
        LOGGER.info("encoder %s: %s weights from %s", name, source.description, path)
    else:
        path = Path(weights)
    tensors = match_state_dict(encoder, name, read_weights_file(path, torchscript), path)
    encoder.load_state_dict(tensors, strict=True)


def missing_file_message(encoder: Encoder, name: str, path: Path) -> str:
    """The error of a --weights PATH that is not a file: this encoder's own weight names, and where its published file
    comes from (an experiment file names such a path, e.g. data/weights/dino_deitsmall16_pretrain.pth, before it exists)."""
    offered = ", ".join(["none", *encoder.pretrained])
    message = f"--weights {path} for encoder {name}: no such file (expected {offered} or a path to a weights file)"
    for weights, sources in encoder.pretrained.items():  # the first name's first source: the one a download would use
        source = sources[0]
        fetch = source.url or f"https://huggingface.co/{source.repo_id}"
        return f"{message}; download {fetch} to that path, or put {source.where()} and pass --weights {weights}"
    return message


def build_encoder(name: str, weights: str = "none") -> Encoder:
    """The encoder called ``name`` with ``weights`` (``none``, ``imagenet``, ``clip`` or a file path)."""
    encoder = ENCODERS.get(name)()
    if weights != "none":
        load_encoder_weights(encoder, name, weights)
    return encoder


def default_weights(name: str) -> str:
    """The weights the CLI uses for encoder ``name`` when ``--weights`` is not given."""
    return ENCODERS.get(name).default_weights


# --------------------------------------------------------------------------- CNNs


def torchvision_models():
    """``torchvision.models``, imported on first use: torchvision takes seconds to import, which a model without a
    torchvision part (``small_cnn``, the ViTs) should not cost (a Flower node pays imports once per message)."""
    import utils.tv_compat  # noqa: F401  (before torchvision)
    import torchvision.models

    return torchvision.models


class ResNetEncoder(Encoder):
    """torchvision ResNet; attribute names match torchvision's so its checkpoints load as they are."""

    arch: str
    default_weights = "imagenet"
    ignored_keys = (r"fc\.",)

    def __init__(self) -> None:
        super().__init__()
        net = getattr(torchvision_models(), self.arch)(weights=None)
        self.conv1, self.bn1, self.relu, self.maxpool = net.conv1, net.bn1, net.relu, net.maxpool
        self.layer1, self.layer2, self.layer3, self.layer4 = net.layer1, net.layer2, net.layer3, net.layer4
        self.strides = (2, 4, 8, 16, 32)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        stem = self.relu(self.bn1(self.conv1(x)))
        c4 = self.layer1(self.maxpool(stem))
        c8 = self.layer2(c4)
        c16 = self.layer3(c8)
        return [stem, c4, c8, c16, self.layer4(c16)]


def _torchvision_sources(*weight_enums: object) -> list[WeightSource]:
    return [WeightSource(f"torchvision {weight}", "torchvision", url=weight.url) for weight in weight_enums]


@ENCODERS.register("resnet50")
class ResNet50(ResNetEncoder):
    """ResNet-50, the default; ImageNet weights are torchvision's IMAGENET1K_V2 (or V1 if only that is cached)."""

    arch = "resnet50"
    channels = (64, 256, 512, 1024, 2048)

    @property
    def pretrained(self) -> dict[str, list[WeightSource]]:
        weights = torchvision_models().ResNet50_Weights
        return {"imagenet": _torchvision_sources(weights.IMAGENET1K_V2, weights.IMAGENET1K_V1)}


@ENCODERS.register("resnet18")
class ResNet18(ResNetEncoder):
    """ResNet-18 with torchvision's IMAGENET1K_V1 weights; lighter, for CPU or quick runs."""

    arch = "resnet18"
    channels = (64, 64, 128, 256, 512)
    decoder_width = 96

    @property
    def pretrained(self) -> dict[str, list[WeightSource]]:
        return {"imagenet": _torchvision_sources(torchvision_models().ResNet18_Weights.IMAGENET1K_V1)}


@ENCODERS.register("resnet34")
class ResNet34(ResNetEncoder):
    """ResNet-34 with torchvision's IMAGENET1K_V1 weights; FedLoGe's CIFAR-100-LT backbone."""

    arch = "resnet34"
    channels = (64, 64, 128, 256, 512)
    decoder_width = 96

    @property
    def pretrained(self) -> dict[str, list[WeightSource]]:
        return {"imagenet": _torchvision_sources(torchvision_models().ResNet34_Weights.IMAGENET1K_V1)}


@ENCODERS.register("small_cnn")
class SmallCNN(Encoder):
    """Four stride-2 stages of two 3x3 conv-GroupNorm-ReLU blocks (~0.2 M parameters): for CPU runs and tests."""

    decoder_width = 64

    def __init__(self, widths: tuple[int, ...] = (16, 32, 64, 96)) -> None:
        super().__init__()
        stages, in_channels = [], 3
        for width in widths:
            stages.append(nn.Sequential(conv_block(in_channels, width, stride=2), conv_block(width, width)))
            in_channels = width
        self.stages = nn.ModuleList(stages)
        self.channels = tuple(widths)
        self.strides = tuple(2 ** (index + 1) for index in range(len(widths)))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        features = []
        for stage in self.stages:
            x = stage(x)
            features.append(x)
        return features


# --------------------------------------------------------------------------- ViTs

# Blocks whose outputs feed the decoder: the ends of the four quarters of a 12-block ViT.
VIT_FEATURE_BLOCKS = (2, 5, 8, 11)


@ENCODERS.register("clip_vit_b32")
class ClipViTB32(Encoder):
    """The visual tower of OpenAI CLIP ViT-B/32 (the ``clip`` package), the original code's encoder.

    Attribute names match the ``visual.*`` tensors of CLIP's checkpoint. The
    final ``ln_post``/``proj`` (CLIP's image-text projection) are not part of a
    dense encoder and are dropped. Position embeddings are resized bicubically
    when the input is not 224 px.
    """

    mean, std = CLIP_MEAN, CLIP_STD
    default_weights = "clip"
    file_prefix = "visual."
    ignored_keys = (r"ln_post\.", r"proj$")

    def __init__(self) -> None:
        super().__init__()
        with warnings.catch_warnings():
            # clip imports pkg_resources, which warns that it is deprecated
            warnings.simplefilter("ignore", UserWarning)
            from clip.model import VisionTransformer
        visual = VisionTransformer(input_resolution=224, patch_size=32, width=768, layers=12, heads=12, output_dim=512)
        self.conv1, self.class_embedding = visual.conv1, visual.class_embedding
        self.positional_embedding, self.ln_pre = visual.positional_embedding, visual.ln_pre
        self.transformer = visual.transformer
        self.channels = (768,) * len(VIT_FEATURE_BLOCKS)
        self.strides = (32,) * len(VIT_FEATURE_BLOCKS)

    @property
    def pretrained(self) -> dict[str, list[WeightSource]]:
        url = ("https://openaipublic.azureedge.net/clip/models/"
               "40d365715913c9da98579312b702a82c18be219cc2a73407c4526f58eba950af/ViT-B-32.pt")
        return {"clip": [WeightSource("OpenAI CLIP ViT-B/32", "clip", url=url)]}

    def _position_embedding(self, grid: tuple[int, int]) -> torch.Tensor:
        native = self.positional_embedding
        side = round((native.shape[0] - 1) ** 0.5)
        if grid == (side, side):
            return native
        patches = native[1:].reshape(1, side, side, -1).permute(0, 3, 1, 2)
        patches = F.interpolate(patches, size=grid, mode="bicubic", align_corners=False)
        return torch.cat([native[:1], patches.permute(0, 2, 3, 1).reshape(grid[0] * grid[1], -1)])

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        x = self.conv1(x)
        grid = (x.shape[2], x.shape[3])
        tokens = x.flatten(2).transpose(1, 2)
        cls = self.class_embedding.to(tokens.dtype).expand(tokens.shape[0], 1, -1)
        tokens = torch.cat([cls, tokens], dim=1) + self._position_embedding(grid).to(tokens.dtype)
        tokens = self.ln_pre(tokens).permute(1, 0, 2)  # CLIP's blocks take [tokens, batch, width]
        features = []
        for index, block in enumerate(self.transformer.resblocks):
            tokens = block(tokens)
            if index in VIT_FEATURE_BLOCKS:
                patch_tokens = tokens[1:].permute(1, 2, 0)
                features.append(patch_tokens.reshape(patch_tokens.shape[0], -1, *grid))
        return features


@ENCODERS.register("vit_s16")
class TimmViTS16(Encoder):
    """timm ViT-S/16 (any input size: padded to whole patches).

    ``imagenet`` means DINO's self-supervised ImageNet-1k weights (timm's
    ``vit_small_patch16_224.dino``), trained with the ImageNet mean/std used here.
    """

    default_weights = "imagenet"
    module_prefix = "vit."
    ignored_keys = (r"head\.", r"norm\.", r"fc_norm\.")

    def __init__(self) -> None:
        super().__init__()
        import timm

        self.vit = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=0, dynamic_img_size=True,
                                     dynamic_img_pad=True)
        # The final norm only serves the classifier token; intermediates are read before it.
        self.vit.norm = nn.Identity()
        self.channels = (self.vit.embed_dim,) * len(VIT_FEATURE_BLOCKS)
        self.strides = (16,) * len(VIT_FEATURE_BLOCKS)

    @property
    def pretrained(self) -> dict[str, list[WeightSource]]:
        return {"imagenet": [WeightSource("timm DINO ViT-S/16", "timm", repo_id="timm/vit_small_patch16_224.dino")]}

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return self.vit.forward_intermediates(x, indices=list(VIT_FEATURE_BLOCKS), norm=False, output_fmt="NCHW",
                                              intermediates_only=True)

