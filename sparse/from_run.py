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

from models.frozen_encoder import load_full_checkpoint
from network.aggregation import Weights
from network.algorithms.base import load_weights
from network.algorithms.sparse_finetune import BASE_PREFIX, LOCAL_PREFIX, MASK_PREFIX
from utils.errors import TaskHetError

# λ's validation data: auto (manifest_val when the manifest has val rows, else held_out), the manifest's own val = 1
# rows (cifar's, digits'), a seeded share of the manifest train rows no client holds, or the clients' test rows pooled.
VAL_SPLITS = ("auto", "manifest_val", "held_out", "client_test")


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
    from network.run import prepare
    from network.run_config import RunConfig

    run_dir = Path(run_dir)
    record = _read_config(run_dir)
    # a frozen encoder left out of θ_0 and the θ_k is put back (hash checked), so every model is whole
    checkpoint = load_full_checkpoint(run_dir / "checkpoint.pt", "--run: step-4 checkpoint",
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


def validation_loader(run: RunModels, split: str, fraction: float) -> tuple[Iterable[dict], str]:
    """The λ-search batches and the split they come from (``auto`` resolved).

    ``manifest_val``: the manifest's validation rows (``val = 1``; step 3b gives them to no client, so every
    run of such a manifest has them); ``held_out``: a seeded ``fraction`` of the manifest's train rows no client
    holds; ``client_test``: every client's test rows (the data the per-client comparison also uses); ``auto``:
    ``manifest_val`` when the manifest has validation rows, else ``held_out``.
    """
    from datasets.family import validation_mask
    from network.calibration_split import calibration_ids
    from network.client_data import task_dataset
    from training.loop import make_loader

    config, table, manifest = run.setup.config, run.setup.table, run.setup.manifest
    if split not in VAL_SPLITS:
        raise TaskHetError(f"--val_split must be one of {', '.join(VAL_SPLITS)}, got {split}")
    val_ids = manifest.loc[validation_mask(manifest), "sample_id"].tolist()
    if split == "auto":
        split = "manifest_val" if val_ids else "held_out"
    if split == "manifest_val":
        ids = val_ids
        if not ids:
            raise TaskHetError(f"--val_split manifest_val: manifest {config.manifest} has no validation rows (val = 1); "
                               "use --val_split held_out or client_test")
    elif split == "held_out":
        try:
            ids = calibration_ids(manifest, table, fraction, config.rand_seed, "merge_validation", "--val_fraction")
        except TaskHetError as error:
            raise TaskHetError(f"--val_split held_out: {error}; or pass --val_split client_test") from None
        if not ids:
            raise TaskHetError("--val_split held_out needs --val_fraction > 0")
    else:
        ids = table.loc[table["subset"] == "test", "sample_id"].tolist()
        if not ids:
            raise TaskHetError(f"--val_split client_test: {config.assignments} has no client-test rows")
    loader = make_loader(task_dataset(config, manifest, run.setup.task, ids), config.batch_size, False, 0,
                         config.num_workers)
    return loader, split


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
