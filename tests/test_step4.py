"""Step 4 end to end on tiny synthetic data (test_fed.py)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

import test_fed
from network.client import GLOBAL_TEST_SPLIT
from network.run_outputs import GLOBAL_CLIENT
from datasets.taskonomy import read_manifest
from models import build_task_model, load_task_model
from partitioning.assignments import write_assignments
from tests.fixtures import tiny_data_root, tiny_manifest  # noqa: F401  (session fixtures)
from utils.errors import TaskHetError
from utils.run_dir import atomic_torch_save, load_checkpoint

N_CLIENTS = 3


@pytest.fixture
def assignments(tiny_manifest, tmp_path):  # noqa: F811
    """Round-robin clients over the manifest's train split; every third sample of a client is client-test."""
    train = read_manifest(tiny_manifest).query("split == 'train'").sort_values("sample_id").reset_index(drop=True)
    table = pd.DataFrame({"sample_id": train["sample_id"], "client_id": train.index % N_CLIENTS,
                          "group": train["scene_class"],
                          "subset": ["test" if (index // N_CLIENTS) % 3 == 2 else "train" for index in train.index]})
    path = tmp_path / "assignments" / "assignments.csv"
    write_assignments(path, table, {"scheme": "round_robin", "alpha": 1.0, "n_clients": N_CLIENTS, "groups": "scene_class"})
    return path


def argv(data_root, manifest, assignments, out, *extra):
    return ["--task", "depth_euclidean", "--data_path", str(data_root), "--manifest", str(manifest),
            "--assignments", str(assignments), "--out", str(out), "--encoder", "small_cnn", "--image_size", "32",
            "--n_rounds", "2", "--local_steps", "2", "--batch_size", "4", "--no-use_accelerator", "--no-progress",
            "--rand_seed", "1", *extra]


def test_client_state_memory_mb_is_megabytes(tiny_data_root, tiny_manifest, assignments, tmp_path):  # noqa: F811
    """--client_state_memory_mb counts MiB (2**20 bytes): FedRep's three client heads (a few kB each) fit in 1 MB and
    stay in memory; with 0 MB every state spills to OUT/client_states; the run is the same either way."""
    runs = {}
    for limit in ("1", "0"):
        out = tmp_path / f"mb{limit}"
        test_fed.main(argv(tiny_data_root, tiny_manifest, assignments, out, "--method", "fedrep",
                           "--client_state_memory_mb", limit, "--keep_client_state"))
        runs[limit] = load_checkpoint(out / "checkpoint.pt")
    states = runs["1"]["client_states"]
    size = sum(value.numel() * value.element_size() for state in states.values() for value in state.values())
    assert len(states) == N_CLIENTS and 100 < size < 2 ** 20  # the three states together fit in 1 MiB
    assert not list((tmp_path / "mb1" / "client_states").glob("client_*.pt"))
    assert len(list((tmp_path / "mb0" / "client_states").glob("client_*.pt"))) == N_CLIENTS
    for client_id, state in states.items():
        for key, value in state.items():
            assert torch.equal(value, runs["0"]["client_states"][client_id][key]), (client_id, key)


@pytest.mark.parametrize("method", ["fedavg", "fedrep"])
def test_step4_writes_the_run_folder_and_resumes_without_redoing_work(tiny_data_root, tiny_manifest, assignments,  # noqa: F811
                                                                      tmp_path, method):
    out = tmp_path / "run"
    test_fed.main(argv(tiny_data_root, tiny_manifest, assignments, out, "--method", method))
    for name in ("config.json", "run.log", "metrics.csv", "checkpoint.pt", "best.pt", "curves.png"):
        assert (out / name).is_file(), name
    assert json.loads((out / "config.json").read_text())["args"]["method"] == method
    # The run's one-line summary, counted by hand: every train row of the assignments, the manifest's test split.
    n_train = int((pd.read_csv(assignments)["subset"] == "train").sum())
    n_test = int((read_manifest(tiny_manifest)["split"] == "test").sum())
    assert f"{method} on depth_euclidean: {N_CLIENTS} clients ({n_train} train samples), {n_test} test samples, device cpu" \
        in (out / "run.log").read_text()
    metrics = pd.read_csv(out / "metrics.csv", dtype={"client": str})
    assert list(metrics.columns) == ["round", "split", "client", "metric", "value"]
    tested = metrics[(metrics.split == GLOBAL_TEST_SPLIT) & (metrics.client == GLOBAL_CLIENT)]
    assert sorted(tested["round"].unique()) == [0, 1, 2] and {"loss", "abs_rel"} <= set(tested.metric)
    splits = set(metrics.split)
    assert {"train", "client_test"} <= splits and (("client_test_personal" in splits) == (method == "fedrep"))
    assert set(metrics[(metrics.split == "client_test") & (metrics.metric == "loss")].client) >= {"0", "1", "2", "mean", "std"}
    checkpoint = load_checkpoint(out / "checkpoint.pt")
    # a finished run drops its clients' states by default (--keep_client_state keeps them)
    assert checkpoint["round"] == 2 and checkpoint["client_states"] == {} and not (out / "client_states").exists()
    load_task_model(out / "best.pt")  # step-2 layout: a TaskModel rebuilds from it

    before = (out / "metrics.csv").read_bytes()
    test_fed.main(argv(tiny_data_root, tiny_manifest, assignments, out, "--method", method))
    assert (out / "metrics.csv").read_bytes() == before
    with pytest.raises(TaskHetError, match="different run"):
        test_fed.main(argv(tiny_data_root, tiny_manifest, assignments, out, "--method", method, "--init_lr", "0.5"))


def test_step4_starts_from_a_centralized_checkpoint(tiny_data_root, tiny_manifest, assignments, tmp_path):  # noqa: F811
    model = build_task_model("depth_euclidean", "small_cnn", "none", seed=5)
    atomic_torch_save({"model": model.state_dict(), "model_config": model.config}, tmp_path / "best.pt")
    out = tmp_path / "run"
    test_fed.main(argv(tiny_data_root, tiny_manifest, assignments, out, "--init_from", "centralized",
                       "--centralized_checkpoint", str(tmp_path / "best.pt"), "--n_rounds", "1", "--method", "scaffold"))
    assert load_checkpoint(out / "checkpoint.pt")["round"] == 1
    other = build_task_model("normal", "small_cnn", "none")
    atomic_torch_save({"model": other.state_dict(), "model_config": other.config}, tmp_path / "normal.pt")
    with pytest.raises(TaskHetError, match="is a normal model"):
        test_fed.main(argv(tiny_data_root, tiny_manifest, assignments, tmp_path / "other", "--init_from", "centralized",
                           "--centralized_checkpoint", str(tmp_path / "normal.pt")))


def test_mismatched_assignments_are_rejected_naming_the_rows(tiny_data_root, tiny_manifest, assignments, tmp_path):  # noqa: F811
    table = pd.read_csv(assignments, dtype=str)
    table.loc[1, "sample_id"] = "nowhere_point_0_view_0"
    table.loc[3, "sample_id"] = table.loc[2, "sample_id"]
    table.to_csv(assignments, index=False)
    with pytest.raises(TaskHetError) as error:
        test_fed.main(argv(tiny_data_root, tiny_manifest, assignments, tmp_path / "run"))
    message = str(error.value)
    assert "row 3 ('nowhere_point_0_view_0')" in message and "duplicated sample id" in message and "row 5" in message
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


@pytest.mark.parametrize("extra, flag", [(["--n_clients", "4"], "--n_clients"), (["--alpha", "0.5"], "--alpha"),
                                         (["--type", "embedding_based"], "--type"),
                                         (["--local_epochs", "1"], "--local_epochs"),
                                         (["--lr_schedule", "linear"], "--lr_schedule"),
                                         (["--init_from", "centralized"], "--centralized_checkpoint")])
def test_contradictory_arguments_are_rejected_naming_the_flag(tiny_data_root, tiny_manifest, assignments, tmp_path,  # noqa: F811
                                                              extra, flag):
    with pytest.raises(TaskHetError, match=flag):
        test_fed.main(argv(tiny_data_root, tiny_manifest, assignments, tmp_path / "run", *extra))


def test_step4_gives_the_flower_engine_its_min_available_clients(tiny_data_root, tiny_manifest, assignments, tmp_path):  # noqa: F811
    """--min_available_clients reaches the Flower engine: above the 3 clients a round samples it is refused."""
    with pytest.raises(TaskHetError, match=r"--min_available_clients must be between 1 and the 3 clients sampled per "
                                           r"round, got 4"):
        test_fed.main(argv(tiny_data_root, tiny_manifest, assignments, tmp_path / "run", "--engine", "flower",
                           "--min_available_clients", "4"))


def test_step4_refuses_more_simulated_flower_nodes_than_clients_before_any_work(tiny_data_root, tiny_manifest,  # noqa: F811
                                                                                  assignments, tmp_path):
    """--flower_num_nodes K: 1 to the run's clients, checked against the assignments before anything is written;
    '²', 0 and huge values are refused by the parser; with N known, more nodes than N before any file is read."""
    from steps import federated

    with pytest.raises(TaskHetError, match=r"^--flower_num_nodes 4: the simulated nodes must be 1 to the run's 3 clients$"):
        test_fed.main(argv(tiny_data_root, tiny_manifest, assignments, tmp_path / "run", "--engine", "flower",
                           "--flower_num_nodes", "4"))
    assert not (tmp_path / "run").exists()
    for bad in ("²", "0", "-1", "1e3", "10000000000000000000000"):
        with pytest.raises(TaskHetError, match=r"^argument --flower_num_nodes: must be an integer in \[1, 10000\], got "):
            federated.check_arguments(["--task", "normal", "--flower_num_nodes", bad])
    flower = ["--task", "normal", "--assignments", "a.csv", "--engine", "flower", "--flower_num_nodes"]
    for nodes in ("1", "3"):
        assert federated.check_arguments([*flower, nodes], n_clients=3).flower_num_nodes == int(nodes)
    with pytest.raises(TaskHetError, match="^--flower_num_nodes 4: the simulated nodes must be 1 to the run's 3 clients$"):
        federated.check_arguments([*flower, "4"], n_clients=3)
    assert federated.check_arguments(flower[:4] + ["--flower_num_nodes", "4"], n_clients=3)  # another engine


def test_step4_finetunes_each_client_before_evaluation_when_asked(tiny_data_root, tiny_manifest, assignments,  # noqa: F811
                                                                  tmp_path):
    out = tmp_path / "finetuned"
    test_fed.main(argv(tiny_data_root, tiny_manifest, assignments, out, "--finetune_steps", "2"))
    metrics = pd.read_csv(out / "metrics.csv", dtype={"client": str})
    finetuned = metrics.query("split == 'client_test_finetuned' and metric == 'loss' and round == 2")
    plain = metrics.query("split == 'client_test' and metric == 'loss' and round == 2")
    assert set(finetuned.client) == set(plain.client) >= {"0", "1", "2", "mean"}
    assert not finetuned.set_index("client").value.equals(plain.set_index("client").value)


def test_step4_accepts_exactly_the_methods_settings(tiny_data_root, tiny_manifest, assignments, tmp_path,  # noqa: F811
                                                   capsys):
    with pytest.raises(TaskHetError, match=r"fedavg has no setting --mu; its settings: --weighting, --cap, --buckets, --noise_scale, --server_opt"):
        test_fed.main(argv(tiny_data_root, tiny_manifest, assignments, tmp_path / "x", "--mu", "0.1"))
    assert not (tmp_path / "x").exists()
    test_fed.main(["--list_methods"])
    listing = capsys.readouterr().out
    assert "fedprox:" in listing and "--mu (float, default 0.01; at most 1e+09 in magnitude)" in listing and "ifca:" in listing


def test_step4_gives_stragglers_their_share_of_the_steps_and_refuses_another_share_on_resume(  # noqa: F811
        tiny_data_root, tiny_manifest, assignments, tmp_path):
    """3 clients, --straggler_fraction 0.34: floor(0.34·3 + 1/2) = 1 straggler, taking floor(0.5·4) = 2 of 4 steps."""
    out = tmp_path / "stragglers"
    base = argv(tiny_data_root, tiny_manifest, assignments, out, "--straggler_fraction", "0.34")
    base[base.index("--local_steps") + 1] = "4"
    test_fed.main(base)
    table = pd.read_csv(out / "clients.csv", dtype={"client": str})
    assert sorted(table["local_step_budget"]) == [2, 4, 4]
    assert table["local_steps"].tolist() == table["local_step_budget"].tolist()
    with pytest.raises(TaskHetError, match="belongs to a different run"):
        test_fed.main([*base, "--straggler_share", "0.75"])
    bad = argv(tiny_data_root, tiny_manifest, assignments, tmp_path / "bad")
    epochs = bad[:bad.index("--local_steps")] + bad[bad.index("--local_steps") + 2:] + ["--local_epochs", "1"]
    for command, message in (([*bad, "--local_steps_range", "5:2"], "1 <= LOW <= HIGH, got 5:2"),
                             ([*epochs, "--local_steps_range", "2:5"], "use --local_steps, not --local_epochs"),
                             ([*bad, "--straggler_fraction", "0.5", "--vectorize_clients"], "cannot do unequal local work")):
        with pytest.raises(TaskHetError, match=message):
            test_fed.main(command)
        assert not (tmp_path / "bad").exists()
