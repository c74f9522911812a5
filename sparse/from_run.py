"""The base model, the clients' local models, their masks and their data, read from a finished step-4 run.

``merge_task_vectors.py --run`` merges the clients of a ``sparse_ft`` run made with
``--keep_local_models true``: its checkpoint.pt holds θ_0 (server tensors ``base/``),
each client's last local model θ_k (client state ``local/``) and the masks (client state
``mask/``, or the server's one mask). The run's config.json rebuilds the data: the
manifest, the assignments and the task model, through step 4's own ``network.run.prepare``.
A dense baseline is the same algorithm at ``--density 1``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from network.aggregation import Weights
from network.algorithms.base import load_weights
from network.algorithms.sparse_finetune import BASE_PREFIX, LOCAL_PREFIX, MASK_PREFIX
from utils.errors import TaskHetError
from utils.run_dir import load_checkpoint

VAL_SPLITS = ("held_out", "client_test")  # manifest train rows no client holds, or the clients' test rows pooled


@dataclass
class RunModels:
    """What a merge needs from one run.

    Attributes:
        base: θ_0 (every state entry). local: client id -> θ_k. masks: client id -> parameter name -> bool mask.
        setup: the run's ``network.run.FedSetup`` (model, task, manifest, assignments, evaluate_fn).
        client_loaders: client id -> its client-test batches (clients without test rows are left out).
    """

    base: Weights
    local: dict[str, Weights]
    masks: dict[str, Weights]
    setup: Any
    client_loaders: dict[str, Iterable[dict]]

    def loss_on(self, loader: Iterable[dict]) -> Callable[[Weights], float]:
        """weights -> the task loss of the run's model with those weights on ``loader``."""
        def loss(weights: Weights) -> float:
            load_weights(self.setup.model, weights)
            return float(self.setup.evaluate_fn(self.setup.model, loader)["loss"])
        return loss


def read_run(run_dir: Path, use_accelerator: bool = False) -> RunModels:
    """Models, masks and client data of the finished step-4 run in ``run_dir``."""
    from network.client_data import make_clients
    from network.run import RunConfig, prepare

    run_dir = Path(run_dir)
    record = _read_config(run_dir)
    checkpoint = load_checkpoint(run_dir / "checkpoint.pt", "--run: step-4 checkpoint",
                                 keys=("server", "client_states"), finished=True)
    tensors, states = checkpoint["server"]["tensors"], checkpoint["client_states"]
    base = _strip(tensors, BASE_PREFIX)
    local = {client_id: _strip(state, LOCAL_PREFIX) for client_id, state in states.items()}
    local = {client_id: weights for client_id, weights in local.items() if weights}
    if not base or not local:
        raise TaskHetError(f"{run_dir}/checkpoint.pt holds no client models: run step 4 with --method sparse_ft "
                           "--keep_local_models true")
    server_mask = _strip(tensors, MASK_PREFIX)
    masks = {client_id: _strip(states[client_id], MASK_PREFIX) or server_mask for client_id in local}
    config = RunConfig.from_json(json.dumps({**record["args"], "use_accelerator": use_accelerator, "progress": False}))
    setup = prepare(config)
    clients = make_clients(setup.config, setup.manifest, setup.table, setup.task)
    loaders = {client.client_id: client.test_loader for client in clients
               if client.client_id in local and client.test_loader is not None}
    return RunModels(base, dict(sorted(local.items())), masks, setup, loaders)


def validation_loader(run: RunModels, split: str, fraction: float) -> Iterable[dict]:
    """The λ-search batches: ``held_out`` (a seeded ``fraction`` of the manifest's train rows no client holds)
    or ``client_test`` (every client's test rows: the data the per-client comparison also uses)."""
    from network.calibration_split import calibration_ids
    from network.client_data import task_dataset
    from training.loop import make_loader

    config, table = run.setup.config, run.setup.table
    if split == "held_out":
        ids = calibration_ids(run.setup.manifest, table, fraction, config.rand_seed, "merge_validation", "--val_fraction")
        if not ids:
            raise TaskHetError("--val_split held_out needs --val_fraction > 0")
    elif split == "client_test":
        ids = table.loc[table["subset"] == "test", "sample_id"].tolist()
        if not ids:
            raise TaskHetError(f"--val_split client_test: {config.assignments} has no client-test rows")
    else:
        raise TaskHetError(f"--val_split must be one of {', '.join(VAL_SPLITS)}, got {split}")
    return make_loader(task_dataset(config, run.setup.manifest, run.setup.task, ids), config.batch_size, False, 0,
                       config.num_workers)


def _read_config(run_dir: Path) -> dict:
    path = run_dir / "config.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise TaskHetError(f"--run {run_dir}: cannot read config.json ({error})") from None
    if not isinstance(record, dict) or record.get("step") != "step 4" or "args" not in record:
        raise TaskHetError(f"--run {run_dir} is not a step-4 run folder (config.json names step {record.get('step')!r})"
                           if isinstance(record, dict) else f"--run {run_dir}: config.json is not an object")
    if record["args"].get("method") != "sparse_ft":
        raise TaskHetError(f"--run {run_dir} is a {record['args'].get('method')} run; merging needs sparse_ft "
                           "--keep_local_models true (--density 1 for a dense baseline)")
    return record


def _strip(weights: Weights, prefix: str) -> Weights:
    return {key[len(prefix):]: value for key, value in weights.items() if key.startswith(prefix)}
