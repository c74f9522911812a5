"""FedBABU (issue 20): the head stays bit-identical with momentum and weight decay (frozen by leaving the
optimizer, not by zeroing gradients), only the body travels, and fine-tuning at evaluation trains the head."""

from __future__ import annotations

import pytest
import torch

from network.algorithms import build_algorithm
from network.algorithms.base import ClientConfig, Upload
from tests.test_fedloge import LinearNet, batches, ce_loss, initial
from utils.errors import TaskHetError

CPU = torch.device("cpu")
HEAD = ("head.weight", "head.bias")


def fedbabu(**settings):
    torch.manual_seed(0)
    return build_algorithm("fedbabu", LinearNet(), {"0": 6, "1": 4}, settings, seed=3)


@pytest.mark.kernels
def test_the_head_is_bit_identical_after_training_with_momentum_and_weight_decay():
    algorithm, worker = fedbabu()
    server = algorithm.init_server(initial(worker))
    broadcast = algorithm.broadcast(server)
    cfg = ClientConfig(lr=0.5, loss_fn=ce_loss, device=CPU, num_samples=6, local_steps=8, momentum=0.9,
                       weight_decay=0.1)
    result = algorithm.client_update(worker, broadcast, {}, batches(), cfg)
    for key in HEAD:
        assert torch.equal(worker.state_dict()[key], broadcast["global"][key]), key
    assert not torch.equal(worker.state_dict()["body.weight"], broadcast["global"]["body.weight"])
    assert set(result.upload["delta"]) == {"body.weight"}
    assert all(param.requires_grad for param in worker.parameters())  # frozen for the phase only


def test_zeroing_the_heads_gradient_instead_would_move_it_under_weight_decay():
    """The control: FL-bench's freeze (grad = 0, head still in the optimizer) fails the test above."""
    model = LinearNet()
    before = model.head.weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=0.1)
    for batch in batches():
        optimizer.zero_grad()
        ce_loss(model, batch).backward()
        model.head.weight.grad.zero_()
        model.head.bias.grad.zero_()
        optimizer.step()
    assert not torch.equal(model.head.weight, before)


def test_the_server_never_updates_the_head_even_with_server_momentum():
    algorithm, worker = fedbabu(server_opt="momentum", server_lr=2.0)
    server = algorithm.init_server(initial(worker))
    delta = {"body.weight": torch.ones_like(server.models["global"]["body.weight"])}
    for _ in range(2):
        server = algorithm.aggregate(server, [Upload("0", {"delta": delta}, 6), Upload("1", {"delta": delta}, 4)])
    for key in HEAD:
        assert torch.equal(server.models["global"][key], initial(worker)[key]), key


def test_fine_tuning_at_evaluation_trains_the_head_too(tmp_path):
    from network.algorithms.base import load_weights
    from network.client import ClientData, Finetune, evaluate_client

    algorithm, worker = fedbabu()
    server = algorithm.init_server(initial(worker))
    seen = {}

    def accuracy(model, loader):
        seen.setdefault("heads", []).append(model.head.weight.detach().clone())
        return {"top1": 0.0}

    client = ClientData("0", 6, lambda seed: batches(), batches(1))
    evaluate_client(algorithm, worker, accuracy, server.models, server.models["global"], None, client, ce_loss, CPU,
                    Finetune(steps=3, lr=0.5), 0)
    plain, finetuned = seen["heads"]
    assert torch.equal(plain, server.models["global"]["head.weight"]) and not torch.equal(plain, finetuned)
    load_weights(worker, server.models["global"])


def test_fedbabu_refuses_a_dense_task():
    from models import build_task_model

    with pytest.raises(TaskHetError, match="^fedbabu trains classifier heads, but --task normal is a dense task"):
        build_algorithm("fedbabu", build_task_model("normal", "small_cnn", "none", seed=0), {"0": 1})
