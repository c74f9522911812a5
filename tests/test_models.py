"""Every encoder and every task head: forward/backward on a tiny input, parameter groups, weights loading."""

import os

import pytest
import torch

import models.weights as weights_module
from models import build_task_model, list_encoders, list_tasks, load_task_model
from models.encoders import build_encoder, check_weights, encoder_outline, match_state_dict
from models.tasks import get_task
from utils.errors import TaskHetError

NUM_SCENES = 5


@pytest.fixture(autouse=True)
def isolated_caches(tmp_path, monkeypatch):
    """Point every weights cache at an empty folder: tests never see (or fill) a real cache."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


@pytest.mark.parametrize("encoder", list_encoders())
def test_every_encoder_forward_backward(encoder):
    size = (40, 56)  # not square, not a multiple of the ViTs' patch sizes
    model = build_task_model("depth_euclidean", encoder, "none", embedding_grid=1, seed=0)
    rgb = torch.rand(2, 3, *size)
    prediction, embedding = model(rgb)
    assert prediction.shape == (2, 1, *size)
    assert torch.all(prediction >= 0), "depth uses a softplus output"
    assert embedding.shape[0] == 2 and embedding.dim() == 2
    (prediction.mean() + embedding.mean()).backward()
    encoder_grads = [p.grad for p in model.encoder.parameters()]
    assert all(grad is not None and torch.isfinite(grad).all() for grad in encoder_grads)
    assert any(grad.abs().sum() > 0 for grad in encoder_grads)


@pytest.mark.parametrize("task_name", list_tasks())
def test_every_task_head_forward_backward(task_name):
    task = get_task(task_name)
    model = build_task_model(task_name, "small_cnn", num_classes=NUM_SCENES, seed=0)
    prediction, embedding = model(torch.rand(3, 3, 24, 24))
    if task.kind == "dense":
        assert prediction.shape == (3, task.out_channels or NUM_SCENES, 24, 24)  # or the data's (folder families)
    else:
        assert prediction.shape == (3, NUM_SCENES)
    low, high = {"sigmoid": (0, 1), "tanh": (-1, 1), "depth_softplus": (0, float("inf"))}.get(task.activation, (-float("inf"), float("inf")))
    assert low <= float(prediction.detach().min()) and float(prediction.detach().max()) <= high
    assert embedding.shape[0] == 3
    prediction.float().sum().backward()
    assert all(p.grad is not None for p in model.head.parameters())


@pytest.mark.parametrize("task_name", ["normal", "class_scene"])
def test_head_and_body_keys_split_the_state_dict(task_name):
    model = build_task_model(task_name, "small_cnn", num_classes=NUM_SCENES)
    head, body = model.head_keys(), model.body_keys()
    assert sorted(head) == ["head.bias", "head.weight"]
    assert set(head).isdisjoint(body)
    assert sorted(head + body) == sorted(model.state_dict())
    assert any(key.startswith("encoder.") for key in body) and any(key.startswith("decoder.") for key in body)


def test_embedding_is_penultimate_map_pooled_with_grid():
    model = build_task_model("reshading", "small_cnn", embedding_grid=2)
    channels = model.decoder.out_channels
    rgb = torch.rand(2, 3, 32, 32)
    _, embedding = model(rgb)
    assert embedding.shape == (2, channels * (1 + 4))
    features = model.encoder((rgb - model.mean) / model.std)
    penultimate, _ = model.decoder(features, (32, 32))
    assert torch.allclose(embedding[:, :channels], penultimate.mean(dim=(2, 3)), atol=1e-6)
    assert torch.allclose(embedding[:, channels:channels + 1], penultimate[:, :1, :16, :16].mean(dim=(1, 2, 3)).unsqueeze(1), atol=1e-6)


def test_bottleneck_embedding_and_class_scene_prelogits():
    dense = build_task_model("normal", "small_cnn", embedding_layer="bottleneck")
    assert dense(torch.rand(2, 3, 32, 32))[1].shape == (2, dense.decoder.bottleneck_channels)
    classifier = build_task_model("class_scene", "small_cnn", num_classes=NUM_SCENES, embedding_grid=3)
    logits, embedding = classifier(torch.rand(2, 3, 32, 32))
    assert embedding.shape == (2, classifier.decoder.out_channels)
    assert torch.allclose(logits, classifier.head(embedding), atol=1e-5)
    with pytest.raises(TaskHetError, match="embedding_layer"):
        build_task_model("normal", "small_cnn", embedding_layer="stem")


def test_seeded_build_is_reproducible_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    first = build_task_model("normal", "small_cnn", seed=3).state_dict()
    second = build_task_model("normal", "small_cnn", seed=3).state_dict()
    other = build_task_model("normal", "small_cnn", seed=4).state_dict()
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(first[key], second[key]) for key in first)
    assert not all(torch.equal(first[key], other[key]) for key in first)


@pytest.mark.parametrize("encoder", list_encoders())
def test_checking_a_weights_name_allocates_no_weight_and_leaves_the_global_rng_alone(encoder):
    """The checks before step 0 read what an encoder offers from its outline on the meta device: a real build
    allocated and initialised every weight (CLIP ViT-B/32: 2.6 s) and drew from torch's global RNG."""
    outline = encoder_outline(encoder)
    assert {tensor.device.type for tensor in [*outline.parameters(), *outline.buffers()]} == {"meta"}
    state = torch.get_rng_state()
    for weights in ("none", *outline.pretrained):
        check_weights(encoder, weights)
    assert torch.equal(torch.get_rng_state(), state)
    with pytest.raises(TaskHetError, match=f"--weights missing/w.pt for encoder {encoder}: no such file"):
        check_weights(encoder, "missing/w.pt")


