"""The representation MOON and FedDecorr regularise (network/algorithms/representation.py): refused where it cannot be
read or cannot change, for each method that reads it."""

from __future__ import annotations

import pytest

from models import build_task_model
from network.algorithms import build_algorithm
from tests.oracles import linear_model
from utils.errors import TaskHetError

METHODS = {"moon": "contrasted", "feddecorr": "decorrelated"}  # each method and what its term does to z


@pytest.mark.parametrize("name", METHODS)
def test_a_model_without_a_representation_is_refused(name):
    with pytest.raises(TaskHetError, match=f"{name} needs a model with an 'encoder' .* or a 'head' module"):
        build_algorithm(name, linear_model(), {"0": 1})


@pytest.mark.parametrize("name", METHODS)
def test_a_frozen_encoder_is_refused_before_training(name):
    model = build_task_model("digit_class", "small_cnn", "none", seed=0, freeze_encoder=True, num_classes=10)
    with pytest.raises(TaskHetError, match=f"{name} cannot train a model whose encoder is frozen .*: the {METHODS[name]} "
                                           "representation, the pooled encoder output, cannot change"):
        build_algorithm(name, model, {"0": 1})
