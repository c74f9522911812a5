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

import utils.tv_compat  # noqa: F401  (before anything imports torchvision)
from flwr.app import Context
from flwr.serverapp import Grid

from network.engine_flower import (PARTITION_IDS, STATE_DIR, FlowerEngine, NodeHost, make_client_app,
                                   make_server_app)
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


def client_ids(table) -> list[str]:
    """Every client id in the sequential engine's order (test_fed.build_clients groups by sorted id)."""
    return [str(client_id) for client_id in sorted(table["client_id"].unique())]


def build_engine(grid: Grid, context: Context) -> FlowerEngine:
    """The server side: the engine over every client of the assignments, writing the run folder."""
    import test_fed
    from network.client_data import global_test_loader
    from utils.run_dir import setup_logging, write_config

    setup = test_fed.prepare(run_arguments(context))
    args, config = setup.args, context.run_config
    args.out.mkdir(parents=True, exist_ok=True)
    logger = setup_logging(args.out, "test_fed")
    write_config(args.out, vars(args))
    test_loader = global_test_loader(args, setup.manifest, setup.task)
    return FlowerEngine(grid, setup.model, setup.algorithm, client_ids(setup.table), setup.evaluate_fn,
                        test_loader, setup.config, setup.device, setup.model.config, logger,
                        int(config.get(MIN_AVAILABLE, 0)) or None, float(config.get(REPLY_TIMEOUT, 0)) or None,
                        float(config.get(NODE_WAIT, 600)))


def build_node(context: Context) -> NodeHost:
    """A SuperNode's side: the clients of its ``partition-ids``, from this machine's data only."""
    if PARTITION_IDS not in context.node_config:
        raise TaskHetError(f"this SuperNode has no {PARTITION_IDS!r} in its --node-config (the client ids whose "
                           "data it holds, comma-separated)")
    wanted = [part.strip() for part in str(context.node_config[PARTITION_IDS]).split(",") if part.strip()]
    import test_fed
    from network.client_data import make_clients

    setup = test_fed.prepare(run_arguments(context, node_paths=True))
    args, table = setup.args, setup.table
    unknown = sorted(set(wanted) - set(client_ids(table)))
    if unknown:
        raise TaskHetError(f"{PARTITION_IDS} lists client(s) {', '.join(unknown)}, not in {args.assignments}")
    # Only this node's clients: no other client's files and none of the global test split are opened.
    clients = make_clients(args, setup.manifest, table[table["client_id"].astype(str).isin(wanted)], setup.task)
    state_dir = Path(str(context.node_config.get(STATE_DIR, DEFAULT_STATE_DIR))).expanduser()
    return NodeHost(setup.model, setup.algorithm, {client.client_id: client for client in clients},
                    setup.loss_fn, setup.evaluate_fn, setup.device, state_dir)


server_app = make_server_app(build_engine)
client_app = make_client_app(build_node)
