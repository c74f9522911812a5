"""A Flower node's message process imports only what a client message needs (docs/FLOWER.md, "Deployment cost").

A deployment runs every message in a fresh ``flwr-clientapp`` process, so each import of the
ClientApp's path is paid once per message: torchvision, scikit-learn, scipy and matplotlib
(and accelerate, step 2's) made TaskHet's message cost twice a bare Flower PyTorch app's
(bench/bench_flower_message.py). One fresh process imports the deployment's ClientApp module
and answers a real train message through it, then reports what it imported and how many torch
threads it ran (the run's ``--threads``, which a node sets in each message's process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("flwr")

from tests.fixtures import tiny_data_root, tiny_manifest  # noqa: E402,F401  (session fixtures)
from tests.test_engine_flower import tiny_run_argv  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# Libraries a client message of a small_cnn run without skews never needs (a resnet encoder needs torchvision).
NEVER = ("matplotlib", "sklearn", "scipy", "torchvision", "tensorboard", "timm", "clip", "accelerate")

# What flwr-clientapp does with a message (flwr/supernode/runtime/run_clientapp.py): import the app's module,
# call the ClientApp. The message is client 0's first train message, as network/flower/server.py builds it.
NODE_PROCESS = """
import json, sys
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from network.flower import app, protocol as P

spec = json.loads(sys.argv[1])
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
context = Context(run_id=1, node_id=1, state=RecordDict(), run_config=spec["run_config"],
                  node_config=spec["node_config"])
host = app.build_node(context)
broadcast = host.algorithm.broadcast(host.algorithm.init_server(host.model.state_dict()))
records, groups = P.bundle_records(P.BROADCAST_PREFIX, broadcast)
orders = ConfigRecord({P.RUN_KEY: "imports", P.ALGORITHM: host.algorithm.name, P.CLIENT_ID: "0", P.ROUND: 1,
                       P.SEED: 5, P.BUNDLE_GROUPS: groups, **P.local_training(0.01, 2, None, 0.0, 0.0)})
message = Message(RecordDict({**records, P.ORDERS_RECORD: orders}), dst_node_id=1,
                  message_type=MessageType.TRAIN, group_id="1")
message.metadata.__dict__["_message_id"] = "train-0"
reply = app.client_app(message, context)
answer = reply.error.reason if reply.has_error() else int(reply.content[P.REPLY_RECORD][P.NUM_SAMPLES])
import torch
print(json.dumps({"answer": answer, "imported": sorted(name for name in spec["never"] if name in sys.modules),
                  "threads": torch.get_num_threads()}))
"""


@pytest.mark.slow
def test_a_node_answers_a_train_message_with_the_runs_threads_and_no_unneeded_library(tiny_data_root,  # noqa: F811
                                                                                        tiny_manifest, tmp_path):
    from network.flower import protocol
    from steps.federated import parse_run_config

    argv = tiny_run_argv(tiny_data_root, tiny_manifest, tmp_path) + ["--out", str(tmp_path / "run"), "--threads", "1"]
    table = pd.read_csv(tmp_path / "assignments.csv")
    train_rows_of_client_0 = int(((table.client_id == 0) & (table.subset == "train")).sum())
    spec = {"run_config": {protocol.RUN_CONFIG: parse_run_config(argv).to_json()}, "never": NEVER,
            "node_config": {protocol.PARTITION_IDS: "0,2", protocol.STATE_DIR: str(tmp_path / "states")}}
    # torch would start with 2 threads: only the run's --threads 1 makes it 1, on any machine
    done = subprocess.run([sys.executable, "-c", NODE_PROCESS, json.dumps(spec)], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"answer": train_rows_of_client_0, "imported": [], "threads": 1}
    assert train_rows_of_client_0 > 0


def modules_loaded_by(code: str, names: tuple[str, ...]) -> list[str]:
    """Which of ``names`` a fresh Python process has imported after running ``code`` in the repository root."""
    probe = f"{code}; import json, sys; print(json.dumps(sorted(name for name in {names!r} if name in sys.modules)))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_pipeline_worker_imports_no_clustering_statistics_or_plotting_library():
    """A ``--jobs N`` worker and a Ray task import pipeline.pool to run a step-4 or step-3c stage; scikit-learn,
    scipy and matplotlib (step 3's clustering, the reports' statistics, step 3's pictures) cost about 1.5 s of each
    worker's start and none of its work, so they are imported only where used. A worker that trains on digits
    reads them without scikit-learn. run_pipeline.py imports no scipy before its report: an experiment file refused
    at once is refused without it."""
    worker = "import pipeline.pool; from datasets.digits import load_arrays; load_arrays()"
    assert modules_loaded_by(worker, ("sklearn", "scipy", "matplotlib")) == []
    assert modules_loaded_by("import run_pipeline", ("sklearn", "scipy")) == []


def test_the_ray_storage_check_task_imports_only_the_standard_library():
    """Ray imports a task's module on the node: the results-folder check must not bring torch or pandas there."""
    assert modules_loaded_by("import pipeline.ray_probe", ("torch", "pandas", "numpy")) == []
