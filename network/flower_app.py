"""The Flower app of a real deployment: ``server_app`` and ``client_app`` for ``flwr run flower/``.

A SuperLink runs ``server_app`` (the :class:`~network.engine_flower.FlowerEngine` round loop);
one SuperNode per machine runs ``client_app`` for the clients whose data that machine holds.
Both read the same run config, ``test-fed-args``: the arguments of ``test_fed.py``, so a
deployment computes what ``test_fed.py --engine flower`` computes on one machine (docs/FLOWER.md).
The server needs the manifest, the assignment file and the global test split's files; a node
needs the manifest, the assignment file and its own clients' files, nothing else.

Node config (``flower-supernode --node-config``), each optional except ``partition-ids``:

* ``partition-ids``: the client ids (as in assignments.csv) whose data this node holds, comma-separated.
* ``data-path``, ``manifest``, ``assignments``, ``centralized-checkpoint``: this machine's
  copies, when its paths differ from the run's.
* ``state-dir``: where the node keeps client state (SCAFFOLD's c_i, FedRep's heads);
  default ``~/.taskhet/node_states``.

Run config (``flwr run --run-config``): ``test-fed-args`` (string), ``min-available-clients``
(0: every sampled client), ``reply-timeout-s`` (0: wait for every reply), ``node-wait-s``.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from functools import partial
from typing import Any, Iterable

import utils.tv_compat  # noqa: F401  (before anything imports torchvision)
from flwr.app import Context
from flwr.serverapp import Grid

from network.engine_flower import (PARTITION_IDS, STATE_DIR, FlowerEngine, NodeHost, make_client_app,
                                   make_server_app)
from network.engine_sequential import ClientData
from utils.errors import TaskHetError

RUN_ARGS = "test-fed-args"
MIN_AVAILABLE = "min-available-clients"
REPLY_TIMEOUT = "reply-timeout-s"
NODE_WAIT = "node-wait-s"
NODE_PATHS = ("data-path", "manifest", "assignments", "centralized-checkpoint")  # node config -> test_fed.py flag
DEFAULT_STATE_DIR = Path("~/.taskhet/node_states")


def run_arguments(context: Context, node_paths: bool = False) -> argparse.Namespace:
    """``test_fed.py``'s arguments from the run config (with a node's own paths when ``node_paths``)."""
    import test_fed

    if RUN_ARGS not in context.run_config:
        raise TaskHetError(f"the run config has no {RUN_ARGS!r} (the test_fed.py arguments); see docs/FLOWER.md")
    argv = shlex.split(str(context.run_config[RUN_ARGS]))
    for key in NODE_PATHS if node_paths else ():
        if key in context.node_config:
            argv += [f"--{key.replace('-', '_')}", str(context.node_config[key])]
    return test_fed.build_parser().parse_args(argv)


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """What test_fed.main builds before its engine, except the client data.

    Returns:
        ``args`` (resolved), ``task``, ``manifest``, ``table`` (the assignments), ``model``,
        ``algorithm``, ``config`` (EngineConfig), ``device``, ``loss_fn`` and ``evaluate_fn``.
    """
    import test_fed
    from datasets.taskonomy import read_manifest
    from models import get_task
    from network.algorithms import AlgorithmConfig, get_algorithm
    from network.engine_sequential import EngineConfig, make_lr_schedule
    from utils.assignments import load_assignments
    from utils.device import pick_device, prepare_model
    from utils.seeding import set_deterministic
    from utils.training import evaluate

    task = get_task(args.task)
    args.assignments = args.assignments or test_fed.default_assignments(args)
    manifest = read_manifest(args.manifest)
    table, meta = load_assignments(args.assignments, manifest)
    args = test_fed.resolve(args, meta)
    set_deterministic(args.deterministic)
    num_classes = int(manifest["scene_class"].max()) + 1 if task.kind == "classification" else None
    device = pick_device(args.use_accelerator)
    algorithm = get_algorithm(args.method, AlgorithmConfig(
        num_clients=int(meta.get("n_clients") or table["client_id"].nunique()), mu=args.mu,
        server_opt=args.server_opt, server_lr=args.server_lr, scaffold_option=args.scaffold_option,
        head_epochs=args.head_epochs, body_epochs=args.body_epochs))
    config = EngineConfig(
        out_dir=args.out, n_rounds=args.n_rounds,
        lr_schedule=make_lr_schedule(args.lr_schedule, args.init_lr, args.n_rounds), seed=args.rand_seed,
        local_steps=args.local_steps, local_epochs=args.local_epochs, client_fraction=args.client_fraction,
        eval_every=args.eval_every, momentum=args.momentum, weight_decay=args.weight_decay, resume=args.resume,
        progress=args.progress,
        signature={key: str(value) for key, value in vars(args).items() if key not in test_fed.NOT_IN_SIGNATURE})
    return {"args": args, "task": task, "manifest": manifest, "table": table, "algorithm": algorithm,
            "model": prepare_model(test_fed.initial_model(args, num_classes), device), "config": config,
            "device": device, "loss_fn": lambda net, batch: task.loss(net(batch["rgb"])[0].float(), batch),
            # The model's own device: a node may train on another device than the server's.
            "evaluate_fn": lambda net, loader: evaluate(net, loader, task, next(net.parameters()).device)}


def client_ids(table) -> list[str]:
    """Every client id in the sequential engine's order (test_fed.build_clients groups by sorted id)."""
    return [str(client_id) for client_id in sorted(table["client_id"].unique())]


