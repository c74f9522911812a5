"""The Flower engine: the sequential engine's round loop, with the clients behind Flower messages.

The same algorithm objects (DESIGN.md §4) run as a Flower ``ServerApp`` and ``ClientApp``
(flwr 1.41 message API), in Flower's simulation runtime on one machine (:func:`run_flower`)
or on a SuperLink with one SuperNode per machine (``network/flower_app.py``, docs/FLOWER.md).

Server (:class:`FlowerEngine`): a :class:`~network.engine_sequential.SequentialEngine`
whose clients are remote. Sampling, per-client seeds, the algorithm's ``broadcast`` and
``aggregate``, the global test split, metrics names, ``checkpoint.pt``/``best.pt`` and
``--resume`` are the sequential engine's own code; what differs is how a round's client
results and client evaluations are obtained: one Flower message per sampled client, all
sent at once, replies folded into the streaming aggregate in the sampled order (so the
floating-point summation order, and with it the weights, match the sequential engine).

Nodes (:class:`NodeHost`): a node holds the data of one or more clients (a simulated node
hosts ``clients[partition-id::num-partitions]``; a real SuperNode the clients listed in
its ``partition-ids`` node config) and runs ``client_update`` for the client id a message
names. Client state (SCAFFOLD's c_i, FedRep's heads) never leaves the node: it is kept
on the node's disk, one file per (client, round) (:class:`NodeStateStore`), so it outlives
Flower's one-process-per-message ClientApps, and a resumed run reads the state of the
last checkpointed round.

Failures: a client that raises answers with a Flower ``Error`` naming its exception; the
server names the client. A round needs ``min_available_clients`` results (default: every
sampled client) — below that the run stops with :class:`ClientFailure` and keeps its last
checkpoint; above it the failed clients are logged by id and left out of that round's
aggregate. Evaluation and node discovery never drop a client: any error stops the run.

This module imports flwr and ray; the sequential path never imports it.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import os
import re
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, TypeVar

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid, ServerApp
from torch import nn

from network.aggregation import Weights
from network.algorithms.base import Algorithm, ClientConfig, ClientResult, LossFn, load_weights
from network.engine_sequential import (ClientData, EngineConfig, EvaluateFn, SequentialEngine, evaluate_model,
                                       evaluate_personal, train_client)
from network.sampling import client_seed, clients_per_round
from utils.device import pick_device, prepare_model
from utils.errors import TaskHetError
from utils.run_dir import atomic_torch_save, load_checkpoint

# ----- the message protocol: every name the ServerApp and the ClientApp share, defined once -----
WEIGHTS_RECORD = "weights"  # ArrayRecord: the broadcast (train) or the global weights (evaluate)
UPLOAD_RECORD = "upload"  # ArrayRecord: a client's upload
ORDERS_RECORD = "orders"  # ConfigRecord: what the server asks of a node (keys below)
REPLY_RECORD = "reply"  # ConfigRecord: a node's answer (client id, number of samples, hosted clients)
TRAIN_METRICS_RECORD = "train-metrics"  # MetricRecord: ClientResult.metrics
CLIENT_TEST_RECORD = "client-test"  # MetricRecord: the global model on the client's test samples
PERSONAL_TEST_RECORD = "client-test-personal"  # MetricRecord: the client's own model on them
RUN_KEY = "run-key"  # which run's client states a node reads and writes
ALGORITHM = "algorithm"  # the server's algorithm name (a node refuses a different one)
CLIENT_ID = "client-id"
ROUND = "round"
SEED = "seed"  # network.sampling.client_seed for (root seed, round, client)
LR = "lr"
LOCAL_STEPS = "local-steps"  # 0 = unset (a ConfigRecord holds no None)
LOCAL_EPOCHS = "local-epochs"  # 0 = unset
MOMENTUM = "momentum"
WEIGHT_DECAY = "weight-decay"
RESET_STATE = "reset-state"  # discovery on a fresh start: the node drops its states of this run
NUM_SAMPLES = "num-samples"
HOSTED_CLIENTS = "client-ids"
# Node config (flower-supernode --node-config); the simulation sets partition-id/num-partitions itself.
PARTITION_ID = "partition-id"
NUM_PARTITIONS = "num-partitions"
PARTITION_IDS = "partition-ids"  # a real node: comma-separated client ids whose data it holds
STATE_DIR = "state-dir"  # a real node: where it keeps client state

FLOWER_MODES = ("simulation",)
NODE_STATES_DIR = "node_states"  # simulation: the nodes' client states, under the run folder
POLL_INTERVAL_S = 0.05  # between pulls of replies from the SuperLink

Key = TypeVar("Key")
LOGGER = logging.getLogger(__name__)


class ClientFailure(TaskHetError):
    """A client (or node) failed and the run cannot go on; the message names it."""


# ----- transport -----
def to_record(weights: Weights) -> ArrayRecord:
    """Tensors as a Flower ArrayRecord (copied to the CPU; dtypes and shapes kept)."""
    return ArrayRecord.from_torch_state_dict(weights)


def from_record(record: ArrayRecord, device: torch.device) -> Weights:
    """An ArrayRecord back as tensors on ``device`` (bit-identical values)."""
    return {key: value.to(device) for key, value in record.to_torch_state_dict().items()}


# ----- server -----
class FlowerEngine(SequentialEngine):
    """The sequential engine's loop over clients that live on Flower nodes; see the module docstring.

    Args:
        grid: the ServerApp's Grid (simulation or SuperLink).
        model: the global model (evaluated on the server's ``test_loader``).
        algorithm: the algorithm object (its server half runs here, its client half on the nodes).
        client_ids: every client of the federation, in a fixed order (sampling draws from it).
        evaluate_fn, test_loader, config, device, model_config, logger: as for SequentialEngine.
        min_available_clients: results a round needs; None: every sampled client.
        reply_timeout_s: a client that has not answered this long after the round's messages
            went out counts as failed (None: wait for every reply).
        node_wait_s: how long to wait for nodes that host every client before giving up.
    """

    def __init__(self, grid: Grid, model: nn.Module, algorithm: Algorithm, client_ids: Iterable[str],
                 evaluate_fn: EvaluateFn, test_loader: Iterable[dict], config: EngineConfig, device: torch.device,
                 model_config: dict[str, Any] | None = None, logger: logging.Logger | None = None,
                 min_available_clients: int | None = None, reply_timeout_s: float | None = None,
                 node_wait_s: float = 120.0) -> None:
        clients = [ClientData(str(client_id), 0, _remote_loader) for client_id in client_ids]
        super().__init__(model, algorithm, clients, _remote_loss, evaluate_fn, test_loader, config, device,
                         model_config, logger)
        per_round = _check_min_available(min_available_clients, len(clients), config.client_fraction)
        self.grid, self.reply_timeout_s, self.node_wait_s = grid, reply_timeout_s, node_wait_s
        self.min_results = per_round if min_available_clients is None else min_available_clients
        fingerprint = json.dumps(self._fingerprint(), sort_keys=True, default=str)
        self.run_key = hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
        self.node_of: dict[str, int] = {}

    def _fingerprint(self) -> dict[str, Any]:
        # Client state lives on the nodes here, so a sequential checkpoint cannot resume (nor the reverse).
        return {**super()._fingerprint(), "engine": "flower"}

    def _start(self) -> int:
        resuming = self.config.resume and self.checkpoint_path.exists()
        self.node_of = self._discover(reset=not resuming)
        return super()._start()

    # ----- the two ways the sequential loop reaches its clients, here by messages -----
    def client_results(self, round_index: int, sampled: list[str], broadcast: Weights,
                       lr: float) -> Iterator[tuple[str, ClientResult]]:
        """One message per sampled client, all sent at once; the results in the sampled order.

        A failed client is left out while ``min_available_clients`` can still answer; below
        that the round stops with :class:`ClientFailure` naming every failed client.
        """
        record = to_record(broadcast)
        messages = {client_id: self._message(client_id, MessageType.TRAIN, round_index, record, lr)
                    for client_id in sampled}
        failed: dict[str, str] = {}
        for client_id, reply in self._exchange(messages):
            reason = _failure(reply, self.reply_timeout_s)
            if reason is None:
                content = reply.content
                yield client_id, ClientResult(from_record(content[UPLOAD_RECORD], self.device), {},
                                              _floats(content[TRAIN_METRICS_RECORD]),
                                              int(content[REPLY_RECORD][NUM_SAMPLES]))
                continue
            failed[client_id] = reason
            if len(sampled) - len(failed) < self.min_results:
                listing = "; ".join(f"client {name}: {why}" for name, why in failed.items())
                raise ClientFailure(f"round {round_index}: {listing}. {len(sampled) - len(failed)} of {len(sampled)} "
                                    f"sampled clients can still answer, fewer than --min_available_clients "
                                    f"{self.min_results}; {self._stop_message(round_index)}")
            self.logger.warning("round %d: client %s failed (%s); the round goes on without it "
                                "(--min_available_clients %d)", round_index, client_id, reason, self.min_results)

    def client_evaluations(self, round_index: int) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
        """Every client's test split on its node, with the global model and (personal keys) its own."""
        record = to_record(self.global_weights)
        messages = {client_id: self._message(client_id, MessageType.EVALUATE, round_index, record)
                    for client_id in self.clients}
        per_client, personal = {}, {}
        for client_id, reply in self._exchange(messages):
            content = self._content(reply, f"round {round_index}: evaluating client {client_id}")
            if CLIENT_TEST_RECORD in content:
                per_client[client_id] = _floats(content[CLIENT_TEST_RECORD])
            if PERSONAL_TEST_RECORD in content:
                personal[client_id] = _floats(content[PERSONAL_TEST_RECORD])
        return per_client, personal

    # ----- messaging -----
    def _message(self, client_id: str, kind: str, round_index: int, weights: ArrayRecord,
                 lr: float = 0.0) -> Message:
        orders = ConfigRecord({
            RUN_KEY: self.run_key, ALGORITHM: self.algorithm.name, CLIENT_ID: client_id, ROUND: round_index,
            SEED: client_seed(self.config.seed, round_index, client_id), LR: lr,
            LOCAL_STEPS: self.config.local_steps or 0, LOCAL_EPOCHS: self.config.local_epochs or 0,
            MOMENTUM: float(self.config.momentum), WEIGHT_DECAY: float(self.config.weight_decay)})
        return Message(RecordDict({WEIGHTS_RECORD: weights, ORDERS_RECORD: orders}),
                       dst_node_id=self.node_of[client_id], message_type=kind, group_id=str(round_index))

    def _exchange(self, messages: Mapping[Key, Message]) -> Iterator[tuple[Key, Message | None]]:
        """Send every message at once, then yield the replies in the order of ``messages``.

        A reply that arrives early waits in a buffer until its turn, so the caller folds
        results in a fixed order while the nodes work in parallel. None: no reply within
        ``reply_timeout_s``.
        """
        pushed = list(self.grid.push_messages(messages.values()))
        key_of = {message.metadata.message_id: key for key, message in messages.items()}
        if len(pushed) != len(messages):
            raise ClientFailure(f"the SuperLink accepted {len(pushed)} of {len(messages)} messages "
                                "(a destination node may have disconnected)")
        pending, replies = set(key_of), {}
        deadline = None if self.reply_timeout_s is None else time.monotonic() + self.reply_timeout_s
        for key in messages:
            while key not in replies and (deadline is None or time.monotonic() < deadline):
                for reply in self.grid.pull_messages(list(pending)):
                    pending.discard(reply.metadata.reply_to_message_id)
                    replies[key_of[reply.metadata.reply_to_message_id]] = reply
                if key not in replies:
                    time.sleep(POLL_INTERVAL_S)
            yield key, replies.pop(key, None)

    def _content(self, reply: Message | None, what: str) -> RecordDict:
        reason = _failure(reply, self.reply_timeout_s)
        if reason is not None:
            raise ClientFailure(f"{what} failed: {reason}; the run stopped")
        return reply.content

    def _discover(self, reset: bool) -> dict[str, int]:
        """Ask every node which clients it hosts (and, on a fresh start, to drop this run's old states)."""
        deadline = time.monotonic() + self.node_wait_s
        node_of: dict[str, int] = {}
        asked: set[int] = set()
        while True:
            new = [node for node in self.grid.get_node_ids() if node not in asked]
            asked.update(new)
            orders = ConfigRecord({RUN_KEY: self.run_key, ALGORITHM: self.algorithm.name, RESET_STATE: reset})
            queries = {node: Message(RecordDict({ORDERS_RECORD: orders}), dst_node_id=node,
                                     message_type=MessageType.QUERY) for node in new}
            for node, reply in self._exchange(queries):
                for client_id in self._content(reply, f"node {node} answering which clients it hosts")[
                        REPLY_RECORD][HOSTED_CLIENTS]:
                    if client_id not in self.clients:
                        raise TaskHetError(f"node {node} hosts client {client_id}, which is not in the assignments")
                    if client_id in node_of:
                        raise TaskHetError(f"client {client_id} is hosted by nodes {node_of[client_id]} and {node}; "
                                           f"give each node disjoint {PARTITION_IDS}")
                    node_of[client_id] = node
            missing = [client_id for client_id in self.clients if client_id not in node_of]
            if not missing:
                self.logger.info("%d clients on %d Flower nodes", len(node_of), len(set(node_of.values())))
                return node_of
            if time.monotonic() > deadline:
                raise TaskHetError(f"after {self.node_wait_s:g}s no connected node hosts client(s) "
                                   f"{', '.join(missing[:10])}{' …' if len(missing) > 10 else ''}; start a SuperNode "
                                   f"whose --node-config {PARTITION_IDS} lists them")
            time.sleep(POLL_INTERVAL_S)


def _failure(reply: Message | None, timeout_s: float | None) -> str | None:
    if reply is None:
        return f"no reply within {timeout_s:g}s"
    return reply.error.reason if reply.has_error() else None


def _floats(record: MetricRecord) -> dict[str, float]:
    return {key: float(value) for key, value in record.items()}


def _remote_loader(seed: int) -> Iterable[dict]:
    raise AssertionError("the Flower server never reads client data; its nodes do")


def _remote_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    raise AssertionError("the Flower server never trains; its nodes do")


def make_server_app(build_engine: Callable[[Grid, Context], FlowerEngine]) -> ServerApp:
    """A ServerApp whose main builds the engine for its Grid and runs it."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        build_engine(grid, context).run()

    return app


# ----- nodes -----
class NodeStateStore:
    """A node's client states on disk: ``<root>/client_<id>/round_<r>.pt``.

    Versions are kept by round so that a round redone after a kill reads the state from
    before it: ``latest(client, r - 1)`` ignores what an interrupted round r wrote.
    ``put`` keeps only that previous version and the new one.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def latest(self, client_id: str, up_to_round: int) -> Weights | None:
        """The newest state written in a round <= ``up_to_round``, or None."""
        rounds = [r for r in self._rounds(client_id) if r <= up_to_round]
        return load_checkpoint(self._path(client_id, max(rounds))) if rounds else None

    def put(self, client_id: str, round_index: int, state: Weights) -> None:
        """Write the state produced in ``round_index`` (atomically); drop versions no round will read."""
        older = [r for r in self._rounds(client_id) if r < round_index]
        if not state and not older:
            return  # a stateless algorithm leaves no files
        atomic_torch_save({key: value.detach().cpu() for key, value in state.items()},
                          self._path(client_id, round_index))
        keep = {round_index, max(older, default=round_index)}
        for r in self._rounds(client_id):
            if r not in keep:
                self._path(client_id, r).unlink()

    def clear(self, client_id: str) -> None:
        """Forget every state of the client."""
        for r in self._rounds(client_id):
            self._path(client_id, r).unlink()

    def _rounds(self, client_id: str) -> list[int]:
        folder = self.root / f"client_{client_id}"
        return sorted(int(match.group(1)) for path in folder.glob("round_*.pt")
                      if (match := re.fullmatch(r"round_(\d+)\.pt", path.name)))

    def _path(self, client_id: str, round_index: int) -> Path:
        return self.root / f"client_{client_id}" / f"round_{round_index}.pt"


@dataclass(frozen=True)
class NodeHost:
    """What one node needs to run the client half of an algorithm for the clients it hosts.

    Attributes:
        model: a worker model, reused for every client (its weights are overwritten each time).
        algorithm: the same algorithm (name and hyperparameters) as the server's.
        clients: client id -> ClientData for the clients whose data this node holds.
        loss_fn / evaluate_fn: as for the sequential engine.
        device: where the model lives.
        state_dir: the node's client states (one folder per run key).
    """

    model: nn.Module
    algorithm: Algorithm
    clients: Mapping[str, ClientData]
    loss_fn: LossFn
    evaluate_fn: EvaluateFn
    device: torch.device
    state_dir: Path

    def store(self, orders: ConfigRecord) -> NodeStateStore:
        """This run's state store on the node."""
        return NodeStateStore(self.state_dir / str(orders[RUN_KEY]))

    def client(self, orders: ConfigRecord) -> ClientData:
        """The client a message names (refused if this node does not host it or runs another algorithm)."""
        if orders[ALGORITHM] != self.algorithm.name:
            raise TaskHetError(f"the server runs {orders[ALGORITHM]}, this node {self.algorithm.name}")
        client_id = str(orders[CLIENT_ID])
        if client_id not in self.clients:
            raise TaskHetError(f"this node does not host client {client_id}")
        return self.clients[client_id]

    def train(self, orders: ConfigRecord, broadcast: Weights) -> ClientResult:
        """``client_update`` for one client and round, seeded as in the sequential engine; saves its state."""
        client, round_index = self.client(orders), int(orders[ROUND])
        missing = [key for key in self.model.state_dict() if key not in broadcast]
        if missing:
            raise TaskHetError(f"the server's model is not this node's: it sends no {', '.join(missing[:5])}"
                               f"{' …' if len(missing) > 5 else ''} (check --encoder and the checkpoint)")
        store = self.store(orders)
        cfg = ClientConfig(lr=float(orders[LR]), loss_fn=self.loss_fn, device=self.device,
                           num_samples=client.num_samples, local_steps=int(orders[LOCAL_STEPS]) or None,
                           local_epochs=int(orders[LOCAL_EPOCHS]) or None, momentum=float(orders[MOMENTUM]),
                           weight_decay=float(orders[WEIGHT_DECAY]))
        result = train_client(self.algorithm, self.model, broadcast, store.latest(client.client_id, round_index - 1),
                              client, int(orders[SEED]), cfg)
        store.put(client.client_id, round_index, result.client_state)
        return result

    def evaluate(self, orders: ConfigRecord, global_weights: Weights) -> dict[str, dict[str, float]]:
        """The global model (and, with personal keys, the client's own) on the client's test samples.

        Returns:
            ``{CLIENT_TEST_RECORD: metrics, PERSONAL_TEST_RECORD: metrics}``; empty without test samples.
        """
        client = self.client(orders)
        if client.test_loader is None:
            return {}
        load_weights(self.model, global_weights)
        metrics = {CLIENT_TEST_RECORD: evaluate_model(self.model, self.evaluate_fn, client.test_loader)}
        if self.algorithm.personal_keys(self.model):
            state = self.store(orders).latest(client.client_id, int(orders[ROUND]))
            metrics[PERSONAL_TEST_RECORD] = evaluate_personal(self.algorithm, self.model, self.evaluate_fn,
                                                              global_weights, state, client.test_loader)
        return metrics

    def hosted(self, orders: ConfigRecord) -> list[str]:
        """The hosted client ids; on a fresh start (``RESET_STATE``) their old states of this run are dropped."""
        if bool(orders[RESET_STATE]):
            store = self.store(orders)
            for client_id in self.clients:
                store.clear(client_id)
        return list(self.clients)

def make_client_app(host_for: Callable[[Context], NodeHost]) -> ClientApp:
    """A ClientApp answering the engine's train, evaluate and query messages with ``host_for(context)``.

    An exception becomes a Flower ``Error`` reply whose reason names the client and the
    exception (the traceback goes to the node's log), so the server can report it by id.
    """
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        def work(host: NodeHost, orders: ConfigRecord) -> RecordDict:
            result = host.train(orders, from_record(message.content[WEIGHTS_RECORD], host.device))
            return RecordDict({UPLOAD_RECORD: to_record(result.upload),
                               TRAIN_METRICS_RECORD: MetricRecord(dict(result.metrics)),
                               REPLY_RECORD: ConfigRecord({CLIENT_ID: str(orders[CLIENT_ID]),
                                                           NUM_SAMPLES: int(result.num_samples)})})
        return _answer(message, context, host_for, work)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        def work(host: NodeHost, orders: ConfigRecord) -> RecordDict:
            metrics = host.evaluate(orders, from_record(message.content[WEIGHTS_RECORD], host.device))
            return RecordDict({name: MetricRecord(values) for name, values in metrics.items()})
        return _answer(message, context, host_for, work)

    @app.query()
    def query(message: Message, context: Context) -> Message:
        def work(host: NodeHost, orders: ConfigRecord) -> RecordDict:
            return RecordDict({REPLY_RECORD: ConfigRecord({HOSTED_CLIENTS: host.hosted(orders)})})
        return _answer(message, context, host_for, work)

    return app


def _answer(message: Message, context: Context, host_for: Callable[[Context], NodeHost],
            work: Callable[[NodeHost, ConfigRecord], RecordDict]) -> Message:
    orders = message.content[ORDERS_RECORD]
    try:
        return Message(work(host_for(context), orders), reply_to=message)
    except Exception as error:  # every failure goes back to the server, named; none is swallowed
        who = f"client {orders[CLIENT_ID]}" if CLIENT_ID in orders else f"node {context.node_id}"
        LOGGER.exception("%s failed on %s", who, message.metadata.message_type)
        reason = f"{type(error).__name__}: {error}"
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=message)


