"""Flower's simulation runtime on one machine: the ServerApp and one simulated node per client (or fewer).

:func:`run_flower` is what ``test_fed.py --engine flower`` runs (via ``network.run.run``):
the :class:`~network.flower.server.FlowerEngine` in this process, the nodes in Ray
workers, built from the objects the caller already has (no ``network.run.prepare`` per
node, unlike a real deployment: ``network/flower/app.py``).
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable

import torch
from flwr.app import Context
from flwr.serverapp import Grid
from torch import nn

from network.algorithms.base import Algorithm, LossFn
from network.client import ClientData, EvaluateFn
from network.engine_config import EngineConfig
from network.flower.node import NodeHost, make_client_app
from network.flower.protocol import NUM_PARTITIONS, PARTITION_ID
from network.flower.server import FlowerEngine, check_min_available, make_server_app
from network.schedule import schedules_of
from utils.device import pick_device, prepare_model
from utils.errors import TaskHetError

FLOWER_MODES = ("simulation",)
NODE_STATES_DIR = "node_states"  # the simulated nodes' client states, under the run folder


@dataclass(frozen=True)
class FlowerOptions:
    """Flower settings of test_fed.py (``--flower_*``, ``--min_available_clients``).

    Attributes:
        mode: "simulation" (Flower's simulation runtime here); a real deployment runs
            network/flower/app.py with ``flwr run`` (docs/FLOWER.md).
        num_cpus: CPU cores per client; Flower runs ⌊cores / num_cpus⌋ clients at once.
        num_gpus: share of a GPU per client (0.25: four clients per GPU; 0: clients on the CPU).
        min_available_clients: results a round needs (None: every sampled client).
        num_nodes: simulated SuperNodes (None: one per client); node p hosts clients[p::num_nodes].
        reply_timeout_s: a client silent this long after its round started counts as failed.
        node_wait_s: how long the server waits for the nodes to come up.
    """

    mode: str = "simulation"
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    min_available_clients: int | None = None
    num_nodes: int | None = None
    reply_timeout_s: float | None = None
    node_wait_s: float = 120.0


@dataclass(frozen=True)
class SimulationRecipe:
    """What every simulated node is built from (placed once in Ray's object store)."""

    model: nn.Module
    algorithm: Algorithm
    clients: tuple[ClientData, ...]
    loss_fn: LossFn
    evaluate_fn: EvaluateFn
    use_accelerator: bool
    state_dir: Path


@dataclass(frozen=True)
class SimulatedNodes:
    """``host_for`` of the simulation: node p of K hosts ``clients[p::K]`` of the recipe."""

    recipe: Any  # a ray.ObjectRef to a SimulationRecipe

    def __call__(self, context: Context) -> NodeHost:
        return node_share(_recipe_host(self.recipe), context)


def node_share(host: NodeHost, context: Context) -> NodeHost:
    """``host`` restricted to simulated node p of K's clients, ``clients[p::K]`` (p, K from the node config)."""
    ids = list(host.clients)[int(context.node_config[PARTITION_ID])::int(context.node_config[NUM_PARTITIONS])]
    return replace(host, clients={client_id: host.clients[client_id] for client_id in ids})


@functools.lru_cache(maxsize=1)
def _recipe_host(recipe_ref: Any) -> NodeHost:
    # Ray unpickles a fresh ClientApp for every message; the model and the client data are
    # built once per worker process instead (one recipe per simulation, hence maxsize=1).
    import ray

    recipe: SimulationRecipe = ray.get(recipe_ref)
    device = pick_device(recipe.use_accelerator)
    return NodeHost(prepare_model(recipe.model, device), recipe.algorithm,
                    {client.client_id: client for client in recipe.clients}, recipe.loss_fn, recipe.evaluate_fn,
                    device, recipe.state_dir)


def run_flower(model: nn.Module, algorithm: Algorithm, clients: list[ClientData], loss_fn: LossFn,
               evaluate_fn: EvaluateFn, test_loader: Iterable[dict], config: EngineConfig, device: torch.device,
               model_config: dict[str, Any] | None = None, logger: logging.Logger | None = None,
               options: FlowerOptions | None = None, val_loader: Iterable[dict] | None = None) -> FlowerEngine:
    """Run (or resume) the federated training in Flower's simulation runtime on this machine.

    Takes the sequential engine's arguments plus ``options`` and writes the same run folder
    (metrics.csv with the same splits, ``val`` included when ``val_loader`` is given; checkpoint.pt,
    best.pt, curves.png, clients.csv) plus ``node_states/`` (the nodes' client
    states). ``evaluate_fn`` runs on the nodes too, so it must use the model's own device.

    Returns:
        The finished server engine (``server``, ``global_weights``, ``best_loss``, …).
    """
    options = options or FlowerOptions()
    _check_options(options, device, len(clients))
    check_min_available(options.min_available_clients, len(clients), config.client_fraction)
    ids = [str(client.client_id) for client in clients]
    engines: list[FlowerEngine] = []

    def build_engine(grid: Grid, context: Context) -> FlowerEngine:
        engines.append(FlowerEngine(grid, model, algorithm, ids, evaluate_fn, test_loader, config, device,
                                    model_config, logger, options.min_available_clients, options.reply_timeout_s,
                                    options.node_wait_s, val_loader=val_loader, schedules=schedules_of(clients)))
        return engines[-1]

    import ray
    from flwr.simulation import run_simulation

    # Clients train on a GPU only with a GPU share: Ray hides the GPUs from a worker without one.
    recipe = SimulationRecipe(copy.deepcopy(model).cpu(), algorithm, tuple(clients), loss_fn, evaluate_fn,
                              device.type != "cpu" and options.num_gpus > 0, Path(config.out_dir) / NODE_STATES_DIR)
    if not ray.is_initialized():
        _start_ray()
    try:
        client_app = make_client_app(SimulatedNodes(ray.put(recipe)))
        run_simulation(make_server_app(build_engine), client_app, num_supernodes=options.num_nodes or len(clients),
                       backend_config={"client_resources": {"num_cpus": options.num_cpus,
                                                            "num_gpus": options.num_gpus}})
    finally:
        if ray.is_initialized():  # Flower shuts Ray down itself unless it failed before starting
            ray.shutdown()
    if not engines:
        raise TaskHetError("the Flower simulation ended before its ServerApp started (see the log above)")
    return engines[0]


def _start_ray() -> None:
    """Start a local Ray whose workers import the project by the driver's sys.path.

    The raylet inherits the environment at start-up and its workers inherit the raylet's, so
    PYTHONPATH is set only around ``ray.init`` (a ``runtime_env`` would do the same, but costs
    about a second per worker start on a small machine).
    """
    import ray

    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([*sys.path, *([previous] if previous else [])])
    try:
        # address "local": a new instance always. Without it ray.init joins a cluster someone started on this machine
        # with `ray start` (seen: a simulation joined a test's cluster and its actors died with that cluster's node)
        ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING)
    finally:
        if previous is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = previous


def _check_options(options: FlowerOptions, device: torch.device, num_clients: int) -> None:
    if options.mode not in FLOWER_MODES:
        raise TaskHetError(f"--flower_mode must be one of {', '.join(FLOWER_MODES)} (a real deployment runs "
                           f"network/flower/app.py with `flwr run`, see docs/FLOWER.md), got {options.mode!r}")
    cores = os.cpu_count() or 1
    if not 0 < options.num_cpus <= cores:
        raise TaskHetError(f"--flower_num_cpus must be in (0, {cores}] (this machine's cores), got {options.num_cpus}")
    if options.num_gpus < 0 or (options.num_gpus > 0 and not torch.cuda.is_available()):
        raise TaskHetError(f"--flower_num_gpus {options.num_gpus}: must be >= 0, and > 0 needs a CUDA GPU")
    check_num_nodes(options.num_nodes, num_clients)


def check_num_nodes(num_nodes: int | None, num_clients: int) -> None:
    """``--flower_num_nodes``: None (one simulated node per client) or 1..``num_clients`` (a node without a client
    would never answer)."""
    if num_nodes is not None and not 1 <= num_nodes <= num_clients:
        raise TaskHetError(f"--flower_num_nodes {num_nodes}: the simulated nodes must be 1 to the run's {num_clients} "
                           "clients")
