"""FedRoD (issue 20): the balanced-softmax generic loss by hand, the personal head's gradient route, the served
models and the class counts it needs. The generic tests over ``list_algorithms()`` cover the engine properties."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from network.algorithms import build_algorithm
from network.algorithms.base import ClientConfig, load_weights
from network.algorithms.fedrod import log_prior
from network.algorithms.multihead import multi_head_loss
from tests.test_fedloge import LinearNet, batches, ce_loss, initial
from utils.errors import TaskHetError

CPU = torch.device("cpu")


def fedrod(**settings):
    torch.manual_seed(0)
    return build_algorithm("fedrod", LinearNet(), {"0": 6, "1": 4}, settings, seed=3)


def losses(worker, counts, gamma, personal=None):
    """The two-head loss of one batch and, by hand, (balanced CE of g, CE of g + p) on the same batch."""
    head = worker.head
    if personal is not None:
        load_weights(worker, personal)
    head.adjustment = log_prior(counts, gamma)
    batch = batches(1)[0]
    loss = multi_head_loss(ce_loss, worker, head, ("generic", "personal"))(worker, batch)
    with torch.no_grad():
        z = worker.body(batch["x"])
        logits = head.generic(z)
        adjustment = torch.tensor([gamma * math.log(count) for count in counts])
        balanced = nn.functional.cross_entropy(logits + adjustment, batch["label"])
        joint = nn.functional.cross_entropy(logits + head.personal(z), batch["label"])
    return loss, float(balanced), float(joint), batch


def test_the_generic_loss_is_the_balanced_softmax_computed_by_hand():
    _, worker = fedrod(gamma=0.5)
    personal = {"head.personal.weight": torch.full((3, 4), 0.3), "head.personal.bias": torch.tensor([1.0, -1.0, 0.0])}
    loss, balanced, joint, _ = losses(worker, (5, 1, 2), 0.5, personal)
    assert loss.item() == pytest.approx(balanced + joint, rel=1e-6)
    assert balanced != pytest.approx(losses(worker, (5, 1, 2), 0.0)[1])  # the prior matters


def test_uniform_counts_make_the_balanced_softmax_plain_cross_entropy():
    _, worker = fedrod()
    batch = batches(1)[0]
    with torch.no_grad():
        plain = float(nn.functional.cross_entropy(worker.head.generic(worker.body(batch["x"])), batch["label"]))
    _, balanced, _, _ = losses(worker, (4, 4, 4), 1.0)  # log 4 added to every logit: softmax unchanged
    assert balanced == pytest.approx(plain, rel=1e-6)


def test_an_absent_class_gets_prior_zero_and_gamma_zero_is_no_adjustment():
    assert log_prior((2, 0, 1), 1.0).tolist() == pytest.approx([math.log(2), -math.inf, 0.0])
    assert log_prior((2, 0, 1), 0.0).tolist() == [0.0, 0.0, 0.0]


def test_the_personal_loss_trains_only_the_personal_head():
    _, worker = fedrod()
    loss, _, _, batch = losses(worker, (3, 3, 4), 1.0)
    loss.backward()
    head = worker.head
    grads = {name: param.grad.clone() for name, param in worker.named_parameters()}
    worker.zero_grad()
    with torch.enable_grad():  # the generic loss alone, by autograd on the same weights
        logits = head.generic(worker.body(batch["x"])) + log_prior((3, 3, 4), 1.0)
        nn.functional.cross_entropy(logits, batch["label"]).backward()
    for name in ("body.weight", "head.generic.weight", "head.generic.bias"):
        assert torch.allclose(grads[name], dict(worker.named_parameters())[name].grad, atol=1e-6), name
    with torch.no_grad():  # p's gradient: (softmax(g + p) − y)ᵀ z / B with g, z held fixed
        z = worker.body(batch["x"])
        residual = torch.softmax(head.generic(z) + head.personal(z), 1) - nn.functional.one_hot(batch["label"], 3)
        assert torch.allclose(grads["head.personal.weight"], residual.T @ z / len(z), atol=1e-6)


def test_the_global_model_is_body_plus_g_and_a_clients_is_body_plus_g_plus_p():
    algorithm, worker = fedrod()
    server = algorithm.init_server(initial(worker))
    cfg = ClientConfig(lr=0.3, loss_fn=ce_loss, device=CPU, num_samples=6, local_steps=4, momentum=0.9,
                       class_counts=(4, 1, 1))
    result = algorithm.client_update(worker, algorithm.broadcast(server), {}, batches(), cfg)
    assert set(result.upload["delta"]) == {"body.weight", "head.generic.weight", "head.generic.bias"}
    assert result.client_state["head.personal.weight"].abs().sum() > 0
    x = torch.randn(3, 2, generator=torch.Generator().manual_seed(1))
    load_weights(worker, server.models["global"])
    worker.eval()
    assert torch.equal(worker(x), worker.head.generic(worker.body(x)))  # p is zero in the global model
    load_weights(worker, algorithm.personal_model(server.models, result.client_state))
    z = worker.body(x)
    assert torch.allclose(worker(x), worker.head.generic(z) + z @ result.client_state["head.personal.weight"].T
                          + result.client_state["head.personal.bias"])
    assert worker.head.adjustment is None  # the client's prior does not outlive its update


def test_fedrod_needs_the_clients_class_counts_and_a_classifier():
    algorithm, worker = fedrod()
    server = algorithm.init_server(initial(worker))
    cfg = ClientConfig(lr=0.1, loss_fn=ce_loss, device=CPU, num_samples=6, local_steps=1)
    with pytest.raises(TaskHetError, match="fedrod needs each client's training class counts over 3 classes"):
        algorithm.client_update(worker, algorithm.broadcast(server), {}, batches(), cfg)
    from models import build_task_model

    with pytest.raises(TaskHetError, match="^fedrod trains classifier heads, but --task normal is a dense task"):
        build_algorithm("fedrod", build_task_model("normal", "small_cnn", "none", seed=0), {"0": 1})


@pytest.mark.kernels
def test_a_float64_run_builds_the_prior_in_float64_so_its_step_is_the_equations_to_the_last_bits():
    """γ·log n in the logits' dtype: a float32 prior cast to float64 logits is ~6e-8 off γ·log n, and so is the step."""
    counts, gamma = (5, 1, 3), 0.7
    exact = torch.tensor([gamma * math.log(count) for count in counts], dtype=torch.float64)
    prior = log_prior(counts, gamma, torch.float64)
    assert prior.dtype == torch.float64 and torch.allclose(prior, exact, rtol=1e-15, atol=0)
    assert (log_prior(counts, gamma).double() - exact).abs().max() > 1e-9  # what float32 costs
    torch.manual_seed(0)
    algorithm, worker = build_algorithm("fedrod", LinearNet().double(), {"0": 6, "1": 4}, {"gamma": gamma}, seed=3)
    server = algorithm.init_server(initial(worker))
    batch = {"x": batches(1)[0]["x"].double(), "label": batches(1)[0]["label"]}
    start = {key: value.clone().requires_grad_() for key, value in server.models["global"].items()}
    # One plain SGD step of lr 1: g moves by −∇ CE(B x W_gᵀ + b_g + γ·log n, y) (the personal loss never reaches g).
    logits = batch["x"] @ start["body.weight"].T @ start["head.generic.weight"].T + start["head.generic.bias"] + exact
    grads = torch.autograd.grad(nn.functional.cross_entropy(logits, batch["label"]),
                                [start["head.generic.weight"], start["head.generic.bias"]])
    cfg = ClientConfig(lr=1.0, loss_fn=ce_loss, device=CPU, num_samples=6, local_steps=1, class_counts=counts)
    delta = algorithm.client_update(worker, algorithm.broadcast(server), {}, [batch], cfg).upload["delta"]
    for key, grad in zip(("head.generic.weight", "head.generic.bias"), grads):
        assert delta[key].dtype == torch.float64
        assert torch.allclose(delta[key], -grad, rtol=0, atol=1e-15), (key, (delta[key] + grad).abs().max())