# ----- the simulation runtime on this machine -----
@dataclass(frozen=True)
class FlowerOptions:
    """Flower settings of test_fed.py (``--flower_*``, ``--min_available_clients``).

    Attributes:
        mode: "simulation" (Flower's simulation runtime here); a real deployment runs
            network/flower_app.py with ``flwr run`` (docs/FLOWER.md).
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
        host = _recipe_host(self.recipe)
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
               options: FlowerOptions | None = None) -> FlowerEngine:
    """Run (or resume) the federated training in Flower's simulation runtime on this machine.

    Takes the sequential engine's arguments plus ``options`` and writes the same run folder
    (metrics.csv, checkpoint.pt, best.pt, curves.png) plus ``node_states/`` (the nodes' client
    states). ``evaluate_fn`` runs on the nodes too, so it must use the model's own device.

    Returns:
        The finished server engine (``global_weights``, ``best_loss``, …).
    """
    options = options or FlowerOptions()
    _check_options(options, device, len(clients))
    _check_min_available(options.min_available_clients, len(clients), config.client_fraction)
    ids = [str(client.client_id) for client in clients]
    num_nodes = options.num_nodes or len(clients)
    engines: list[FlowerEngine] = []

    def build_engine(grid: Grid, context: Context) -> FlowerEngine:
        engines.append(FlowerEngine(grid, model, algorithm, ids, evaluate_fn, test_loader, config, device,
                                    model_config, logger, options.min_available_clients, options.reply_timeout_s,
                                    options.node_wait_s))
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
        run_simulation(make_server_app(build_engine), client_app, num_supernodes=num_nodes,
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
        ray.init(include_dashboard=False, logging_level=logging.WARNING)
    finally:
        if previous is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = previous


def _check_min_available(min_available_clients: int | None, num_clients: int, client_fraction: float) -> int:
    """The clients sampled per round, after checking that ``min_available_clients`` fits in it."""
    per_round = clients_per_round(num_clients, client_fraction)
    if min_available_clients is not None and not 1 <= min_available_clients <= per_round:
        raise TaskHetError(f"--min_available_clients must be between 1 and the {per_round} clients sampled "
                           f"per round, got {min_available_clients}")
    return per_round


def _check_options(options: FlowerOptions, device: torch.device, num_clients: int) -> None:
    if options.mode not in FLOWER_MODES:
        raise TaskHetError(f"--flower_mode must be one of {', '.join(FLOWER_MODES)} (a real deployment runs "
                           f"network/flower_app.py with `flwr run`, see docs/FLOWER.md), got {options.mode!r}")
    cores = os.cpu_count() or 1
    if not 0 < options.num_cpus <= cores:
        raise TaskHetError(f"--flower_num_cpus must be in (0, {cores}] (this machine's cores), got {options.num_cpus}")
    if options.num_gpus < 0 or (options.num_gpus > 0 and not torch.cuda.is_available()):
        raise TaskHetError(f"--flower_num_gpus {options.num_gpus}: must be >= 0, and > 0 needs a CUDA GPU")
    if options.num_nodes is not None and not 1 <= options.num_nodes <= num_clients:
        raise TaskHetError(f"the number of simulated nodes must be in 1..{num_clients}, got {options.num_nodes}")
