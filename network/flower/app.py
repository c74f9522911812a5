"""The Flower app of a real deployment: ``server_app`` and ``client_app`` for ``flwr run flower/``.

A SuperLink runs ``server_app`` (the :class:`~network.flower.server.FlowerEngine` round loop);
one SuperNode per machine runs ``client_app`` for the clients whose data that machine holds.
Both read the same run config: ``run-config``, a :class:`network.run_config.RunConfig` as JSON
(``RunConfig.to_json``), and both build the run with ``network.run.prepare``, so a
deployment computes what ``test_fed.py --engine flower`` computes on one machine
(docs/FLOWER.md). The server needs the manifest, the assignment file and the global test
split's files; a node needs the manifest, the assignment file and its own clients' files.

Run config (``flwr run --run-config FILE.toml``; ``python -m network.flower.app <test_fed.py
flags>`` prints one): ``run-config`` (string), ``reply-timeout-s`` (0: wait for every reply),
``node-wait-s`` (both seconds in [0, 604800], a week). ``RunConfig.min_available_clients`` is the
server's ``--min_available_clients``; ``RunConfig.threads`` (``--threads``) sets torch's CPU threads
in the server's process and in each message's process on a node, as test_fed.py does in its own.

Node config (``flower-supernode --node-config``), each optional except ``partition-ids``:

* ``partition-ids``: the client ids (as in assignments.csv) whose data this node holds, comma-separated.
* ``data-path``, ``manifest``, ``assignments``, ``centralized-checkpoint``: this machine's
  copies, when its paths differ from the run's (they replace those fields of the RunConfig).
* ``state-dir``: where the node keeps client state (SCAFFOLD's c_i, FedRep's heads);
  default ``~/.taskhet/node_states``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import utils.tv_compat  # noqa: F401  (before anything imports torchvision)
import torch
from flwr.app import Context
from flwr.serverapp import Grid

from network.flower.node import NodeHost, make_client_app
from network.flower.protocol import NODE_PATHS, NODE_WAIT, PARTITION_IDS, REPLY_TIMEOUT, RUN_CONFIG, STATE_DIR
from network.flower.server import FlowerEngine, make_server_app
from network.run import open_run_folder, prepare
from network.run_config import RunConfig
from utils.cli import floats, run_main
from utils.errors import TaskHetError

DEFAULT_STATE_DIR = Path("~/.taskhet/node_states")
DEFAULT_NODE_WAIT_S = 600.0
# reply-timeout-s and node-wait-s: seconds, at most a week (0: no reply timeout).
WAIT_SECONDS = floats(0.0, 7 * 86_400.0)


def run_config(context: Context, node_paths: bool = False) -> RunConfig:
    """The run's RunConfig from the Flower run config (with this node's own paths when ``node_paths``)."""
    if RUN_CONFIG not in context.run_config:
        raise TaskHetError(f"the Flower run config has no {RUN_CONFIG!r} (a RunConfig as JSON; "
                           "`python -m network.flower.app <test_fed.py flags>` prints it); see docs/FLOWER.md")
    from steps.federated import check_run_config  # the flags' ranges and checks, for a config that skipped them

    config = check_run_config(RunConfig.from_json(str(context.run_config[RUN_CONFIG])))
    overrides = {field: Path(str(context.node_config[key])) for key, field in NODE_PATHS
                 if node_paths and key in context.node_config}
    return config.replace(**overrides)


def use_threads(config: RunConfig) -> RunConfig:
    """Set this process's torch CPU threads to the run's ``--threads`` (unset: torch's own choice, one per core).

    A node answers each message in a fresh process, so this runs once per message. On a node shared with other
    jobs, one per core oversubscribes the cores: the first step of a small model took 3.7 s with 2 threads and 0.17 s
    with 1 on the project's busy 2-core machine (docs/FLOWER.md).
    """
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    return config


def wait_seconds(run_config: dict, key: str, default: float) -> float:
    """The run config's ``key`` (a TOML number, or its text of ASCII digits) in :data:`WAIT_SECONDS`; one error line
    naming the key otherwise."""
    value = run_config.get(key, default)
    try:
        return WAIT_SECONDS.parse(value) if isinstance(value, str) else WAIT_SECONDS.check(value)
    except ValueError as error:
        raise TaskHetError(f"the Flower run config's {key} {error}") from None


def client_ids(table) -> list[str]:
    """Every client id in the sequential engine's order (network.client_data.make_clients groups by sorted id)."""
    return [str(client_id) for client_id in sorted(table["client_id"].unique())]


def build_engine(grid: Grid, context: Context) -> FlowerEngine:
    """The server side: the engine over every client of the assignments, writing the run folder."""
    from network.client_data import global_test_loader, global_val_loader
    from network.schedule import table_schedules
    from utils.run_dir import setup_logging

    setup = prepare(use_threads(run_config(context)))
    config, flower = setup.config, context.run_config
    open_run_folder(setup)
    # Not closed here: Flower runs a deployment's ServerApp in a process of its own, which ends with the run.
    logger = setup_logging(config.out)
    test_loader = global_test_loader(config, setup.manifest, setup.task, setup.feature_model)
    return FlowerEngine(grid, setup.model, setup.algorithm, client_ids(setup.table), setup.evaluate_fn,
                        test_loader, setup.engine_config, setup.device, setup.model_config, logger,
                        config.min_available_clients, wait_seconds(flower, REPLY_TIMEOUT, 0.0) or None,
                        wait_seconds(flower, NODE_WAIT, DEFAULT_NODE_WAIT_S),
                        val_loader=global_val_loader(config, setup.manifest, setup.task, setup.feature_model),
                        schedules=table_schedules(setup.table))


def build_node(context: Context) -> NodeHost:
    """A SuperNode's side: the clients of its ``partition-ids``, from this machine's data only."""
    if PARTITION_IDS not in context.node_config:
        raise TaskHetError(f"this SuperNode has no {PARTITION_IDS!r} in its --node-config (the client ids whose "
                           "data it holds, comma-separated)")
    wanted = [part.strip() for part in str(context.node_config[PARTITION_IDS]).split(",") if part.strip()]
    from network.client_data import make_clients

    setup = prepare(use_threads(run_config(context, node_paths=True)))
    unknown = sorted(set(wanted) - set(client_ids(setup.table)))
    if unknown:
        raise TaskHetError(f"{PARTITION_IDS} lists client(s) {', '.join(unknown)}, not in {setup.config.assignments}")
    # Only this node's clients: no other client's files and none of the global test split are opened.
    mine = setup.table[setup.table["client_id"].astype(str).isin(wanted)]
    clients = make_clients(setup.config, setup.manifest, mine, setup.task, setup.feature_model)
    state_dir = Path(str(context.node_config.get(STATE_DIR, DEFAULT_STATE_DIR))).expanduser()
    return NodeHost(setup.model, setup.algorithm, {client.client_id: client for client in clients},
                    setup.loss_fn, setup.evaluate_fn, setup.device, state_dir)


def run_config_toml(argv: list[str]) -> str:
    """The ``run-config`` line of a Flower run-config file for ``test_fed.py``'s flags ``argv``.

    A JSON string is a valid TOML basic string, so the RunConfig's JSON is written as one.
    """
    from steps.federated import parse_run_config

    config = parse_run_config(argv, prog="python -m network.flower.app", description=APP_DESCRIPTION)
    if config is None:
        raise TaskHetError("--list_methods prints the algorithms; pass a run's flags to get its run config")
    return f"{RUN_CONFIG} = {json.dumps(config.to_json())}"


APP_DESCRIPTION = """Print the run-config line of a Flower deployment (docs/FLOWER.md) for a run given by test_fed.py's
flags: python -m network.flower.app <flags> > run.toml, then flwr run flower/ --run-config run.toml.
The flags are exactly test_fed.py's (step 4); --method X --help lists X's settings."""

server_app = make_server_app(build_engine)
client_app = make_client_app(build_node)

def main(argv: list[str] | None = None) -> None:
    """Print the run-config line for ``test_fed.py`` flags (``python -m network.flower.app <flags> > run.toml``)."""
    print(run_config_toml(sys.argv[1:] if argv is None else list(argv)))


if __name__ == "__main__":
    run_main(main)
