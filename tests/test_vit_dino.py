"""vit_s16_dino: 32-px forward/backward, the CLS token as the classifier's input, both weights formats, errors."""

import os
import re

import pytest
import torch

import models.vit_dino as vit_dino
import models.weights as weights_module
from models import build_task_model
from models.encoders import IMAGENET_MEAN, IMAGENET_STD, build_encoder
from utils.errors import TaskHetError

NUM_CLASSES = 10


@pytest.fixture(autouse=True)
def isolated_caches(tmp_path, monkeypatch):
    """Empty weights caches, and no network: every file a test loads is one it wrote."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))

    def offline(source):
        raise OSError("Name or service not known")

    monkeypatch.setattr(weights_module, "source_download", offline)


@pytest.fixture(scope="module")
def official() -> dict[str, torch.Tensor]:
    """Random tensors under the official file's names and shapes (timm's backbone names, stripped of our wrapper).

    Tests take a shallow copy (``dict(official)``) before changing entries.
    """
    generator = torch.Generator().manual_seed(0)
    reference = vit_dino.create_timm_vit().state_dict()
    return {key: torch.randn(value.shape, generator=generator) for key, value in reference.items()}


def test_official_names_are_the_published_layout(official):
    names = list(official)
    # the official dino_deitsmall16_pretrain.pth: 4 + 12 blocks x 12 + 2 tensors, no classifier
    assert len(names) == 150
    assert names[:4] == ["cls_token", "pos_embed", "patch_embed.proj.weight", "patch_embed.proj.bias"]
    assert "blocks.0.attn.qkv.weight" in names and names[-2:] == ["norm.weight", "norm.bias"]
    shapes = {key: list(value.shape) for key, value in official.items()}
    assert shapes["pos_embed"] == [1, 197, 384] and shapes["blocks.0.attn.qkv.weight"] == [1152, 384]


@pytest.mark.parametrize("task", ["cifar_class", "depth_euclidean"])
def test_forward_backward_at_32_px(task):
    model = build_task_model(task, "vit_s16_dino", "none", num_classes=NUM_CLASSES, seed=0)
    rgb = torch.rand(2, 3, 32, 32)
    prediction, embedding = model(rgb)
    assert prediction.shape == ((2, NUM_CLASSES) if task == "cifar_class" else (2, 1, 32, 32))
    (prediction.float().mean() + embedding.mean()).backward()
    grads = {name: p.grad for name, p in model.encoder.named_parameters()}
    assert all(grad is not None and torch.isfinite(grad).all() for grad in grads.values())
    # the patch embedding and the position table (through its resampling) both learn
    assert grads["vit.patch_embed.proj.weight"].abs().sum() > 0 and grads["vit.pos_embed"].abs().sum() > 0


def test_classifier_is_linear_in_the_cls_token():
    model = build_task_model("digit_class", "vit_s16_dino", "none", num_classes=NUM_CLASSES, seed=0).eval()
    assert model.encoder.mean == IMAGENET_MEAN and model.encoder.std == IMAGENET_STD
    rgb = torch.rand(3, 3, 32, 32)
    with torch.no_grad():
        logits, embedding = model(rgb)
        mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
        cls = model.encoder.vit((rgb - mean) / std)  # timm's head input: the CLS token after the final norm
    assert cls.shape == (3, 384) and torch.allclose(embedding, cls, atol=1e-5)
    assert torch.allclose(logits, cls @ model.head.weight.T + model.head.bias, atol=1e-5)
    assert not any(key.startswith("decoder.") for key in model.state_dict())


def test_head_and_body_keys(official):
    model = build_task_model("cifar_class", "vit_s16_dino", "none", num_classes=NUM_CLASSES)
    head, body = model.head_keys(), model.body_keys()
    assert sorted(head) == ["head.bias", "head.weight"]
    assert sorted(body) == sorted(f"encoder.vit.{key}" for key in official)


def test_position_table_resampled_for_32_px_and_unchanged_at_224():
    encoder = build_encoder("vit_s16_dino")
    assert encoder.position_embedding((14, 14)) is encoder.vit.pos_embed
    small = encoder.position_embedding((2, 2))
    assert small.shape == (1, 5, 384)
    assert torch.equal(small[:, 0], encoder.vit.pos_embed[:, 0])  # the CLS entry is not resampled
    with torch.no_grad():  # a constant table stays constant whatever the grid
        encoder.vit.pos_embed[:, 1:] = 0.25
    assert torch.allclose(encoder.position_embedding((2, 3))[:, 1:], torch.full((1, 6, 384), 0.25), atol=1e-6)


def test_32_px_forward_equals_a_model_built_for_32_px():
    encoder = build_encoder("vit_s16_dino").eval()
    import timm

    fixed = timm.create_model(vit_dino.TIMM_ARCH, pretrained=False, num_classes=0, img_size=32).eval()
    state = encoder.vit.state_dict()
    state["pos_embed"] = encoder.position_embedding((2, 2)).detach()
    fixed.load_state_dict(state)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(encoder(x)[-1].flatten(1), fixed(x), atol=1e-5)


def assert_loaded(encoder, published):
    loaded = encoder.state_dict()
    assert sorted(loaded) == sorted(f"vit.{key}" for key in published)
    assert all(torch.equal(loaded[f"vit.{key}"], value) for key, value in published.items())


def test_official_torch_hub_file_loads_from_the_hub_folder_and_by_path(tmp_path, official):
    published = official
    hub_file = tmp_path / "torch" / "hub" / "checkpoints" / vit_dino.OFFICIAL_FILENAME
    hub_file.parent.mkdir(parents=True)
    torch.save(published, hub_file)
    assert_loaded(build_encoder("vit_s16_dino", "dino"), published)
    assert_loaded(build_encoder("vit_s16_dino", str(hub_file)), published)


def test_timm_safetensors_loads_from_the_hugging_face_cache(tmp_path, official):
    from safetensors.torch import save_file

    published = official
    snapshot = tmp_path / "hf" / "models--timm--vit_small_patch16_224.dino" / "snapshots" / ("b" * 40)
    snapshot.mkdir(parents=True)
    save_file(published, str(snapshot / "model.safetensors"))
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("b" * 40)
    assert_loaded(build_encoder("vit_s16_dino", "dino"), published)
    assert_loaded(build_encoder("vit_s16_dino", str(snapshot / "model.safetensors")), published)


def test_shape_mismatch_is_one_clear_error(tmp_path, official):
    published = dict(official)
    published["pos_embed"] = torch.zeros(1, 577, 384)  # a 384-px position grid
    path = tmp_path / "dino_384.pth"
    torch.save(published, path)
    message = re.escape(f"weights file {path} is not a DINO ViT-S/16 backbone for encoder vit_s16_dino: "
                        "pos_embed is [1, 577, 384] in the file, [1, 197, 384] in ViT-S/16 at 224 px")
    with pytest.raises(TaskHetError, match=message):
        build_encoder("vit_s16_dino", str(path))


@pytest.mark.parametrize("change, expected", [
    ("rename", r"1 unknown tensor names \(e\.g\. blocks\.0\.attn\.query\.weight\)"),
    ("drop", r"1 backbone tensors missing \(e\.g\. norm\.bias\)"),
    ("deeper", r"blocks\.12\.norm1\.weight has no counterpart in ViT-S/16"),
])
def test_unknown_missing_or_extra_tensors_are_refused(tmp_path, official, change, expected):
    published = dict(official)
    if change == "rename":
        published["blocks.0.attn.query.weight"] = published.pop("blocks.0.attn.qkv.weight")
    elif change == "drop":
        del published["norm.bias"]
    else:
        published["blocks.12.norm1.weight"] = torch.ones(384)
    shapes = {key: value.shape for key, value in official.items()}
    with pytest.raises(TaskHetError, match=expected):
        vit_dino.dino_to_timm(published, shapes, tmp_path / "other.pth")


def test_a_timm_classifier_is_dropped(tmp_path, official):
    with_head = {**official, "head.weight": torch.zeros(1000, 384), "head.bias": torch.zeros(1000)}
    shapes = {key: value.shape for key, value in official.items()}
    assert vit_dino.dino_to_timm(with_head, shapes, tmp_path / "f.pth").keys() == official.keys()


def test_missing_file_offline_names_file_folder_and_url(tmp_path):
    expected = os.path.join(str(tmp_path / "torch"), "hub", "checkpoints", vit_dino.OFFICIAL_FILENAME)
    with pytest.raises(TaskHetError, match="--weights dino for encoder vit_s16_dino: no cached file") as error:
        build_task_model("cifar_class", "vit_s16_dino", "dino", num_classes=NUM_CLASSES)
    assert f"Put {vit_dino.OFFICIAL_URL} at {expected}" in str(error.value)
    with pytest.raises(TaskHetError, match="--weights .*missing.pth for encoder vit_s16_dino: no such file"):
        build_encoder("vit_s16_dino", str(tmp_path / "missing.pth"))


def test_missing_weights_path_names_this_encoders_weights_and_where_to_get_the_file(tmp_path):
    # experiments/cifar100_fedavg.yaml names data/weights/dino_deitsmall16_pretrain.pth before anyone has put it there
    path = tmp_path / "weights" / vit_dino.OFFICIAL_FILENAME
    with pytest.raises(TaskHetError) as error:
        build_encoder("vit_s16_dino", str(path))
    hub = os.path.join(str(tmp_path / "torch"), "hub", "checkpoints", vit_dino.OFFICIAL_FILENAME)
    assert str(error.value) == (
        f"--weights {path} for encoder vit_s16_dino: no such file (expected none, dino, imagenet or a path to a weights "
        f"file); download {vit_dino.OFFICIAL_URL} to that path, or put {vit_dino.OFFICIAL_URL} at {hub} and pass "
        "--weights dino")
