"""SparseSGDM (sparse/optim.py): frozen entries keep their bits; all-ones masks are torch's SGD exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from sparse.optim import SparseSGDM
from utils.errors import TaskHetError

OPTIONS = [dict(momentum=0.9, weight_decay=0.1),
           dict(momentum=0.9, weight_decay=0.1, nesterov=True),
           dict(momentum=0.9, weight_decay=0.1, dampening=0.3),
           dict(momentum=0.0, weight_decay=0.1),
           dict(momentum=0.9, weight_decay=0.0, maximize=True),
           # Boundary values a mistyped comparison would treat as 0: full decay, full dampening.
           dict(momentum=0.9, weight_decay=1.0), dict(momentum=0.9, dampening=1.0)]


def model_and_masks(seed: int = 0, density: float = 0.4) -> tuple[nn.Module, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    masks = [torch.rand(param.shape, generator=generator) < density for param in model.parameters()]
    return model, masks


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 100) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator)
        optimizer.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        optimizer.step()


def trainable_buffer(optimizer: SparseSGDM, param: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The momentum buffer at the trainable entries; a full-size buffer must be exactly 0 elsewhere."""
    buffer = optimizer.state[param]["momentum_buffer"]
    if buffer.shape == param.shape:
        assert torch.equal(buffer[~mask], torch.zeros(int((~mask).sum())))
        return buffer[mask]
    assert buffer.shape == (int(mask.sum()),)  # the indexed path keeps the trainable entries only
    return buffer


# Density 0.4: the per-tensor loop steps through the trainable indices; 0.7: it folds the mask into the buffer pass.
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("implementation", [dict(), dict(foreach=True)])
@pytest.mark.parametrize("density", [0.4, 0.7])
def test_masked_entries_keep_their_bits_for_100_steps(options, implementation, density):
    model, masks = model_and_masks(density=density)
    before = [param.detach().clone() for param in model.parameters()]
    optimizer = SparseSGDM(model.parameters(), masks, lr=0.05, **options, **implementation)
    train(model, optimizer)
    for param, old, mask in zip(model.parameters(), before, masks):
        assert torch.equal(param[~mask], old[~mask])
        assert not torch.equal(param[mask], old[mask])  # the trainable entries did move
        if options["momentum"]:
            trainable_buffer(optimizer, param, mask)


@pytest.mark.kernels
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("implementation", [dict(), dict(foreach=True)])
def test_an_all_ones_mask_is_torch_sgd_bit_for_bit(options, implementation):
    sparse_model, _ = model_and_masks()
    dense_model, _ = model_and_masks()
    ones = [torch.ones_like(param) for param in sparse_model.parameters()]
    train(sparse_model, SparseSGDM(sparse_model.parameters(), ones, lr=0.05, **options, **implementation))
    train(dense_model, torch.optim.SGD(dense_model.parameters(), lr=0.05, **options, **implementation))
    for sparse, dense in zip(sparse_model.parameters(), dense_model.parameters()):
        assert torch.equal(sparse, dense)


def test_the_callers_gradients_are_never_modified():
    param = nn.Parameter(torch.tensor([1.0, 3.0, 2.0]))
    optimizer = SparseSGDM([param], [torch.tensor([1, 0, 0])], lr=0.1, momentum=0.9)
    param.grad = torch.tensor([1.0, 5.0, -4.0])
    optimizer.step()
    assert torch.equal(param.detach(), torch.tensor([0.9, 3.0, 2.0]))
    assert torch.equal(param.grad, torch.tensor([1.0, 5.0, -4.0]))


# Without weight decay or maximize the direction is the caller's gradient itself: the masked-direction path must copy.
@pytest.mark.parametrize("options", OPTIONS + [dict(momentum=0.9, nesterov=True), dict(momentum=0.0)])
@pytest.mark.parametrize("implementation", [dict(), dict(foreach=True)])
@pytest.mark.parametrize("density", [0.4, 0.7])
def test_no_path_modifies_the_callers_gradients(options, implementation, density):
    model, masks = model_and_masks(density=density)
    optimizer = SparseSGDM(model.parameters(), masks, lr=0.05, **options, **implementation)
    generator = torch.Generator().manual_seed(2)
    for _ in range(2):
        for param in model.parameters():
            param.grad = torch.randn(param.shape, generator=generator)
        grads = [param.grad.clone() for param in model.parameters()]
        optimizer.step()
        for param, grad in zip(model.parameters(), grads):
            assert torch.equal(param.grad, grad)


