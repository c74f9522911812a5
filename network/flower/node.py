"""The Flower nodes: the client half of an algorithm for the clients whose data a node holds.

A node (:class:`NodeHost`) holds the data of one or more clients (a simulated node hosts
``clients[partition-id::num-partitions]``; a real SuperNode the clients listed in its
``partition-ids`` node config) and answers the server's messages for the client a
message names, through the very functions the sequential engine calls
(``network.client.train_client`` and ``evaluate_client``), with the seeds the server sends.

Client state (SCAFFOLD's c_i, FedRep's heads) never leaves the node: it is kept on the
node's disk, one file per (client, round) (:class:`NodeStateStore`), so it outlives
Flower's one-process-per-message ClientApps, and a resumed run reads the state of the
last checkpointed round.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch
from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from torch import nn

from network.aggregation import Weights
from network.algorithms.base import Algorithm, Bundle, ClientConfig, ClientResult, LossFn, load_weights
from network.client import ClientData, EvaluateFn, evaluate_client, train_client
from network.diagnostics import client_gradient
from network.schedule import client_at, diagnosed_round, evaluation_view
from network.flower import protocol as P
from utils.errors import TaskHetError
from utils.run_dir import atomic_torch_save, load_checkpoint

LOGGER = logging.getLogger(__name__)


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
        algorithm: the same algorithm (name and settings) as the server's.
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
        return NodeStateStore(self.state_dir / str(orders[P.RUN_KEY]))

    def client(self, orders: ConfigRecord) -> ClientData:
        """The client a message names (refused if this node does not host it or runs another algorithm)."""
        if orders[P.ALGORITHM] != self.algorithm.name:
            raise TaskHetError(f"the server runs {orders[P.ALGORITHM]}, this node {self.algorithm.name}")
        client_id = str(orders[P.CLIENT_ID])
        if client_id not in self.clients:
            raise TaskHetError(f"this node does not host client {client_id}")
        return self.clients[client_id]

    def train(self, orders: ConfigRecord, broadcast: Bundle) -> ClientResult:
        """``train_client`` for one client and round, with the server's seed; saves the client's new state."""
        round_index = int(orders[P.ROUND])
        client = client_at(self.client(orders), round_index)  # the rows its schedule holds now (temporal skew)
        store = self.store(orders)
        cfg = ClientConfig(loss_fn=self.loss_fn, device=self.device, num_samples=client.num_samples,
                           **P.read_local_training(orders))
        result = train_client(self.algorithm, self.model, broadcast, store.latest(client.client_id, round_index - 1),
                              client, int(orders[P.SEED]), cfg)
        store.put(client.client_id, round_index, result.client_state)
        return result

    def evaluate(self, orders: ConfigRecord, models: dict[str, Weights]) -> dict[str, dict[str, float]]:
        """``evaluate_client`` for one client with the server's models and its state on this node.

        Returns:
            split -> metric -> value (see ``network.client.evaluate_client``); empty without test samples.
        """
        client = evaluation_view(self.client(orders), int(orders[P.ROUND]))
        finetune, seed = P.read_finetuning(orders)
        state = self.store(orders).latest(client.client_id, int(orders[P.ROUND]))
        return evaluate_client(self.algorithm, self.model, self.evaluate_fn, models,
                               models[str(orders[P.GLOBAL_MODEL_NAME])], state, client, self.loss_fn, self.device,
                               finetune, seed)

    def gradient(self, orders: ConfigRecord, global_weights: Weights) -> torch.Tensor:
        """One client's ∇F_k at the global model (``--diagnostics``), exactly as the sequential engine takes it."""
        # temporal skew: F_k over the rows the client holds in the diagnosed round
        client = client_at(self.client(orders), diagnosed_round(int(orders[P.ROUND])))
        load_weights(self.model, global_weights)
        return client_gradient(self.model, client, self.loss_fn, self.device, int(orders[P.GRADIENT_SEED]),
                               int(orders[P.GRADIENT_MAX_SAMPLES]) or None, self.algorithm.private_keys())

    def hosted(self, orders: ConfigRecord) -> list[str]:
        """The hosted client ids; on a fresh start (``RESET_STATE``) their old states of this run are dropped."""
        if bool(orders[P.RESET_STATE]):
            store = self.store(orders)
            for client_id in self.clients:
                store.clear(client_id)
        return list(self.clients)


def make_client_app(host_for: Callable[[Context], NodeHost]) -> ClientApp:
    """A ClientApp answering the engine's train, evaluate and query messages with ``host_for(context)``.

    An exception becomes a Flower ``Error`` reply whose reason names the exception (the
    traceback goes to the node's log), so the server can report it with the client's id.
    """
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        return _answer(message, context, host_for, _train)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        return _answer(message, context, host_for, _evaluate)

    @app.query()
    def query(message: Message, context: Context) -> Message:
        return _answer(message, context, host_for, _query)

    return app


def _train(host: NodeHost, content: RecordDict, orders: ConfigRecord) -> RecordDict:
    broadcast = P.read_bundle(content, P.BROADCAST_PREFIX, list(orders[P.BUNDLE_GROUPS]), host.device)
    result = host.train(orders, broadcast)
    records, groups = P.bundle_records(P.UPLOAD_PREFIX, result.upload)
    reply = ConfigRecord({P.CLIENT_ID: str(orders[P.CLIENT_ID]), P.NUM_SAMPLES: int(result.num_samples),
                          P.BUNDLE_GROUPS: groups})
    return RecordDict({**records, P.TRAIN_METRICS_RECORD: MetricRecord(dict(result.metrics)), P.REPLY_RECORD: reply})


def _evaluate(host: NodeHost, content: RecordDict, orders: ConfigRecord) -> RecordDict:
    models = P.read_bundle(content, P.MODEL_PREFIX, list(orders[P.MODEL_NAMES]), host.device)
    if P.GRADIENT_SEED in orders:
        gradient = host.gradient(orders, models[str(orders[P.GLOBAL_MODEL_NAME])])
        return RecordDict({P.GRADIENT_RECORD: P.to_record({P.GRADIENT_RECORD: gradient})})
    return RecordDict(P.split_records(host.evaluate(orders, models)))


def _query(host: NodeHost, content: RecordDict, orders: ConfigRecord) -> RecordDict:
    return RecordDict({P.REPLY_RECORD: ConfigRecord({P.HOSTED_CLIENTS: host.hosted(orders)})})


def _answer(message: Message, context: Context, host_for: Callable[[Context], NodeHost],
            work: Callable[[NodeHost, RecordDict, ConfigRecord], RecordDict]) -> Message:
    orders = message.content[P.ORDERS_RECORD]
    try:
        return Message(work(host_for(context), message.content, orders), reply_to=message)
    except Exception as error:  # every failure goes back to the server, named; none is swallowed
        who = f"client {orders[P.CLIENT_ID]}" if P.CLIENT_ID in orders else f"node {context.node_id}"
        LOGGER.exception("%s failed on %s", who, message.metadata.message_type)
        reason = f"{type(error).__name__}: {error}"
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=message)
