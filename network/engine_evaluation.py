"""The evaluation side of the sequential engine (network/engine_sequential.py), which it inherits from
:class:`RoundEvaluation`: which rounds evaluate, the server models on the global test and validation splits, every
client's splits with evaluation-time fine-tuning, the unseen clients after their own adaptation, and the gradient
diagnostics (G², B²) at the global model.

The engine provides what these methods read: ``algorithm``, ``server``, ``global_weights``, ``model``,
``evaluate_fn``, ``loss_fn``, ``test_loader``, ``val_loader``, ``clients``, ``unseen``, ``store``, ``config``,
``device``, ``logger``, ``private_params``, ``shares_parameters``, ``client_config`` and ``_stop_message``. The
Flower engine inherits them too (it changes how clients train, not how a round is evaluated).
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import torch

from network.algorithms.base import load_weights
from network.client import (CLIENT_TEST_SPLIT, GLOBAL_TEST_SPLIT, PERSONAL_TEST_SPLIT, UNSEEN_PERSONAL_SPLIT,
                            UNSEEN_SPLITS, UNSEEN_TEST_SPLIT, ClientFailure, Finetune, adaptation_seed,
                            evaluate_client, evaluate_model, evaluate_unseen_client, finetune_seed)
from network.diagnostics import ALL_CLIENTS, client_gradient, gradient_rows, gradient_seed
from network.run_outputs import (CLIENT_SPLITS, GLOBAL_CLIENT, GLOBAL_VAL_SPLIT, MODEL_CLIENT_PREFIX, ROUND_LINE,
                                 SKIPPED_CLIENT, client_rows, metric_row)
from network.schedule import client_at, diagnosed_round, evaluation_view, train_sizes_at


class RoundEvaluation:
    """What an evaluation round and a diagnostics round add to metrics.csv (see the module docstring)."""

    def _evaluates(self, round_index: int) -> bool:
        return round_index % self.config.eval_every == 0 or round_index == self.config.n_rounds

    def diagnose(self, round_index: int) -> list[dict[str, Any]]:
        """G², B² and every client's ‖∇F_k‖² at the global model on a diagnostics round (network.diagnostics)."""
        if not self.config.diagnostics or round_index % self.config.diagnostics_every or not self.shares_parameters:
            return []
        began = time.perf_counter()
        held_in = diagnosed_round(round_index)  # temporal skew: F_k over the rows a client holds then
        rows = gradient_rows(round_index, self.client_gradients(round_index), self.train_sizes(held_in))
        reading = {row["metric"]: row["value"] for row in rows if row["client"] == ALL_CLIENTS}
        if reading:
            self.logger.info("round %d: G² %.4g, B² %.4g at the global model over %d clients (%.1fs)", round_index,
                             reading["g2"], reading["b2"], len(rows) - len(reading), time.perf_counter() - began,
                             extra={ROUND_LINE: True})
        return rows

    def evaluate(self, round_index: int) -> tuple[list[dict[str, Any]], float]:
        """Server models on the global test split, the global model on the validation rows (if any), then every
        client's splits (network.client.evaluate_client).

        Returns:
            The metric rows and the global model's test loss.
        """
        models = self.algorithm.evaluated_models(self.server)
        rows, global_loss = [], None
        for index, (name, weights) in enumerate(models.items()):
            load_weights(self.model, weights)
            test = evaluate_model(self.model, self.evaluate_fn, self.test_loader)
            owners = ([GLOBAL_CLIENT] if index == 0 else []) + ([MODEL_CLIENT_PREFIX + name] if len(models) > 1 else [])
            rows += [metric_row(round_index, GLOBAL_TEST_SPLIT, owner, metric, value)
                     for owner in owners for metric, value in test.items()]
            if index == 0 and self.val_loader is not None:
                rows += [metric_row(round_index, GLOBAL_VAL_SPLIT, GLOBAL_CLIENT, metric, value)
                         for metric, value in evaluate_model(self.model, self.evaluate_fn, self.val_loader).items()]
            global_loss = float(test["loss"]) if index == 0 else global_loss
        per_split = self.client_evaluations(round_index)
        for split in CLIENT_SPLITS:
            rows += client_rows(round_index, split, per_split.get(split, {}))
        if self.algorithm.personalized:
            # Every client with test samples has a client_test row: an engine whose clients are remote counts them so.
            skipped = len(per_split.get(CLIENT_TEST_SPLIT, {})) - len(per_split.get(PERSONAL_TEST_SPLIT, {}))
            rows.append(metric_row(round_index, PERSONAL_TEST_SPLIT, SKIPPED_CLIENT, "clients", skipped))
        if self.unseen:  # after every other row: without unseen clients metrics.csv is what it was
            rows += self.unseen_rows(round_index)
        return rows, global_loss

    def unseen_rows(self, round_index: int) -> list[dict[str, Any]]:
        """The unseen clients' splits (per client, plus the summary rows of every client split) and, for a
        personalised algorithm, their ``skipped`` count: unseen clients with test rows but no personal model."""
        per_split = self.unseen_evaluations(round_index)
        rows = [row for split in UNSEEN_SPLITS for row in client_rows(round_index, split, per_split.get(split, {}))]
        if self.algorithm.personalized:
            skipped = len(per_split.get(UNSEEN_TEST_SPLIT, {})) - len(per_split.get(UNSEEN_PERSONAL_SPLIT, {}))
            rows.append(metric_row(round_index, UNSEEN_PERSONAL_SPLIT, SKIPPED_CLIENT, "clients", skipped))
        return rows

    def unseen_evaluations(self, round_index: int) -> dict[str, dict[str, dict[str, float]]]:
        """split -> unseen client id -> metrics (network.client.evaluate_unseen_client), in id order.

        Each unseen client adapts from the current server state's broadcast, with the round's local learning rate
        (the rate round ``round_index`` trained at; round 0, before any training, takes round 1's) and the run's
        local budget, under its own seeds; nothing it trains is kept (the server state and the client
        store are never written), so the next round trains exactly as it would without unseen clients.
        """
        broadcast = self.algorithm.broadcast(self.server)
        lr = float(self.config.lr_schedule(max(round_index, 1)))
        per_split: dict[str, dict[str, dict[str, float]]] = {}
        for client_id, client in self.unseen.items():
            view = evaluation_view(client, round_index)
            try:
                splits = evaluate_unseen_client(
                    self.algorithm, self.model, self.evaluate_fn, self.server.models, self.global_weights, broadcast,
                    view, self.loss_fn, self.device, self.finetune(round_index), self.client_config(lr, view.num_samples),
                    (adaptation_seed(self.config.seed, round_index, client_id),
                     finetune_seed(self.config.seed, round_index, client_id)))
            except Exception as error:  # a failure names the unseen client
                raise ClientFailure(f"round {round_index}, unseen client {client_id} failed: {type(error).__name__}: "
                                    f"{error}; {self._stop_message()}") from error
            for split, metrics in splits.items():
                per_split.setdefault(split, {})[client_id] = metrics
        return per_split

    def train_sizes(self, round_index: int) -> dict[str, int]:
        """Each client's number of train rows in ``round_index`` (a temporal schedule's rows held then)."""
        return train_sizes_at(self.clients, self.algorithm.federation.client_sizes, round_index)

    def client_gradients(self, round_index: int) -> Iterator[tuple[str, torch.Tensor]]:
        """``(client_id, ∇F_k)`` at the global model for every client with train rows (under temporal skew: those it
        holds in ``diagnosed_round(round_index)``, over those rows), in the engine's client order."""
        load_weights(self.model, self.global_weights)
        held_in = diagnosed_round(round_index)
        sizes = self.train_sizes(held_in)
        for client_id, client in self.clients.items():
            if sizes[client_id]:
                yield client_id, client_gradient(self.model, client_at(client, held_in), self.loss_fn, self.device,
                                                 gradient_seed(self.config.seed, client_id),
                                                 self.config.diagnostics_max_samples, self.private_params)

    def client_evaluations(self, round_index: int) -> dict[str, dict[str, dict[str, float]]]:
        """split -> client id -> metrics, for every client with test samples (in the engine's client order)."""
        per_split: dict[str, dict[str, dict[str, float]]] = {}
        for client_id, client in self.clients.items():
            splits = evaluate_client(self.algorithm, self.model, self.evaluate_fn, self.server.models,
                                     self.global_weights, self.store.get(client_id),
                                     evaluation_view(client, round_index), self.loss_fn,
                                     self.device, self.finetune(round_index), finetune_seed(self.config.seed,
                                                                                            round_index, client_id))
            for split, metrics in splits.items():
                per_split.setdefault(split, {})[client_id] = metrics
        return per_split

    def finetune(self, round_index: int) -> Finetune:
        """Evaluation-time fine-tuning with this round's local learning rate."""
        return Finetune(self.config.finetune_steps, float(self.config.lr_schedule(max(round_index, 1))),
                        self.config.momentum, self.config.weight_decay)