def build_engine(grid: Grid, context: Context) -> FlowerEngine:
    """The server side: the engine over every client of the assignments, writing the run folder."""
    from utils.run_dir import setup_logging, write_config
    from utils.training import make_loader

    parts = prepare(run_arguments(context))
    args, config = parts["args"], context.run_config
    args.out.mkdir(parents=True, exist_ok=True)
    logger = setup_logging(args.out, "test_fed")
    write_config(args.out, vars(args))
    test_ids = parts["manifest"].loc[parts["manifest"]["split"] == "test", "sample_id"]
    test_loader = make_loader(_dataset(args, parts["manifest"], parts["task"], test_ids), args.batch_size, False, 0,
                              args.num_workers)
    return FlowerEngine(grid, parts["model"], parts["algorithm"], client_ids(parts["table"]), parts["evaluate_fn"],
                        test_loader, parts["config"], parts["device"], parts["model"].config, logger,
                        int(config.get(MIN_AVAILABLE, 0)) or None, float(config.get(REPLY_TIMEOUT, 0)) or None,
                        float(config.get(NODE_WAIT, 600)))


def build_node(context: Context) -> NodeHost:
    """A SuperNode's side: the clients of its ``partition-ids``, from this machine's data only."""
    if PARTITION_IDS not in context.node_config:
        raise TaskHetError(f"this SuperNode has no {PARTITION_IDS!r} in its --node-config (the client ids whose "
                           "data it holds, comma-separated)")
    wanted = [part.strip() for part in str(context.node_config[PARTITION_IDS]).split(",") if part.strip()]
    parts = prepare(run_arguments(context, node_paths=True))
    args, table = parts["args"], parts["table"]
    unknown = sorted(set(wanted) - set(client_ids(table)))
    if unknown:
        raise TaskHetError(f"{PARTITION_IDS} lists client(s) {', '.join(unknown)}, not in {args.assignments}")
    clients = node_clients(args, parts["manifest"], table[table["client_id"].astype(str).isin(wanted)], parts["task"])
    state_dir = Path(str(context.node_config.get(STATE_DIR, DEFAULT_STATE_DIR))).expanduser()
    return NodeHost(parts["model"], parts["algorithm"], {client.client_id: client for client in clients},
                    parts["loss_fn"], parts["evaluate_fn"], parts["device"], state_dir)


def node_clients(args: argparse.Namespace, manifest, table, task) -> list[ClientData]:
    """ClientData for the clients in ``table``, as test_fed.build_clients makes them (same sample order,
    same loader seeds), without the files of any other client or of the global test split."""
    from torch.utils.data import Subset

    from utils.training import make_loader

    table = table.reset_index(drop=True)
    assigned, clients = _dataset(args, manifest, task, table["sample_id"]), []
    for client_id, rows in table.groupby("client_id", sort=True):
        train, test = (rows.index[rows["subset"] == subset].tolist() for subset in ("train", "test"))
        train_loader = partial(make_loader, Subset(assigned, train), args.batch_size, True,
                               num_workers=args.num_workers)
        test_loader = make_loader(Subset(assigned, test), args.batch_size, False, 0, args.num_workers) if test else None
        clients.append(ClientData(str(client_id), len(train), train_loader, test_loader))
    return clients


def _dataset(args: argparse.Namespace, manifest, task, sample_ids: Iterable[str]):
    from datasets.taskonomy import TaskonomyDataset

    rows = manifest.set_index("sample_id").loc[list(sample_ids)].reset_index()
    return TaskonomyDataset(args.data_path, rows, task.required_domains, args.image_size, args.cache_dir)


server_app = make_server_app(build_engine)
client_app = make_client_app(build_node)
