"""Fisher scores (sparse/fisher.py) against logistic regression's closed form."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sparse.fisher import fisher_diagonal
from tests.tiny_models import TinyNet
from utils.errors import TaskHetError

CLASSES, FEATURES = 4, 3


def logistic_regression() -> tuple[nn.Linear, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    model = nn.Linear(FEATURES, CLASSES)
    with torch.no_grad():
        model.weight.copy_(torch.randn(CLASSES, FEATURES, generator=generator))
        model.bias.copy_(torch.randn(CLASSES, generator=generator))
    return model, torch.randn(5, FEATURES, generator=generator)


def analytic(model: nn.Linear, x: torch.Tensor, variant: str) -> dict[str, torch.Tensor]:
    """∂ log p_c/∂W_kd = (δ_kc − p_k)·x_d, so E_c[·²] = p_k(1 − p_k)·x_d²; ∂z_c/∂W_kd = δ_kc·x_d gives p_k·x_d²."""
    p = torch.softmax(model(x), dim=-1).detach()
    factor = p * (1 - p) if variant == "log_prob" else p
    return {"weight": factor.T @ x ** 2, "bias": factor.sum(0)}


@pytest.mark.parametrize("variant", ["log_prob", "logit"])
def test_the_exact_mode_is_the_closed_form_expectation(variant):
    model, x = logistic_regression()
    scores = fisher_diagonal(model, [{"x": x[:2]}, {"x": x[2:]}], variant=variant, exact=True)
    for name, expected in analytic(model, x, variant).items():
        torch.testing.assert_close(scores[name], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", ["log_prob", "logit"])
def test_the_one_draw_estimator_converges_to_the_expectation(variant):
    model, x = logistic_regression()
    copies = 4000  # each example seen 4000 times, one fresh label draw each
    batches = [{"x": x.repeat(copies // 8, 1)} for _ in range(8)]
    scores = fisher_diagonal(model, batches, variant=variant, generator=torch.Generator().manual_seed(3))
    for name, expected in analytic(model, x, variant).items():
        torch.testing.assert_close(scores[name] / copies, expected, rtol=0.06, atol=0.01)


def test_draws_are_seeded_and_batches_are_counted():
    model, x = logistic_regression()
    batches = [{"x": x, "sample_id": ["a"] * 5} for _ in range(3)]
    first = fisher_diagonal(model, batches, generator=torch.Generator().manual_seed(1))
    again = fisher_diagonal(model, batches, generator=torch.Generator().manual_seed(1))
    other = fisher_diagonal(model, batches, generator=torch.Generator().manual_seed(2))
    assert torch.equal(first["weight"], again["weight"]) and not torch.equal(first["weight"], other["weight"])
    one = fisher_diagonal(model, batches, num_batches=1, generator=torch.Generator().manual_seed(1), exact=True)
    three = fisher_diagonal(model, batches, generator=torch.Generator().manual_seed(1), exact=True)
    torch.testing.assert_close(three["weight"], 3 * one["weight"])
    two = fisher_diagonal(model, batches, num_batches=2, generator=torch.Generator().manual_seed(1), exact=True)
    torch.testing.assert_close(two["weight"], 2 * one["weight"])  # stops after 2 of the 3


def test_a_gaussian_output_has_the_squared_jacobian_as_its_fisher_and_batchnorm_is_scored_in_eval_mode():
    model = TinyNet()
    model.train()
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    scores = fisher_diagonal(model, [{"x": x}], likelihood="gaussian", exact=True, keys=["head.weight", "head.bias"])
    model.eval()
    features = model.body(x).detach()
    torch.testing.assert_close(scores["head.weight"], (features ** 2).sum(0, keepdim=True))
    torch.testing.assert_close(scores["head.bias"], torch.tensor([6.0]))
    assert set(scores) == {"head.weight", "head.bias"}


def test_bad_arguments_are_one_clear_error():
    model, x = logistic_regression()
    with pytest.raises(TaskHetError, match="likelihood must be one of categorical, gaussian"):
        fisher_diagonal(model, [{"x": x}], likelihood="poisson")
    with pytest.raises(TaskHetError, match="logit variant needs class logits"):
        fisher_diagonal(model, [{"x": x}], likelihood="gaussian", variant="logit")
    with pytest.raises(TaskHetError, match="no input 'x'; its keys: \\['rgb'\\]"):
        fisher_diagonal(model, [{"rgb": x}])
    with pytest.raises(TaskHetError, match="at least one calibration batch"):
        fisher_diagonal(model, [])
