"""Every task's loss: 0 on a perfect prediction, positive otherwise, blind to masked pixels."""

import pytest
import torch

from datasets.taskonomy_domains import SEGMENT_IGNORE_INDEX
from losses import channel_cosine, segmentation_loss
from models.tasks import get_task, list_tasks

SIZE = 8
NUM_SCENES = 5


def channels(task) -> int:
    """The task's output channels; a folder family's target declares them in the data (here: NUM_SCENES)."""
    return task.out_channels or NUM_SCENES


def make_batch(task_name: str, seed: int = 0) -> dict:
    """A batch of 2 with a random target for the task and a mask with some invalid pixels."""
    generator = torch.Generator().manual_seed(seed)
    task = get_task(task_name)
    mask = torch.rand(2, 1, SIZE, SIZE, generator=generator) > 0.3
    batch = {"mask": mask}
    if task.kind == "classification":
        batch[task.domain] = torch.tensor([1, 3])
    elif task.loss_fn is segmentation_loss:
        batch[task.domain] = torch.randint(0, channels(task), (2, SIZE, SIZE), generator=generator)
    elif task.name == "normal":
        vectors = torch.randn(2, 3, SIZE, SIZE, generator=generator)
        batch[task.domain] = vectors / vectors.norm(dim=1, keepdim=True)
    elif task.name.startswith("depth"):
        batch[task.domain] = 0.5 + 10 * torch.rand(2, 1, SIZE, SIZE, generator=generator)
    elif task.kind == "dense":
        batch[task.domain] = torch.rand(2, channels(task), SIZE, SIZE, generator=generator)
    return batch


def perfect_prediction(task_name: str, batch: dict) -> torch.Tensor:
    task = get_task(task_name)
    if task.loss_fn is segmentation_loss:
        return 100.0 * torch.nn.functional.one_hot(batch[task.domain], channels(task)).permute(0, 3, 1, 2).float()
    if task.kind == "classification":
        return 100.0 * torch.nn.functional.one_hot(batch[task.domain], NUM_SCENES).float()
    return batch[task.domain].clone()


def wrong_prediction(task_name: str, batch: dict) -> torch.Tensor:
    """A prediction that is wrong on valid pixels (a different class / value everywhere)."""
    task = get_task(task_name)
    if task.loss_fn is segmentation_loss:
        shifted = (batch[task.domain] % (channels(task) - 1)) + 1
        shifted = torch.where(shifted == batch[task.domain], (shifted % (channels(task) - 1)) + 1, shifted)
        return 100.0 * torch.nn.functional.one_hot(shifted, channels(task)).permute(0, 3, 1, 2).float()
    if task.kind == "classification":
        return 100.0 * torch.nn.functional.one_hot((batch[task.domain] + 1) % NUM_SCENES, NUM_SCENES).float()
    if task.name == "normal":
        return -batch[task.domain]
    return batch[task.domain] * 0.5 + 0.25


@pytest.mark.parametrize("task_name", list_tasks())
def test_loss_is_zero_on_perfect_prediction(task_name):
    batch = make_batch(task_name)
    loss = get_task(task_name).loss(perfect_prediction(task_name, batch), batch)
    assert loss.dim() == 0
    assert float(loss) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("task_name", list_tasks())
def test_loss_is_positive_on_wrong_prediction(task_name):
    batch = make_batch(task_name)
    assert float(get_task(task_name).loss(wrong_prediction(task_name, batch), batch)) > 0.01


@pytest.mark.parametrize("task_name", [name for name in list_tasks() if get_task(name).kind == "dense"])
def test_loss_ignores_values_on_masked_pixels(task_name):
    task = get_task(task_name)
    batch = make_batch(task_name)
    prediction = wrong_prediction(task_name, batch).requires_grad_(True)
    reference = task.loss(prediction, batch)
    (gradient,) = torch.autograd.grad(reference, prediction)

    invalid = ~batch["mask"].expand_as(prediction)
    garbage = torch.where(invalid, torch.randn_like(prediction) * 1e4, prediction.detach())
    garbage = torch.where(invalid & (torch.rand_like(prediction) > 0.5), torch.full_like(prediction, float("nan")), garbage)
    garbage.requires_grad_(True)
    changed = task.loss(garbage, batch)
    (changed_gradient,) = torch.autograd.grad(changed, garbage)

    assert float(changed.detach()) == pytest.approx(float(reference.detach()), rel=1e-6)
    assert torch.all(changed_gradient[invalid] == 0)
    assert torch.allclose(changed_gradient, gradient, atol=1e-9)