@pytest.mark.parametrize("implementation", [dict(), dict(foreach=True)])
@pytest.mark.parametrize("density", [0.4, 0.7])
def test_a_dense_sgd_state_keeps_the_masks_and_leaves_no_velocity_at_frozen_entries(implementation, density):
    """Fine-tuning sparsely after a dense run: torch.optim.SGD's state has no masks and full-size buffers."""
    model, masks = model_and_masks(density=density)
    dense = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.1)
    train(model, dense, steps=3)
    loaded = copy.deepcopy(dense.state_dict())
    before = [param.detach().clone() for param in model.parameters()]
    optimizer = SparseSGDM(model.parameters(), masks, lr=0.05, momentum=0.9, weight_decay=0.1, **implementation)
    optimizer.load_state_dict(loaded)
    param = next(model.parameters())
    param.grad = torch.zeros_like(param)
    for other in list(model.parameters())[1:]:
        other.grad = torch.zeros_like(other)
    optimizer.step()  # zero gradient: d = wd·θ, b = μ·b_dense·m + d·m, θ -= lr·b at trainable entries only
    for param, old, mask, state in zip(model.parameters(), before, masks, loaded["state"].values()):
        assert torch.equal(param.detach()[~mask], old[~mask])
        expected = old[mask] - 0.05 * (0.9 * state["momentum_buffer"][mask] + 0.1 * old[mask])
        assert torch.allclose(param.detach()[mask], expected, rtol=1e-6, atol=1e-7)
    train(model, optimizer, steps=5)
    for param, old, mask in zip(model.parameters(), before, masks):
        assert torch.equal(param.detach()[~mask], old[~mask])


def test_a_dense_parameter_before_sparse_ones_leaves_their_masks_in_force():
    model, masks = model_and_masks()
    masks[0] = None
    frozen = [param.detach().clone() for param in model.parameters()]
    train(model, SparseSGDM(model.parameters(), masks, lr=0.05, momentum=0.9, weight_decay=0.1), steps=3)
    params = list(model.parameters())
    assert not torch.equal(params[0], frozen[0])  # None: dense
    for param, old, mask in zip(params[1:], frozen[1:], masks[1:]):
        assert torch.equal(param.detach()[~mask], old[~mask])


def test_defaults_are_torch_sgds():
    import inspect

    ours, torchs = (inspect.signature(cls.__init__).parameters for cls in (SparseSGDM, torch.optim.SGD))
    for name in ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "foreach", "fused"):
        assert ours[name].default == torchs[name].default, name


def test_masks_must_match_the_parameters():
    model, masks = model_and_masks()
    with pytest.raises(TaskHetError, match="one mask per parameter: 4 parameters, 3 masks"):
        SparseSGDM(model.parameters(), masks[:3], lr=0.1)
    with pytest.raises(TaskHetError, match=r"mask 0 has shape \(5,\)"):
        SparseSGDM(model.parameters(), [torch.ones(5)] + masks[1:], lr=0.1)


@pytest.mark.parametrize("foreach", [False, True])
def test_none_means_dense_and_the_state_dict_round_trips(foreach):
    model, masks = model_and_masks()
    masks[0] = None
    optimizer = SparseSGDM(model.parameters(), masks, lr=0.1, momentum=0.9, weight_decay=0.1, foreach=foreach)
    train(model, optimizer, steps=2)
    twin, _ = model_and_masks()
    twin.load_state_dict(model.state_dict())
    restored = SparseSGDM(twin.parameters(), [torch.ones_like(p) for p in twin.parameters()], lr=0.1, momentum=0.9,
                          weight_decay=0.1, foreach=foreach)
    restored.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # state_dict() shares the buffers
    train(model, optimizer, steps=3)
    train(twin, restored, steps=3)
    for first, second in zip(model.parameters(), twin.parameters()):
        assert torch.equal(first, second)


@pytest.mark.parametrize("foreach", [False, True])
def test_the_folded_step_by_hand(foreach):
    """μ = 0.5, wd = 0.1, lr = 0.1, mask [1, 0]: b₁ = d₁·m, b₂ = μ·b₁ + d₂·m, θ −= lr·b (trainable entry only)."""
    param = nn.Parameter(torch.tensor([1.0, 2.0]))
    optimizer = SparseSGDM([param], [torch.tensor([1, 0])], lr=0.1, momentum=0.5, weight_decay=0.1, foreach=foreach)
    param.grad = torch.tensor([0.9, 4.0])
    optimizer.step()  # d = 0.9 + 0.1·1 = 1, b = 1, θ = 1 − 0.1 = 0.9
    param.grad = torch.tensor([0.91, 4.0])
    optimizer.step()  # d = 0.91 + 0.09 = 1, b = 0.5 + 1 = 1.5, θ = 0.9 − 0.15 = 0.75
    assert torch.allclose(param.detach(), torch.tensor([0.75, 2.0]), atol=1e-6) and param[1] == 2.0
    assert torch.allclose(trainable_buffer(optimizer, param, torch.tensor([True, False])), torch.tensor([1.5]),
                          atol=1e-6)


@pytest.mark.parametrize("options", OPTIONS)
def test_the_indexed_path_computes_what_the_dense_fold_does(options):
    """Per-tensor loop at density 0.4 (indexed where foldable) vs the foreach path (dense): same values to rounding."""
    indexed, masks = model_and_masks()
    dense, _ = model_and_masks()
    # 10 steps: maximize diverges over 100, and divergence amplifies the rounding differences.
    train(indexed, SparseSGDM(indexed.parameters(), masks, lr=0.05, **options), steps=10)
    train(dense, SparseSGDM(dense.parameters(), masks, lr=0.05, foreach=True, **options), steps=10)
    for first, second in zip(indexed.parameters(), dense.parameters()):
        assert torch.allclose(first, second, rtol=1e-5, atol=1e-6)
