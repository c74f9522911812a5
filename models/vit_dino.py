"""DINO ViT-S/16 (``vit_s16_dino``): timm's ``vit_small_patch16_224`` with DINO's self-supervised weights.

The weights come from one local file, in either published format:

- the official torch-hub file ``dino_deitsmall16_pretrain.pth`` (facebookresearch/dino's
  ``dino_vits16``, backbone only: ``cls_token``, ``pos_embed`` ``[1, 197, 384]``,
  ``patch_embed.proj.*``, ``blocks.{0..11}.{norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2}.*``,
  ``norm.*``), looked for in torch hub's checkpoints folder (where
  ``torch.hub.load("facebookresearch/dino:main", "dino_vits16")`` leaves it);
- timm's ``model.safetensors`` of ``timm/vit_small_patch16_224.dino``, in the Hugging Face cache.

DINO's ``vision_transformer.py`` was derived from timm's, so both files use timm's
tensor names; :func:`dino_to_timm` still checks every name against the official
layout and every shape against timm's model, so a file of another architecture
(ViT-B, patch 8, a 384-px position grid) is refused by name, never loaded by position.

Position embeddings are resampled to the input's patch grid on every forward
(timm's ``dynamic_img_size``, bicubic :func:`timm.layers.resample_abs_pos_embed`):
the state dict keeps the 224-px ``[1, 197, 384]`` table, so the file loads as it
is and a 32-px input (a 2x2 grid) works as well as a 224-px one (left unchanged).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from models.encoders import ENCODERS, VIT_FEATURE_BLOCKS, Encoder
from models.weights import WeightSource
from utils.errors import TaskHetError

ENCODER_NAME = "vit_s16_dino"
TIMM_ARCH = "vit_small_patch16_224"
OFFICIAL_FILENAME = "dino_deitsmall16_pretrain.pth"
OFFICIAL_URL = f"https://dl.fbaipublicfiles.com/dino/dino_deitsmall16_pretrain/{OFFICIAL_FILENAME}"
TIMM_REPO = "timm/vit_small_patch16_224.dino"
# Stride given to the CLS token's 1x1 map: coarser than the patch maps (16), so a dense
# decoder starts from the global token and the patch maps join it at stride 16.
CLS_STRIDE = 32

# Every tensor name of the official backbone file (and of timm's backbone).
OFFICIAL_KEY = re.compile(
    r"cls_token|pos_embed|patch_embed\.proj\.(weight|bias)|norm\.(weight|bias)"
    r"|blocks\.\d+\.(norm1|attn\.qkv|attn\.proj|norm2|mlp\.fc1|mlp\.fc2)\.(weight|bias)"
)
# A timm classifier that a fine-tuned timm file may carry: not part of the encoder, dropped.
CLASSIFIER_KEY = re.compile(r"head\.(weight|bias)")

# "dino" is the name; "imagenet" says the same file (DINO trained on ImageNet-1k without labels),
# so a command that asks every encoder for --weights imagenet works here too, as for vit_s16.
DINO_SOURCES = (
    # torch hub's checkpoints folder: the one torchvision's files use (models.weights: library "torchvision")
    WeightSource("DINO ViT-S/16 backbone (facebookresearch/dino torch-hub file)", "torchvision", url=OFFICIAL_URL),
    WeightSource("timm DINO ViT-S/16 (vit_small_patch16_224.dino)", "timm", repo_id=TIMM_REPO),
)


def create_timm_vit() -> nn.Module:
    """timm's ViT-S/16 without classifier, any input size (position table resampled, input padded to whole patches)."""
    import timm

    return timm.create_model(TIMM_ARCH, pretrained=False, num_classes=0, dynamic_img_size=True, dynamic_img_pad=True)