@pytest.mark.parametrize("task_name", [name for name in list_tasks() if get_task(name).kind == "dense"])
def test_loss_with_no_valid_pixel_is_zero_and_differentiable(task_name):
    task = get_task(task_name)
    batch = make_batch(task_name)
    batch["mask"] = torch.zeros_like(batch["mask"])
    prediction = wrong_prediction(task_name, batch).requires_grad_(True)
    loss = task.loss(prediction, batch)
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert torch.all(prediction.grad == 0)


def test_segmentation_ignores_unlabelled_pixels_and_counts_background():
    task = get_task("segment_semantic")
    batch = make_batch("segment_semantic")
    batch["mask"] = torch.ones_like(batch["mask"])
    target = batch[task.domain].clone()
    prediction = perfect_prediction("segment_semantic", batch)
    unlabelled = target % 3 == 0
    batch[task.domain] = torch.where(unlabelled, torch.full_like(target, SEGMENT_IGNORE_INDEX), target)
    # rubbish wherever the pixel is unlabelled: the loss must not notice
    rubbish = torch.where(unlabelled.unsqueeze(1), torch.randn_like(prediction) * 50, prediction)
    assert float(task.loss(rubbish, batch)) == pytest.approx(0.0, abs=1e-6)
    # class 0 is background, a class like any other: a wrong prediction there costs
    batch[task.domain] = torch.zeros_like(target)
    wrong = 100.0 * torch.nn.functional.one_hot(torch.ones_like(target), task.out_channels).permute(0, 3, 1, 2).float()
    assert float(task.loss(wrong, batch)) > 50
    # the 17th class (id 16) is a target like the others
    batch[task.domain] = torch.full_like(target, 16)
    right = 100.0 * torch.nn.functional.one_hot(batch[task.domain], task.out_channels).permute(0, 3, 1, 2).float()
    assert float(task.loss(right, batch)) == pytest.approx(0.0, abs=1e-6)


def test_depth_loss_is_l1_in_metres_over_valid_pixels():
    task = get_task("depth_euclidean")
    target = torch.tensor([[[[2.0, 4.0], [6.0, 0.0]]]])
    batch = {"depth_euclidean": target, "mask": torch.tensor([[[[True, True], [True, False]]]])}
    prediction = torch.tensor([[[[3.0, 4.0], [4.0, 100.0]]]])
    # |3-2| + |4-4| + |4-6| over 3 valid pixels
    assert float(task.loss(prediction, batch)) == pytest.approx(1.0)


def test_normal_loss_adds_angular_term():
    task = get_task("normal")
    target = torch.tensor([1.0, 0.0, 0.0]).view(1, 3, 1, 1)
    prediction = torch.tensor([0.0, 1.0, 0.0]).view(1, 3, 1, 1)
    batch = {"normal": target, "mask": torch.ones(1, 1, 1, 1, dtype=torch.bool)}
    # L1 mean over channels = 2/3, angular = 1 - cos(90 deg) = 1
    assert float(task.loss(prediction, batch)) == pytest.approx(2 / 3 + 1)


def test_channel_cosine_is_torchs_cosine_similarity_and_has_a_finite_gradient_at_zero():
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 3, 5, 5, generator=generator), torch.randn(4, 3, 5, 5, generator=generator)
    a[0, :, 0, 0] = 0.0  # a zero prediction: torch's rule gives 0, not NaN
    expected = torch.nn.functional.cosine_similarity(a, b, dim=1, eps=1e-6).unsqueeze(1)
    got = channel_cosine(a, b, eps=1e-6)
    torch.testing.assert_close(got, expected)
    assert float(got[0, 0, 0, 0]) == 0.0
    leaf = a.clone().requires_grad_(True)
    channel_cosine(leaf, b, eps=1e-6).sum().backward()
    assert torch.isfinite(leaf.grad).all()
