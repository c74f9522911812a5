"""The Flower engine writes the ``val`` rows the sequential engine writes (docs/FLOWER.md: the same metrics.csv)."""

from __future__ import annotations

import pandas as pd
import pytest

pytest.importorskip("flwr")

from flwr.app import Context, RecordDict  # noqa: E402

from datasets.digits import select_digits  # noqa: E402
from datasets.family import validation_mask  # noqa: E402
from network.run_outputs import GLOBAL_VAL_SPLIT  # noqa: E402
from network.flower import protocol  # noqa: E402
from partitioning.assignments import write_assignments  # noqa: E402
from tests.test_engine_flower import InProcessGrid, assert_same_metrics, task_identity  # noqa: E402,F401  (an autouse fixture)
from utils.errors import TaskHetError  # noqa: E402


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """A 3-client digits run whose manifest has validation rows (val = 1), kept out of every client."""
    folder = tmp_path_factory.mktemp("flower_val")
    manifest = select_digits(0.2, seed=0, n_samples=120, val_fraction=0.2)
    manifest.to_csv(folder / "manifest.csv", index=False)
    train = manifest[(manifest.split == "train") & ~validation_mask(manifest)].reset_index(drop=True)
    table = pd.DataFrame({"sample_id": train["sample_id"], "client_id": train.index % 3, "group": train["label"],
                          "subset": ["test" if index % 4 == 3 else "train" for index in train.index]})
    write_assignments(folder / "assignments.csv", table, {"scheme": "round_robin", "n_clients": 3, "groups": "label"})
    argv = ["--task", "digit_class", "--method", "fedavg", "--manifest", str(folder / "manifest.csv"),
            "--assignments", str(folder / "assignments.csv"), "--encoder", "small_cnn", "--image_size", "16",
            "--batch_size", "4", "--local_steps", "2", "--n_rounds", "2", "--no-use_accelerator", "--no-progress"]
    return folder, argv


def test_the_deployment_app_writes_the_val_rows_of_a_sequential_run(digits_run, tmp_path):
    from network.flower import app
    from network.run import prepare, run
    from steps.federated import parse_run_config

    _, argv = digits_run
    run(prepare(parse_run_config(argv + ["--out", str(tmp_path / "sequential")])))
    config = parse_run_config(argv + ["--out", str(tmp_path / "flower"), "--engine", "flower"])
    server = Context(run_id=1, node_id=0, state=RecordDict(), node_config={},
                     run_config={protocol.RUN_CONFIG: config.to_json(), protocol.NODE_WAIT: 1.0})
    nodes = {node_id: Context(run_id=1, node_id=node_id, state=RecordDict(), run_config=server.run_config,
                              node_config={"partition-ids": ids, "state-dir": str(tmp_path / f"node{node_id}")})
             for node_id, ids in ((1, "0,2"), (2, "1"))}
    app.build_engine(InProcessGrid(app.client_app, nodes), server).run()
    sequential = pd.read_csv(tmp_path / "sequential" / "metrics.csv", dtype={"client": str})
    flower = pd.read_csv(tmp_path / "flower" / "metrics.csv", dtype={"client": str})
    val = flower[flower.split == GLOBAL_VAL_SPLIT]
    assert sorted(val["round"].unique()) == [0, 1, 2] and {"loss", "top1"} <= set(val.metric)
    assert len(val) == (sequential.split == GLOBAL_VAL_SPLIT).sum()
    assert_same_metrics(tmp_path / "sequential", tmp_path / "flower")  # every row, val included, same values


def test_the_simulation_engine_is_handed_the_val_rows(digits_run, tmp_path, monkeypatch):
    """test_fed.py --engine flower passes the manifest's validation rows to Flower's simulation (Ray itself is
    exercised in tests/test_engine_flower.py; here the run stops at the hand-over)."""
    import network.flower.simulation as simulation
    from network.run import prepare, run
    from steps.federated import parse_run_config

    folder, argv = digits_run
    handed = {}

    def capture(*args, val_loader=None, **kwargs):
        handed["ids"] = [sample for batch in val_loader for sample in batch["sample_id"]]
        raise TaskHetError("stopped at the hand-over")

    monkeypatch.setattr(simulation, "run_flower", capture)
    with pytest.raises(TaskHetError, match="hand-over"):
        run(prepare(parse_run_config(argv + ["--out", str(tmp_path / "flower"), "--engine", "flower"])))
    manifest = pd.read_csv(folder / "manifest.csv")
    assert sorted(map(str, handed["ids"])) == sorted(map(str, manifest.loc[validation_mask(manifest), "sample_id"]))