def dino_to_timm(tensors: dict[str, torch.Tensor], reference: dict[str, torch.Size], path: Path) -> dict[str, torch.Tensor]:
    """A DINO file's tensors (official torch-hub or timm names) under timm's backbone names, shapes checked.

    Args:
        tensors: the file's tensors (``module.`` already stripped by the reader).
        reference: timm's backbone names and shapes.
        path: the file (for messages).

    Returns:
        The backbone tensors by timm name (a timm classifier ``head.*`` is dropped).

    Raises:
        TaskHetError: a name that is not a ViT backbone tensor, or a tensor whose shape differs
            from timm's ViT-S/16 (the first one is named, with both shapes).
    """
    problem = f"weights file {path} is not a DINO ViT-S/16 backbone for encoder {ENCODER_NAME}"
    unknown = [key for key in tensors if not (OFFICIAL_KEY.fullmatch(key) or CLASSIFIER_KEY.fullmatch(key))]
    if unknown:
        raise TaskHetError(f"{problem}: {len(unknown)} unknown tensor names (e.g. {unknown[0]}); expected the names "
                           f"of {OFFICIAL_FILENAME} or of {TIMM_REPO}'s model.safetensors")
    backbone = {key: value for key, value in tensors.items() if not CLASSIFIER_KEY.fullmatch(key)}
    for key, value in backbone.items():
        if key not in reference:  # e.g. blocks.12.* of a deeper ViT
            raise TaskHetError(f"{problem}: {key} has no counterpart in ViT-S/16 (12 blocks)")
        if value.shape != reference[key]:
            raise TaskHetError(f"{problem}: {key} is {list(value.shape)} in the file, {list(reference[key])} in "
                               "ViT-S/16 at 224 px")
    missing = [key for key in reference if key not in backbone]
    if missing:
        raise TaskHetError(f"{problem}: {len(missing)} backbone tensors missing (e.g. {missing[0]})")
    return backbone


@ENCODERS.register(ENCODER_NAME)
class ViTS16Dino(Encoder):
    """DINO ViT-S/16 (~21.7 M parameters): the CLS token for classifiers, patch maps for dense tasks.

    ``forward`` returns five maps:

    - four patch-token maps ``[B, 384, ceil(H/16), ceil(W/16)]``, the outputs of blocks 3, 6,
      9 and 12 before the final norm (as ``vit_s16``), stride 16;
    - last, the CLS token after the final LayerNorm (DINO's image feature, what its linear
      evaluation reads) as a ``[B, 384, 1, 1]`` map, listed at stride 32.

    A classification task's ``PreLogits`` averages the last map and, with ``prelogit_hidden = None``,
    passes it on as it is: the 384-d CLS token feeds the linear head and is the task's embedding. A dense task's decoder starts from the CLS map (its
    coarsest stride), broadcasts it onto the patch grid where the four patch maps join
    (DPT-style), then upsamples to the input size.

    Weights: ``dino`` (alias ``imagenet``) or a file path, in the official torch-hub format or
    timm's safetensors (see the module docstring). Normalisation: ImageNet mean/std, as DINO trained.
    """

    default_weights = "dino"
    module_prefix = "vit."
    prelogit_hidden = None  # the CLS token feeds the classifier's Linear directly

    def __init__(self) -> None:
        super().__init__()
        self.vit = create_timm_vit()
        width = self.vit.embed_dim
        self.channels = (width,) * (len(VIT_FEATURE_BLOCKS) + 1)
        self.strides = (self.vit.patch_embed.patch_size[0],) * len(VIT_FEATURE_BLOCKS) + (CLS_STRIDE,)

    @property
    def pretrained(self) -> dict[str, list[WeightSource]]:
        return {"dino": list(DINO_SOURCES), "imagenet": list(DINO_SOURCES)}

    def rename_file_keys(self, tensors: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
        reference = {key: value.shape for key, value in self.vit.state_dict().items()}
        return dino_to_timm(tensors, reference, path)

    def position_embedding(self, grid: tuple[int, int]) -> torch.Tensor:
        """The position table for a ``grid`` of patches, ``[1, 1 + grid[0] * grid[1], 384]`` (what forward adds).

        The 14x14 table itself at 224 px; otherwise its patch part resampled bicubically
        (with antialiasing when shrinking), the CLS entry kept.
        """
        from timm.layers import resample_abs_pos_embed

        return resample_abs_pos_embed(self.vit.pos_embed, new_size=list(grid), old_size=list(self.vit.patch_embed.grid_size),
                                      num_prefix_tokens=self.vit.num_prefix_tokens)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        tokens, patch_maps = self.vit.forward_intermediates(x, indices=list(VIT_FEATURE_BLOCKS), norm=False,
                                                            output_fmt="NCHW")
        cls = tokens[:, 0]  # after the final norm, as DINO's and timm's heads read it
        return [*patch_maps, cls[:, :, None, None]]
