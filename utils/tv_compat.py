"""Make ``import torchvision`` work on a CPU-only torch.

The torchvision wheel on the package registry is compiled against a CUDA build
of torch. On the CPU-only torch this project pins, its compiled extension
(``torchvision/_C.so``) fails to load, and ``import torchvision`` then dies with
"operator torchvision::nms does not exist": ``torchvision/_meta_registrations.py``
registers fake kernels for ``torchvision::nms`` and ``torchvision::qnms``
unconditionally, which needs the operators to be defined.

:func:`install` defines those two operators with pure-PyTorch kernels when, and
only when, the compiled extension cannot provide them. Everything else in
torchvision (models, transforms, datasets) is pure Python and works unchanged.
Only the detection ops are affected: ``torchvision.ops.*`` still refuses to run
without the extension (it checks for it), which this project never calls;
``torch.ops.torchvision.nms`` gets a correct, O(n^2) pure-PyTorch kernel.

Every project module that imports torchvision imports this module first, so the
fallback is present in worker processes too (a worker imports the
project modules it runs). Where the compiled ops load, it does nothing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

_NAMESPACE = "torchvision"


def _compiled_ops_loaded() -> bool:
    """Try to load torchvision's compiled extension without importing torchvision."""
    if hasattr(torch.ops.torchvision, "nms"):
        return True
    spec = importlib.util.find_spec("torchvision")
    if hasattr(torch.ops.torchvision, "nms"):  # finding torchvision ran the venv's start-up hook (torchvision_hook.py)
        return True
    if spec is None or not spec.submodule_search_locations:
        return False
    for library in Path(spec.submodule_search_locations[0]).glob("_C*.so"):
        try:
            torch.ops.load_library(str(library))
        except (OSError, RuntimeError):
            return False
    return hasattr(torch.ops.torchvision, "nms")


def nms_reference(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """Greedy non-maximum suppression; boxes are (N, 4) as (x1, y1, x2, y2).

    Returns the indices of the kept boxes, highest score first, like torchvision's.
    """
    order = torch.argsort(scores, descending=True)
    areas = (boxes[:, 2] - boxes[:, 0]).clamp(min=0) * (boxes[:, 3] - boxes[:, 1]).clamp(min=0)
    suppressed = torch.zeros(len(boxes), dtype=torch.bool, device=boxes.device)
    keep = []
    for index in order.tolist():
        if suppressed[index]:
            continue
        keep.append(index)
        top_left = torch.maximum(boxes[index, :2], boxes[:, :2])
        bottom_right = torch.minimum(boxes[index, 2:], boxes[:, 2:])
        intersection = (bottom_right - top_left).clamp(min=0).prod(dim=1)
        iou = intersection / (areas[index] + areas - intersection)
        suppressed |= iou > iou_threshold
    return torch.tensor(keep, dtype=torch.int64, device=boxes.device)


def _qnms(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    return nms_reference(boxes.dequantize(), scores.dequantize(), iou_threshold)


def install() -> torch.library.Library | None:
    """Register the fallbacks if needed; returns the library object (kept alive by torch)."""
    if _compiled_ops_loaded():
        return None
    library = torch.library.Library(_NAMESPACE, "DEF")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.impl("nms", nms_reference, "CompositeExplicitAutograd")
    library.impl("qnms", _qnms, "CompositeExplicitAutograd")
    return library


# torch keeps operator registrations for the life of the process only while the
# Library object lives, so the one created at import is held here. It is created
# once per process (module import is cached) and never mutated.
_FALLBACK_LIBRARY = install()
