"""The Flower server: the sequential engine's round loop, with the clients behind Flower messages.

:class:`FlowerEngine` is a :class:`~network.engine_sequential.SequentialEngine` whose
clients are remote. Sampling, per-client seeds, the algorithm's ``broadcast`` and
``aggregate``, the global test split, metrics names, ``checkpoint.pt``/``best.pt`` and
``--resume`` are the sequential engine's own code; what differs is how a round's client
results, client evaluations and (``--diagnostics``) client gradients are obtained (the
three methods overridden here): one Flower message per client, all sent at once, replies
taken in the engine's order (the sampled order for training, so the floating-point
summation order, and with it the weights, match the sequential engine). Records and keys: :mod:`network.flower.protocol`.

Failures: a client that raises answers with a Flower ``Error`` naming its exception; the
server names the client. A round needs ``min_available_clients`` results (default: every
sampled client): below that the run stops with :class:`~network.client.ClientFailure` and
keeps its last checkpoint; above it the failed clients are logged by id and left out of
that round's aggregate. Evaluation and node discovery never drop a client: any error stops the run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any, Callable, Iterable, Iterator, Mapping, TypeVar

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp
from torch import nn

from network.aggregation import Weights
from network.algorithms.base import Algorithm, ClientResult
from network.client import ClientData, ClientFailure, EvaluateFn, finetune_seed
from network.diagnostics import gradient_seed
from network.engine_config import EngineConfig
from network.engine_sequential import SequentialEngine
from network.flower import protocol as P
from network.sampling import client_seed, clients_per_round
from network.schedule import ClientSchedule, diagnosed_round
from utils.errors import TaskHetError

POLL_INTERVAL_S = 0.05  # between pulls of replies from the SuperLink

Key = TypeVar("Key")


class FlowerEngine(SequentialEngine):
    """The sequential engine's loop over clients that live on Flower nodes; see the module docstring.

    Args:
        grid: the ServerApp's Grid (simulation or SuperLink).
        model: the worker model (the server evaluates the global test split with it).
        algorithm: the algorithm object (its server half runs here, its client half on the nodes).
        client_ids: every client of the federation, in a fixed order (sampling draws from it).
        evaluate_fn, test_loader, config, device, model_config, logger: as for SequentialEngine.
        min_available_clients: results a round needs; None: every sampled client.
        reply_timeout_s: a client that has not answered this long after the round's messages
            went out counts as failed (None: wait for every reply).
        node_wait_s: how long to wait for nodes that host every client before giving up.
        val_loader: the manifest's validation rows, evaluated on the server as the sequential engine does
            (split ``val``), or None.
        schedules: client id -> its counting-only ``network.schedule.ClientSchedule`` (temporal skew), or None.
    """

    def __init__(self, grid: Grid, model: nn.Module, algorithm: Algorithm, client_ids: Iterable[str],
                 evaluate_fn: EvaluateFn, test_loader: Iterable[dict], config: EngineConfig, device: torch.device,
                 model_config: dict[str, Any] | None = None, logger: logging.Logger | None = None,
                 min_available_clients: int | None = None, reply_timeout_s: float | None = None,
                 node_wait_s: float = 120.0, val_loader: Iterable[dict] | None = None,
                 schedules: Mapping[str, ClientSchedule] | None = None) -> None:
        # With temporal skew the server samples among the clients holding rows in a round: it needs their windows.
        clients = [ClientData(str(client_id), 0, _remote_loader, schedule=(schedules or {}).get(str(client_id)))
                   for client_id in client_ids]
        super().__init__(model, algorithm, clients, _remote_loss, evaluate_fn, test_loader, config, device,
                         model_config, logger, val_loader=val_loader)
        per_round = check_min_available(min_available_clients, len(clients), config.client_fraction)
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
    def client_results(self, round_index: int, sampled: list[str], broadcast: dict[str, Weights],
                       lr: float) -> Iterator[tuple[str, ClientResult]]:
        """One train message per sampled client, all sent at once; the results in the sampled order.

        A failed client is left out while ``min_available_clients`` can still answer; below
        that the round stops with :class:`ClientFailure` naming every failed client.
        """
        shared = P.bundle_records(P.BROADCAST_PREFIX, broadcast)
        messages = {}
        for client_id in sampled:  # the algorithm may tailor each client's message (Algorithm.client_broadcast)
            tailored = self.algorithm.client_broadcast(self.server, broadcast, client_id)
            records, groups = shared if tailored is broadcast else P.bundle_records(P.BROADCAST_PREFIX, tailored)
            messages[client_id] = self._message(client_id, MessageType.TRAIN, round_index, records,
                                                {**self._local_training(lr, client_id), P.BUNDLE_GROUPS: groups,
                                                 P.SEED: client_seed(self.config.seed, round_index, client_id)})
        failed: dict[str, str] = {}
        for client_id, reply in self._exchange(messages):
            reason = _failure(reply, self.reply_timeout_s)
            if reason is None:
                yield client_id, self._result(reply.content)
                continue
            failed[client_id] = reason
            if len(sampled) - len(failed) < self.min_results:
                listing = "; ".join(f"client {name}: {why}" for name, why in failed.items())
                raise ClientFailure(f"round {round_index}: {listing}. {len(sampled) - len(failed)} of {len(sampled)} "
                                    f"sampled clients can still answer, fewer than --min_available_clients "
                                    f"{self.min_results}; {self._stop_message()}")
            self.logger.warning("round %d: client %s failed (%s); the round goes on without it "
                                "(--min_available_clients %d)", round_index, client_id, reason, self.min_results)

    def _local_training(self, lr: float, client_id: str) -> dict[str, Any]:
        """One client's local-training orders (its own steps under unequal local work)."""
        return P.local_training(lr, self.config.local_steps_of(client_id), self.config.local_epochs,
                                self.config.momentum, self.config.weight_decay)

    def client_evaluations(self, round_index: int) -> dict[str, dict[str, dict[str, float]]]:
        """Every client's splits, computed on its node by ``network.client.evaluate_client``.

        Returns:
            split -> client id -> metrics, clients in the engine's order.
        """
        global_name = self._global_model_name()
        records, names = P.bundle_records(P.MODEL_PREFIX, self.server.models)
        finetune = self.finetune(round_index)
        messages = {client_id: self._message(client_id, MessageType.EVALUATE, round_index, records, {
                        P.MODEL_NAMES: names, P.GLOBAL_MODEL_NAME: global_name,
                        **P.finetuning(finetune, finetune_seed(self.config.seed, round_index, client_id))})
                    for client_id in self.clients}
        per_split: dict[str, dict[str, dict[str, float]]] = {}
        for client_id, reply in self._exchange(messages):
            content = self._content(reply, f"round {round_index}: evaluating client {client_id}")
            for split, metrics in P.read_splits(content).items():
                per_split.setdefault(split, {})[client_id] = metrics
        return per_split

    def client_gradients(self, round_index: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Every client's ∇F_k at the global model (``--diagnostics``), computed on its node; in the engine's order."""
        global_name = self._global_model_name()
        records, names = P.bundle_records(P.MODEL_PREFIX, {global_name: self.server.models[global_name]})
        sizes = self.train_sizes(diagnosed_round(round_index))
        messages = {client_id: self._message(client_id, MessageType.EVALUATE, round_index, records, {
                        P.MODEL_NAMES: names, P.GLOBAL_MODEL_NAME: global_name,
                        P.GRADIENT_SEED: gradient_seed(self.config.seed, client_id),
                        P.GRADIENT_MAX_SAMPLES: self.config.diagnostics_max_samples or 0})
                    for client_id in self.clients if sizes[client_id]}
        for client_id, reply in self._exchange(messages):
            content = self._content(reply, f"round {round_index}: the gradient of client {client_id}")
            yield client_id, P.from_record(content[P.GRADIENT_RECORD], self.device)[P.GRADIENT_RECORD]

    # ----- messaging -----
    def _result(self, content: RecordDict) -> ClientResult:
        reply = content[P.REPLY_RECORD]
        upload = P.read_bundle(content, P.UPLOAD_PREFIX, list(reply[P.BUNDLE_GROUPS]), self.device)
        return ClientResult(upload, {}, P.floats(content[P.TRAIN_METRICS_RECORD]), int(reply[P.NUM_SAMPLES]))

    def _global_model_name(self) -> str:
        """The name, among the server models, of the global model (the first evaluated model)."""
        name, weights = next(iter(self.algorithm.evaluated_models(self.server).items()))
        if self.server.models.get(name) is not weights:
            raise TaskHetError(f"{self.algorithm.name}'s global model {name!r} is not one of its server models "
                               f"{list(self.server.models)}; the Flower engine sends server models by name")
        return name

    def _message(self, client_id: str, kind: str, round_index: int, records: Mapping[str, ArrayRecord],
                 orders: Mapping[str, Any]) -> Message:
        orders = ConfigRecord({P.RUN_KEY: self.run_key, P.ALGORITHM: self.algorithm.name, P.CLIENT_ID: client_id,
                               P.ROUND: round_index, **orders})
        return Message(RecordDict({**records, P.ORDERS_RECORD: orders}), dst_node_id=self.node_of[client_id],
                       message_type=kind, group_id=str(round_index))

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
            orders = ConfigRecord({P.RUN_KEY: self.run_key, P.ALGORITHM: self.algorithm.name, P.RESET_STATE: reset})
            queries = {node: Message(RecordDict({P.ORDERS_RECORD: orders}), dst_node_id=node,
                                     message_type=MessageType.QUERY) for node in new}
            for node, reply in self._exchange(queries):
                hosted = self._content(reply, f"node {node} answering which clients it hosts")[P.REPLY_RECORD]
                for client_id in hosted[P.HOSTED_CLIENTS]:
                    self._check_host(node_of, str(client_id), node)
                    node_of[str(client_id)] = node
            missing = [client_id for client_id in self.clients if client_id not in node_of]
            if not missing:
                self.logger.info("%d clients on %d Flower nodes", len(node_of), len(set(node_of.values())))
                return node_of
            if time.monotonic() > deadline:
                raise TaskHetError(f"after {self.node_wait_s:g}s no connected node hosts client(s) "
                                   f"{', '.join(missing[:10])}{' …' if len(missing) > 10 else ''}; start a SuperNode "
                                   f"whose --node-config {P.PARTITION_IDS} lists them")
            time.sleep(POLL_INTERVAL_S)

    def _check_host(self, node_of: dict[str, int], client_id: str, node: int) -> None:
        if client_id not in self.clients:
            raise TaskHetError(f"node {node} hosts client {client_id}, which is not in the assignments")
        if client_id in node_of:
            raise TaskHetError(f"client {client_id} is hosted by nodes {node_of[client_id]} and {node}; "
                               f"give each node disjoint {P.PARTITION_IDS}")


def check_min_available(min_available_clients: int | None, num_clients: int, client_fraction: float) -> int:
    """The clients sampled per round, after checking that ``min_available_clients`` fits in it."""
    per_round = clients_per_round(num_clients, client_fraction)
    if min_available_clients is not None and not 1 <= min_available_clients <= per_round:
        raise TaskHetError(f"--min_available_clients must be between 1 and the {per_round} clients sampled "
                           f"per round, got {min_available_clients}")
    return per_round


def make_server_app(build_engine: Callable[[Grid, Context], FlowerEngine]) -> ServerApp:
    """A ServerApp whose main builds the engine for its Grid and runs it."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        build_engine(grid, context).run()

    return app


def _failure(reply: Message | None, timeout_s: float | None) -> str | None:
    if reply is None:
        return f"no reply within {timeout_s:g}s"
    return reply.error.reason if reply.has_error() else None


def _remote_loader(seed: int) -> Iterable[dict]:
    raise AssertionError("the Flower server never reads client data; its nodes do")


def _remote_loss(model: nn.Module, batch: dict, reduction: str = "mean") -> torch.Tensor:
    raise AssertionError("the Flower server never trains; its nodes do")
