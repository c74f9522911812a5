"""The closed-form classifier head (sparse/head.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.linear_model import Ridge
from torch import nn

from sparse.head import collect_features, fit_head, ridge_head
from utils.errors import TaskHetError


def separable(classes: int = 3, per_class: int = 20, dim: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    centres = 4.0 * torch.eye(classes, dim)
    labels = torch.arange(classes).repeat_interleave(per_class)
    return centres[labels] + 0.3 * torch.randn(len(labels), dim, generator=generator), labels


def test_the_ridge_head_separates_separable_features_and_is_frozen():
    features, labels = separable()
    batches = [{"x": features[start:start + 15], "label": labels[start:start + 15]} for start in range(0, 60, 15)]
    collected, collected_labels = collect_features(lambda batch: batch["x"], batches)
    head = fit_head(nn.Linear(5, 3), collected, collected_labels)
    assert torch.equal(head(features).argmax(1), labels)
    assert not any(param.requires_grad for param in head.parameters())


def test_the_closed_form_is_scikit_learns_ridge():
    features, labels = separable()
    weight, bias = ridge_head(features, labels, 3, alpha=2.0)
    reference = Ridge(alpha=2.0).fit(features.numpy().astype(np.float64), np.eye(3)[labels.numpy()])
    np.testing.assert_allclose(weight.numpy(), reference.coef_, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(bias.numpy(), reference.intercept_, rtol=1e-8, atol=1e-10)


def test_bad_shapes_are_an_error():
    with pytest.raises(TaskHetError, match="features must be"):
        ridge_head(torch.zeros(4), torch.zeros(4), 2)
    with pytest.raises(TaskHetError, match="at least one batch"):
        collect_features(lambda batch: batch["x"], [])


def test_unbalanced_classes_an_absent_class_the_default_and_the_edge_alphas_match_scikit_learn():
    features, labels = separable(per_class=20)
    keep = torch.cat([torch.arange(0, 20), torch.arange(20, 25), torch.arange(40, 60)])  # 20, 5, 20 rows
    features, labels = features[keep], labels[keep]
    targets = np.eye(4)[labels.numpy()]  # 4 classes, class 3 has no row: its column is all zero
    for alpha, (weight, bias) in ((1e-3, ridge_head(features, labels, 4)), (0.0, ridge_head(features, labels, 4, 0.0))):
        reference = Ridge(alpha=alpha).fit(features.numpy().astype(np.float64), targets)
        assert weight.shape == (4, 5) and bias.shape == (4,)
        np.testing.assert_allclose(weight.numpy(), reference.coef_, rtol=1e-6, atol=1e-8)
        np.testing.assert_allclose(bias.numpy(), reference.intercept_, rtol=1e-6, atol=1e-8)
    with pytest.raises(TaskHetError, match=r"^ridge alpha must be >= 0, got -0.5$"):
        ridge_head(features, labels, 4, alpha=-0.5)
