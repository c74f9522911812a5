"""FedPer (network/algorithms/fedper.py): body and head train together; only the body travels."""

from __future__ import annotations

import pytest
import torch

from network.algorithms import build_algorithm
from network.algorithms.skeleton import DELTA
from tests.oracles import TwoLayer, client_config, least_squares_clients, linear_model, manual_sgd
from utils.errors import TaskHetError


def test_joint_local_training_by_hand_with_the_clients_own_head():
    a, b = least_squares_clients(sizes=(20,))[0]
    algorithm, model = build_algorithm("fedper", TwoLayer(), {"0": 20})
    assert algorithm.private_keys() == {"head.weight"} and algorithm.personalized
    start = {key: value.clone() for key, value in model.state_dict().items()}
    own = {"head.weight": -start["head.weight"]}
    result = algorithm.client_update(model, {"global": start}, own, [{"x": a, "y": b}],
                                     client_config(20, lr=0.05, steps=4))
    expected = manual_sgd({**start, **own}, {"body.weight", "head.weight"}, [{"x": a, "y": b}], 0.05, steps=4)
    assert set(result.upload[DELTA]) == {"body.weight"}
    assert torch.allclose(result.upload[DELTA]["body.weight"], expected["body.weight"] - start["body.weight"],
                          rtol=0, atol=1e-13)
    assert torch.allclose(result.client_state["head.weight"], expected["head.weight"], rtol=0, atol=1e-13)
    personal = algorithm.personal_model({"global": start}, result.client_state)
    assert torch.equal(personal["body.weight"], start["body.weight"])  # the global body with the own head
    assert torch.equal(personal["head.weight"], result.client_state["head.weight"])


def test_a_model_without_a_head_is_refused_naming_the_algorithm():
    with pytest.raises(TaskHetError, match=r"^fedper needs a model with head_keys\(\)"):
        build_algorithm("fedper", linear_model(), {"0": 1})
