"""CFL (network/algorithms/cfl.py): nested splits recover three groups by client id; one optimum never splits."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from network.algorithms import build_algorithm
from network.algorithms.base import ServerState, Upload
from network.algorithms.cfl import CLUSTER, MEMBERSHIP, ROUNDS, bipartition
from network.algorithms.skeleton import DELTA
from tests.oracles import DIM, linear_model, pooled_optimum, run_oracle
from utils.errors import TaskHetError

GROUP_OPTIMA = [torch.tensor(values, dtype=torch.float64) for values in
                ([3.0, 0.0, 0.0, 1.0, 0.0], [0.0, 3.0, 0.0, -1.0, 0.0], [0.0, 0.0, 3.0, 0.0, 1.0])]


def grouped_clients(groups, per_group=4, seed=0):
    """Well-conditioned least squares: client k of group g fits y = x·(optimum_g + small noise) + noise."""
    generator = torch.Generator().manual_seed(seed)
    data, owners = [], []
    for group in groups:
        for member in range(per_group):
            size = 20 + 5 * member  # unequal sizes
            x = torch.randn(size, DIM, generator=generator, dtype=torch.float64)
            optimum = GROUP_OPTIMA[group] + 0.05 * torch.randn(DIM, generator=generator, dtype=torch.float64)
            data.append((x, x @ optimum + 0.05 * torch.randn(size, generator=generator, dtype=torch.float64)))
            owners.append(group)
    return data, owners


def test_three_groups_need_two_nested_splits_and_are_recovered_by_client_id(tmp_path):
    data, owners = grouped_clients([0, 1, 2])
    _, engine = run_oracle(tmp_path, "cfl", rounds=120, steps=1, lr=0.5, data=data, eps1=0.05, eps2=0.3,
                           start_round=5, min_size=3)
    clusters = engine.server.models[MEMBERSHIP]["clusters"].tolist()
    by_client = {str(index): cluster for index, cluster in enumerate(clusters)}  # membership by client id
    assert len(set(clusters)) == 3
    for group in range(3):  # purity 1.0: each group is exactly one cluster
        members = {client for client, owner in zip(by_client, owners) if owner == group}
        assert len({by_client[client] for client in members}) == 1
        cluster = by_client[next(iter(members))]
        assert {client for client, value in by_client.items() if value == cluster} == members
        optimum = pooled_optimum([data[int(client)] for client in members])
        model = engine.server.models[f"cluster{cluster}"]["weight"].squeeze(0)
        assert torch.allclose(model, optimum, rtol=0, atol=1e-6)
        personal = engine.algorithm.personal_model(engine.server.models, engine.store.get(next(iter(members))))
        assert torch.equal(personal["weight"], engine.server.models[f"cluster{cluster}"]["weight"])
    depths = sorted((value + 1).bit_length() - 1 for value in set(clusters))  # heap ids: depth = splits above
    assert depths == [1, 2, 2]  # one split, then a second split of one half: nested
    # The tree in metrics.csv: per round and client, the cluster it trained in.
    metrics = pd.read_csv(tmp_path / "cfl" / "metrics.csv", dtype={"client": str})
    rows = metrics.query("split == 'train' and metric == 'cluster' and client != 'mean'")
    first_round = rows[rows["round"] == 1]
    assert set(first_round.value) == {0.0} and set(first_round.client) == set(by_client)
    parent_of = {child: (child - 1) // 2 for child in set(clusters)}
    assert set(rows.value.astype(int)) == {0, *set(parent_of.values()), *set(clusters)}


def test_one_shared_optimum_never_splits(tmp_path):
    data, _ = grouped_clients([1, 1, 1])
    _, engine = run_oracle(tmp_path, "cfl", rounds=60, steps=1, lr=0.5, data=data, eps1=0.05, eps2=0.3,
                           start_round=5, min_size=3)
    assert set(engine.server.models[MEMBERSHIP]["clusters"].tolist()) == {0}
    assert set(engine.server.models) == {"cluster0", MEMBERSHIP}


def test_a_second_split_names_its_members_by_client_id_not_by_position():
    """After a first split, cluster 2 holds b, d, e, f (not positions 0..3); its split must move exactly those."""
    names = ("a", "b", "c", "d", "e", "f")
    algorithm, _ = build_algorithm("cfl", linear_model(), {name: 10 for name in names},
                                   {"eps1": 0.5, "eps2": 1.0, "start_round": 0, "min_size": 2})
    weights = {"weight": torch.zeros(1, DIM, dtype=torch.float64)}
    membership = {"clusters": torch.tensor([1, 2, 1, 2, 2, 2])}
    server = ServerState({"cluster1": weights, "cluster2": weights, MEMBERSHIP: membership},
                         {ROUNDS: torch.tensor(4)})
    direction = {"b": 1.0, "d": 1.0, "e": -1.0, "f": -1.0}  # mean 0, norms 2: the criterion holds
    uploads = [Upload(name, {DELTA: {"weight": torch.tensor([[2 * value, 0.1 * index, 0, 0, 0]], dtype=torch.float64)},
                             CLUSTER: {"id": torch.tensor(2)}}, 10) for index, (name, value) in enumerate(direction.items())]
    new = algorithm.aggregate(server, uploads)
    final = dict(zip(names, new.models[MEMBERSHIP]["clusters"].tolist()))
    assert final == {"a": 1, "b": 5, "c": 1, "d": 5, "e": 6, "f": 6}  # b, cluster 2's first member: child 2·2 + 1
    assert set(new.models) == {"cluster1", "cluster5", "cluster6", MEMBERSHIP}
    assert torch.equal(new.models["cluster5"]["weight"], new.models["cluster6"]["weight"])  # both from θ_2
    for name in names:  # every client's message is its own cluster's model
        assert int(algorithm.client_broadcast(new, {}, name)[CLUSTER]["id"]) == final[name]
    unchanged = algorithm.aggregate(server, uploads[:3])  # f did not take part: no split this round
    assert unchanged.models[MEMBERSHIP]["clusters"].tolist() == [1, 2, 1, 2, 2, 2]


def test_bipartition_is_complete_linkage_on_cosine_distance():
    vectors = torch.tensor([[1.0, 0.0], [0.9, 0.1], [-1.0, 0.0], [-0.8, -0.3]], dtype=torch.float64)
    labels = bipartition(vectors)
    assert labels[0] == labels[1] and labels[2] == labels[3] and labels[0] != labels[2]


def test_the_largest_cluster_is_evaluated_first_as_the_global_model():
    algorithm, _ = build_algorithm("cfl", linear_model(), {name: 10 for name in "abcdef"})
    weights = {"weight": torch.zeros(1, DIM, dtype=torch.float64)}
    membership = {"clusters": torch.tensor([2, 5, 5, 6, 5, 2])}  # cluster 5 holds three clients, 2 two, 6 one
    server = ServerState({"cluster2": weights, "cluster5": weights, "cluster6": weights, MEMBERSHIP: membership},
                         {ROUNDS: torch.tensor(4)})
    assert list(algorithm.evaluated_models(server)) == ["cluster5", "cluster2", "cluster6"]


def test_bipartition_ignores_the_update_norms():
    """Cosine, not dot products: a tiny update goes with the large one it points along, whatever their norms
    (a global normalisation would pair the two large updates, which point 55° apart)."""
    vectors = torch.tensor([[10.0, 0.0], [0.01, 0.001], [7.0, 10.0], [0.001, 0.01]], dtype=torch.float64)
    labels = bipartition(vectors)
    assert labels[0] == labels[1] and labels[2] == labels[3] and labels[0] != labels[2]


def test_bad_settings_are_refused_naming_the_setting():
    with pytest.raises(TaskHetError, match=r"^setting eps1 must be < eps2 \(1.0\), got 2.0$"):
        build_algorithm("cfl", linear_model(), {"0": 1}, {"eps1": 2.0, "eps2": 1.0})
    with pytest.raises(TaskHetError, match=r"^setting min_size must be >= 2, got 1$"):
        build_algorithm("cfl", linear_model(), {"0": 1}, {"min_size": 1})
