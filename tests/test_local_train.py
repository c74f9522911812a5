"""network.local_train: one client's local optimisation loop, checked against values computed by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from network.local_train import local_train


class SometimesHead(nn.Module):
    """``w·x``, plus ``v·x`` only for batches whose ``"use_v"`` flag is set: a parameter some steps do not reach."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(1.0))
        self.v = nn.Parameter(torch.tensor(1.0))

    def forward(self, batch: dict) -> torch.Tensor:
        out = self.w * batch["x"]
        return out + self.v * batch["x"] if bool(batch["use_v"]) else out


def loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(batch).sum()


def test_a_parameter_a_step_does_not_reach_is_left_alone_by_that_step():
    # torch's default zero_grad (set_to_none) gives such a parameter no gradient, so SGD skips it: no momentum
    # and no weight decay move it (the vectorised engine does the same; tests/test_vectorized.py).
    model = SometimesHead()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.5)
    batches = [{"x": torch.tensor(2.0), "use_v": True}, {"x": torch.tensor(2.0), "use_v": False}]
    result = local_train(model, batches, loss, optimizer, torch.device("cpu"), steps=2)
    # Step 1 reaches both: grad 2 + decay 0.5·1 = 2.5, v = 1 − 0.1·2.5 = 0.75. Step 2 leaves v alone.
    assert model.v.item() == pytest.approx(0.75, abs=1e-7)
    # w: step 1 as v (0.75, buffer 2.5); step 2 grad 2 + 0.5·0.75 = 2.375, buffer 0.9·2.5 + 2.375 = 4.625,
    # w = 0.75 − 0.1·4.625 = 0.2875.
    assert model.w.item() == pytest.approx(0.2875, abs=1e-7)
    assert result.steps == 2 and result.mean_loss == pytest.approx((4.0 + 1.5) / 2, abs=1e-6)  # (2+2)·1, then 2·0.75


@pytest.mark.parametrize("budget", [{}, {"steps": 1, "epochs": 1}])
def test_exactly_one_budget(budget):
    model = SometimesHead()
    with pytest.raises(ValueError, match="^local_train needs exactly one of steps and epochs$"):
        local_train(model, [], loss, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"), **budget)


def test_the_extra_loss_and_the_post_step_act_on_the_trained_model():
    # One step on w·x (x = 2) with FedProx-like extra loss 0.5·w² (gradient w = 1): w = 1 − 0.1·(2 + 1) = 0.7,
    # then a proximal map that halves w: 0.35. The extra loss is not part of the reported loss.
    model = SometimesHead()
    optimizer = torch.optim.SGD([model.w], lr=0.1)
    batches = [{"x": torch.tensor(2.0), "use_v": False}]
    result = local_train(model, batches, loss, optimizer, torch.device("cpu"), steps=1,
                         extra_loss=lambda net: 0.5 * net.w ** 2, post_step=lambda net: net.w.data.mul_(0.5))
    assert model.w.item() == pytest.approx(0.35, abs=1e-7) and result.mean_loss == pytest.approx(2.0)


def test_an_empty_epoch_takes_no_step_and_reports_a_zero_loss():
    model = SometimesHead()
    result = local_train(model, [], loss, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"), epochs=1)
    assert (result.steps, result.mean_loss) == (0, 0.0) and model.w.item() == 1.0
