"""The Fed-LT evaluation protocol shared by every algorithm (issue 20): the absent-class mask applied by
``network.client.evaluate_client`` to every client split, and the proportional local test sets built by
``network.client_data.make_clients``."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from network.client import AbsentClassMask, ClientData, Finetune, evaluate_client
from utils.errors import TaskHetError

CPU = torch.device("cpu")


def classifier() -> nn.Module:
    """Logits = x @ Wᵀ with W = I: a sample predicts the index of its largest feature."""
    model = nn.Linear(3, 3, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.eye(3))
    return model


def accuracy(model: nn.Module, loader) -> dict[str, float]:
    hits, losses, count = 0, 0.0, 0
    for batch in loader:
        logits = model(batch["x"]).detach()
        hits += int((logits.argmax(1) == batch["y"]).sum())
        losses += float(nn.functional.cross_entropy(logits, batch["y"], reduction="sum"))
        count += batch["y"].numel()
    return {"loss": losses / count, "top1": hits / count}


def ce_loss(model, batch, reduction="mean"):
    return nn.functional.cross_entropy(model(batch["x"]), batch["y"], reduction=reduction)


# Three test samples of class 0 whose largest feature is class 2's (absent), then class 0's, then class 1's.
TEST = [{"x": torch.tensor([[1.0, 0.0, 2.0], [2.0, 0.0, 1.0], [0.0, 3.0, 1.0]]), "y": torch.tensor([0, 0, 1])}]


class Personal:
    """An algorithm whose personal model is the global one with weight 2·I (same predictions)."""

    personalized = True

    def personal_model(self, models, state):
        return {"weight": 2 * torch.eye(3)} if state else None


def evaluate(algorithm, state, counts, finetune=None):
    model = classifier()
    client = ClientData("c", 4, lambda seed: [{"x": torch.eye(3), "y": torch.arange(3)}], TEST, counts)
    return evaluate_client(algorithm, model, accuracy, {}, {"weight": torch.eye(3)}, state, client, ce_loss, CPU,
                           finetune, 0)


def test_absent_classes_are_masked_in_every_client_split_and_reported_beside_the_unmasked_rows():
    splits = evaluate(Personal(), {"own": torch.ones(1)}, (2, 1, 0), Finetune(steps=1, lr=0.0))
    assert set(splits) == {f"client_test{part}{suffix}" for part in ("", "_personal", "_finetuned")
                           for suffix in ("", "_masked")}
    for split in ("client_test", "client_test_personal", "client_test_finetuned"):
        # Unmasked, sample 0 goes to class 2; masked (class 2 never trained on), its next best is class 0.
        assert splits[split]["top1"] == pytest.approx(2 / 3), split
        assert splits[split + "_masked"]["top1"] == 1.0, split


def test_no_masked_rows_without_counts_or_without_an_absent_class():
    assert set(evaluate(Personal(), None, None)) == {"client_test"}
    assert set(evaluate(Personal(), None, (1, 1, 1))) == {"client_test"}


def test_a_masked_class_is_never_predicted_and_its_own_samples_cost_infinite_loss():
    masked = AbsentClassMask(classifier(), torch.tensor([False, True, False]))
    logits = masked(torch.tensor([[0.0, 9.0, 1.0], [5.0, 6.0, 0.0]]))
    assert logits[:, 1].eq(-math.inf).all() and logits.argmax(1).tolist() == [2, 0]
    assert math.isinf(accuracy(masked, TEST)["loss"])  # the class-1 test sample has a −∞ logit on its label


def test_the_mask_refuses_logits_of_another_width():
    with pytest.raises(TaskHetError, match=r"absent-class mask needs logits \[B, 4\], got \(3, 3\)"):
        AbsentClassMask(classifier(), torch.zeros(4, dtype=torch.bool))(torch.eye(3))


def test_train_client_hands_the_class_counts_to_the_algorithm():
    from network.algorithms.base import ClientConfig, ClientResult
    from network.client import train_client

    seen = {}

    class Spy:
        name = "spy"

        def client_update(self, model, broadcast, state, loader, cfg):
            seen["counts"] = cfg.class_counts
            return ClientResult({}, {}, {}, 1)

        def private_keys(self):
            return frozenset()

        def reported_num_samples(self, client_id, num_samples):
            return num_samples

    client = ClientData("c", 4, lambda seed: [], None, (3, 0, 1))
    train_client(Spy(), classifier(), {}, None, client, 0, ClientConfig(0.1, ce_loss, CPU, 4))
    assert seen["counts"] == (3, 0, 1)


def test_proportional_local_tests_come_from_the_test_split_in_train_proportions(tmp_path, monkeypatch):
    import numpy as np
    import pandas as pd

    from network.client_data import make_clients

    manifest = pd.DataFrame({"sample_id": [f"s{i}" for i in range(30)], "label": [0] * 10 + [1] * 10 + [0, 1] * 5,
                             "split": ["train"] * 20 + ["test"] * 10})
    table = pd.DataFrame({"sample_id": [f"s{i}" for i in range(20)], "client_id": [0] * 8 + [1] * 12,
                          "group": 0, "subset": "train"})  # client 0: 8 of class 0; client 1: 2 of 0, 10 of 1

    class Family:
        label_column = "label"

        def num_classes(self, manifest):
            return 2

        def dataset(self, root, rows, task, image_size, cache_dir):
            return [{"label": int(label), "sample_id": sid} for sid, label in zip(rows["sample_id"], rows["label"])]

    monkeypatch.setattr("network.client_data.family_of", lambda manifest: Family())
    args = SimpleNamespace(data_path=tmp_path, image_size=8, cache_dir=None, batch_size=100, num_workers=0,
                           local_test="proportional", rand_seed=0)
    clients = make_clients(args, manifest, table, SimpleNamespace(kind="classification", name="digit_class"))
    assert [client.class_counts for client in clients] == [(8, 0), (2, 10)]
    labels = [np.concatenate([batch["label"].numpy() for batch in client.test_loader]) for client in clients]
    # |test| = 10: client 0 takes ⌊8/8·10⌋ = 10 of class 0 (5 images, each twice), client 1 ⌊2/12·10⌋ = 1 and ⌊10/12·10⌋ = 8.
    assert np.bincount(labels[0], minlength=2).tolist() == [10, 0]
    assert np.bincount(labels[1], minlength=2).tolist() == [1, 8]