def test_load_task_model_round_trip(tmp_path):
    model = build_task_model("class_scene", "small_cnn", num_classes=NUM_SCENES, embedding_grid=1, seed=1).eval()
    path = tmp_path / "best.pt"
    torch.save({"model": model.state_dict(), "model_config": model.config}, path)
    loaded = load_task_model(path).eval()
    rgb = torch.rand(2, 3, 32, 32)
    assert loaded.config == model.config
    for mine, theirs in zip(model(rgb), loaded(rgb)):
        assert torch.equal(mine, theirs)


def test_bad_names_are_one_clear_error():
    with pytest.raises(TaskHetError, match="unknown task 'depth'.*depth_euclidean"):
        build_task_model("depth", "small_cnn")
    with pytest.raises(TaskHetError, match="unknown encoder 'resnet51'.*resnet50"):
        build_task_model("normal", "resnet51")
    with pytest.raises(TaskHetError, match="num_classes"):
        build_task_model("class_scene", "small_cnn")
    with pytest.raises(TaskHetError, match="small_cnn has no imagenet weights"):
        build_task_model("normal", "small_cnn", "imagenet")
    with pytest.raises(TaskHetError, match="no such file"):
        build_task_model("normal", "small_cnn", "missing/weights.pt")


def test_weights_file_for_another_encoder_is_refused(tmp_path):
    path = tmp_path / "resnet18.pth"
    torch.save(build_encoder("resnet18").state_dict(), path)
    with pytest.raises(TaskHetError, match=r"resnet18.pth does not match encoder small_cnn: \d+ missing"):
        build_task_model("normal", "small_cnn", str(path))
    with pytest.raises(TaskHetError, match="does not match encoder resnet50.*shape mismatch"):
        build_task_model("normal", "resnet50", str(path))


def test_weights_file_in_torchvision_format_loads_exactly(tmp_path):
    import utils.tv_compat  # noqa: F401
    import torchvision

    reference = torchvision.models.resnet18(weights=None).state_dict()  # includes the classifier fc.*
    path = tmp_path / "resnet18_imagenet.pth"
    torch.save(reference, path)
    model = build_task_model("normal", "resnet18", str(path))
    loaded = model.encoder.state_dict()
    assert all(torch.equal(loaded[key], reference[key]) for key in loaded)


def test_step2_checkpoint_as_weights_file(tmp_path):
    source = build_task_model("normal", "small_cnn", seed=5)
    path = tmp_path / "best.pt"
    torch.save({"model": source.state_dict(), "model_config": source.config}, path)
    target = build_task_model("segment_semantic", "small_cnn", str(path))
    theirs = source.encoder.state_dict()
    assert all(torch.equal(value, theirs[key]) for key, value in target.encoder.state_dict().items())


def test_named_weights_come_from_the_torch_hub_cache_and_must_match_the_published_hash(tmp_path, monkeypatch):
    reference = build_encoder("resnet18").state_dict()
    cached = tmp_path / "torch" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    cached.parent.mkdir(parents=True)
    torch.save(reference, cached)
    with pytest.raises(TaskHetError, match=r"resnet18-f37072fd.pth is not the published .* does not start with f37072fd"):
        build_encoder("resnet18", "imagenet")  # our stand-in file is not torchvision's
    import hashlib

    digest = hashlib.sha256(cached.read_bytes()).hexdigest()
    monkeypatch.setattr(weights_module.WeightSource, "published_sha256", lambda source: digest[:8])
    loaded = build_encoder("resnet18", "imagenet").state_dict()
    assert all(torch.equal(loaded[key], reference[key]) for key in reference)


def test_offline_without_cache_says_what_to_put_where(tmp_path, monkeypatch):
    def offline(source):
        raise OSError("Name or service not known")

    monkeypatch.setattr(weights_module, "source_download", offline)
    expected = os.path.join(str(tmp_path / "torch"), "hub", "checkpoints", "resnet50-11ad3fa6.pth")
    with pytest.raises(TaskHetError, match="no cached file and the download failed") as error:
        build_task_model("normal", "resnet50", "imagenet")
    assert expected in str(error.value) and "https://download.pytorch.org/models/resnet50-11ad3fa6.pth" in str(error.value)
    with pytest.raises(TaskHetError, match=r"Put https://openaipublic.*ViT-B-32.pt at .*home/.cache/clip/ViT-B-32.pt"):
        build_encoder("clip_vit_b32", "clip")


def test_vit_s16_imagenet_from_the_hugging_face_cache(tmp_path):
    from safetensors.torch import save_file

    encoder = build_encoder("vit_s16")
    # a timm checkpoint: keys without our "vit." wrapper, plus the final norm and a classifier
    published = {key.removeprefix("vit."): torch.randn_like(value) for key, value in encoder.state_dict().items()}
    published.update({"norm.weight": torch.ones(384), "norm.bias": torch.zeros(384), "head.weight": torch.zeros(10, 384)})
    snapshot = tmp_path / "hf" / "models--timm--vit_small_patch16_224.dino" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    save_file({key: value.contiguous() for key, value in published.items()}, str(snapshot / "model.safetensors"))
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("a" * 40)
    loaded = build_encoder("vit_s16", "imagenet").state_dict()
    assert all(torch.equal(loaded[key], published[key.removeprefix("vit.")]) for key in loaded)


def test_clip_checkpoint_keys_map_onto_the_visual_tower(tmp_path):
    encoder = build_encoder("clip_vit_b32")
    full = {f"visual.{key}": value for key, value in encoder.state_dict().items()}
    full.update({"visual.proj": torch.zeros(768, 512), "visual.ln_post.weight": torch.ones(768),
                 "visual.ln_post.bias": torch.zeros(768), "token_embedding.weight": torch.zeros(10, 512)})
    mapped = match_state_dict(encoder, "clip_vit_b32", full, tmp_path / "ViT-B-32.pt")
    assert sorted(mapped) == sorted(encoder.state_dict())
    del full["visual.conv1.weight"]
    with pytest.raises(TaskHetError, match="1 missing tensors .e.g. conv1.weight"):
        match_state_dict(encoder, "clip_vit_b32", full, tmp_path / "ViT-B-32.pt")
