"""The sequential engine: every client of a round trained in turn on one reused worker model.

The fast path on one machine (docs/DESIGN.md §4). It owns the round loop and nothing
else: client sampling (network.sampling), per-client seeds, streaming aggregation
(each upload is folded into the algorithm's aggregate as soon as its client
finishes), client state (network.client_store), evaluation (network.client, through
network/engine_evaluation.py's RoundEvaluation, which the engine inherits), checkpoints
and the metrics file. It depends only on a model, ``loss_fn(model, batch)``, an
``evaluate_fn(model, loader)`` and per-client loaders, so a Taskonomy TaskModel and the
least-squares oracle of the tests run through the very same code.

Run folder: ``metrics.csv`` (round, split, client, metric, value), ``checkpoint.pt``
after every round (written atomically: the whole server state, every client state and
the RNG), ``best.pt`` (lowest global validation loss, written only when the manifest has validation rows: never
chosen on the test split; ``{"model", "models", "model_config"}``:
``model`` is the global model, so models.load_task_model reads it, ``models`` every
server model by name), ``curves.png``. A resumed run ends bit-identical to an
uninterrupted one on CPU. With a frozen pretrained encoder both files (and spilled client
states) leave out every unchanged copy of it, named by source and hash instead (models/frozen_encoder.py).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from torch import nn
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from network.aggregation import Weights
from network.algorithms.base import (ALGORITHMS, Algorithm, ClientConfig, ClientResult, LossFn, ServerState,
                                     Upload)
from network.client import ClientData, ClientFailure, EvaluateFn, train_client, train_clients
from models.frozen_encoder import frozen_encoder_of, strip_frozen_encoder
from network.checkpoints import (BEST_FILE, CHECKPOINT_FILE, DROPPED_STATES, PRIVACY_STATE, load_resumable,
                                 run_fingerprint)
from network.client_store import ClientStore
from network.clients_table import CLIENTS_FILE, write_clients_table
from network.diagnostics import PLOT_FILE as DIAGNOSTICS_PLOT, DriftMeter, plot_diagnostics
from network.engine_config import EngineConfig
from network.engine_evaluation import RoundEvaluation
from network.local_train import NonFiniteLossError
from network.run_outputs import (CURVES_FILE, METRICS_COLUMNS, METRICS_FILE, LOG_ONLY, ROUND_LINE, TRAIN_SPLIT,
                                 mean_train_loss, metric_row, not_a_round_line, not_log_only, plot_curves, run_title,
                                 validation_loss)
from network.privacy import DP_GROUP, PRIVACY_SPLIT, SERVER_CLIENT, server_privacy
from network.sampling import client_seed, sample_clients
from network.schedule import client_at, holding_clients
from network.vectorized import require_vectorizable
from utils.errors import TaskHetError
from utils.interrupts import RESUME_HINT, interrupted
from utils.progress import Pace
from utils.run_dir import MetricsCSV, atomic_torch_save, remove_stale_temporaries
from utils.tensorboard_log import mirror_to_tensorboard



class SequentialEngine(RoundEvaluation):
    """Runs ``algorithm`` over ``clients`` for ``config.n_rounds`` rounds; see the module docstring.

    Args:
        model: the worker model (``build_algorithm``'s), holding the initial weights.
        algorithm: the algorithm object.
        clients: every client of the federation.
        loss_fn, evaluate_fn: the task's loss and split evaluation.
        test_loader: the global test split.
        config: round-loop settings.
        device: where the model trains.
        model_config: the arguments that rebuild the task model (kept in checkpoints).
        val_loader: the manifest's validation rows, or None: the global model is evaluated on them
            too (split ``val``), so a report can pick a round by validation and quote its test numbers.
        calibration_loader: held-out server data for ``algorithm.calibrate_server`` (None: none).
        unseen_clients: clients held out of all training (step 3b's ``--unseen_fraction``): never sampled, trained or
            aggregated, and not in ``algorithm.federation``; each evaluation round evaluates them after their own
            adaptation (:meth:`unseen_evaluations`, splits ``unseen_test*``).
    """

    def __init__(self, model: nn.Module, algorithm: Algorithm, clients: list[ClientData], loss_fn: LossFn,
                 evaluate_fn: EvaluateFn, test_loader: Iterable[dict], config: EngineConfig,
                 device: torch.device, model_config: dict[str, Any] | None = None,
                 logger: logging.Logger | None = None, val_loader: Iterable[dict] | None = None,
                 calibration_loader: Iterable[dict] | None = None,
                 unseen_clients: list[ClientData] | None = None) -> None:
        if (config.local_steps is None) == (config.local_epochs is None):
            raise TaskHetError("set exactly one of --local_steps and --local_epochs")
        ids = [str(client.client_id) for client in clients]
        if not ids or len(set(ids)) != len(ids):
            raise TaskHetError(f"the engine needs at least one client and unique client ids, got {len(ids)} ids")
        self.unseen = unseen_by_id(unseen_clients or [], ids, algorithm)
        if config.vectorize_chunk:
            check_vectorizable(model, algorithm)
            # vmap cannot ask a channels_last tensor whether it is contiguous (GroupNorm and BatchNorm do), and a
            # frozen encoder runs inside vmap with the model's own weights: the default layout, in place.
            model.to(memory_format=torch.contiguous_format)
        self.model, self.algorithm, self.loss_fn, self.evaluate_fn = model, algorithm, loss_fn, evaluate_fn
        self.clients = {client_id: client for client_id, client in zip(ids, clients)}
        self.test_loader, self.val_loader, self.config, self.device = test_loader, val_loader, config, device
        self.calibration_loader = calibration_loader  # the server's held-out data: Algorithm.calibrate_server
        self.model_config, self.logger = model_config, logger or logging.getLogger(__name__)
        self.out_dir = Path(config.out_dir)
        self.checkpoint_path = self.out_dir / CHECKPOINT_FILE
        self.checkpoint_round = 0  # the round of the last checkpoint.pt written (or resumed from)
        self._checkpointed_at = time.monotonic()  # when it was written (--checkpoint_minutes)
        self.current_round = 0  # the round being run: an interrupt names it
        self.frozen = frozen_encoder_of(model)  # checkpoints name a frozen pretrained encoder instead of holding it
        self.store = ClientStore(self.out_dir / "client_states", config.max_state_memory_bytes, self.frozen)
        # The server is built on first use: a resumed run reads it from the checkpoint first, so an expensive
        # init_server (FedLoGe's SSE-C refinement: 10,000 Adam steps) runs once per run, not once per resume.
        self.initial_weights = {key: value.detach().clone() for key, value in model.state_dict().items()}
        self._server: ServerState | None = None
        self.best_loss = math.inf
        self.metrics = mirror_to_tensorboard(MetricsCSV(self.out_dir / METRICS_FILE, METRICS_COLUMNS), config.tensorboard,
                                             self.out_dir, "round")
        for handler in self.logger.handlers:
            if not isinstance(handler, logging.FileHandler):  # the console: run.log keeps every round
                handler.addFilter(not_log_only)  # the console has a line per evaluated round, run.log one per round
                if not config.round_lines:
                    handler.addFilter(not_a_round_line)
        self.drift = DriftMeter(self.out_dir, algorithm.federation.layout.param_keys) if config.diagnostics else None
        self.privacy = server_privacy(config.privacy, algorithm, len(ids), config.client_fraction, config.seed)
        # Private entries never leave a client: the gradient diagnostics read the shared parameters only.
        self.private_params = algorithm.private_keys()
        self.shares_parameters = any(param.requires_grad and name not in self.private_params
                                     for name, param in model.named_parameters())

    @property
    def server(self) -> ServerState:
        """The server state: the checkpoint's after a resume, else ``init_server`` of the initial weights (built on
        first use)."""
        if self._server is None:
            self._server = self.algorithm.init_server(self.initial_weights)
        return self._server

    @server.setter
    def server(self, state: ServerState) -> None:
        self._server = state

    @property
    def global_weights(self) -> Weights:
        """The global model: the first of the algorithm's evaluated models."""
        return next(iter(self.algorithm.evaluated_models(self.server).values()))

    # ----- the loop -----
    def run(self) -> Weights:
        """Train (or finish training) and return the final global weights.

        Raises:
            utils.interrupts.Interrupted: on Ctrl-C or SIGTERM, naming the round that was running and the round of
                the last checkpoint (a rerun resumes from it).
        """
        try:
            return self._run()
        except KeyboardInterrupt as error:  # Ctrl-C, or SIGTERM (utils/interrupts.py)
            raise interrupted(error, self.interrupted_message()) from None

    def interrupted_message(self) -> str:
        """``interrupted at round 12 (checkpoint at round 10); rerun the same command to resume``."""
        checkpoint = (f"checkpoint at round {self.checkpoint_round}" if self.checkpoint_path.exists()
                      else "no checkpoint yet")
        return f"interrupted at round {self.current_round} ({checkpoint}); {RESUME_HINT}"

    def _run(self) -> Weights:
        start, began = self._start(), time.perf_counter()
        pace = Pace(start, self.config.n_rounds)
        bar = tqdm(range(start + 1, self.config.n_rounds + 1), initial=start, total=self.config.n_rounds,
                   desc=f"{self.algorithm.name} rounds", unit="round", disable=not self.config.progress)
        with logging_redirect_tqdm(loggers=[self.logger]):  # log lines above the bar, not through it
            for round_index in bar:
                self.current_round = round_index
                self._run_round(round_index, bar, pace)
        if hasattr(self.metrics, "close"):  # the TensorBoard mirror's event file
            self.metrics.close()
        if self.config.plots:
            plot_curves(self.out_dir / METRICS_FILE, self.out_dir / CURVES_FILE, run_title(self.algorithm.name, self.out_dir))
        if self.config.diagnostics and self.config.plots:
            plot_diagnostics(self.out_dir / METRICS_FILE, self.out_dir / DIAGNOSTICS_PLOT,
                             run_title(self.algorithm.name, self.out_dir))
        write_clients_table(self.out_dir / METRICS_FILE, self.algorithm.federation.client_sizes,
                            self.out_dir / CLIENTS_FILE, self.config.client_steps)
        best = (f"best global validation loss {self.best_loss:.4g} (best.pt)" if math.isfinite(self.best_loss)
                else "no validation rows, so no best.pt")
        self.logger.info("%s: %d rounds done (%d in this call, %.1fs), %s (every round: run.log)", self.out_dir,
                         self.config.n_rounds, self.config.n_rounds - start, time.perf_counter() - began, best)
        return self.global_weights

    def _run_round(self, round_index: int, bar: tqdm, pace: Pace) -> None:
        began = time.perf_counter()
        rows = self.train_round(round_index)
        test_loss = None
        if self._evaluates(round_index):
            eval_rows, test_loss = self.evaluate(round_index)
            rows += eval_rows
        rows += self.diagnose(round_index)
        self._finish_round(round_index, rows, test_loss)
        if test_loss is not None:
            bar.set_postfix(test_loss=f"{test_loss:.4g}")
        # One console line per evaluated round (the progress a log file shows: no bar is drawn there); run.log
        # has every round.
        self.logger.info("round %d of %d: train loss %.4g%s (%.1f s); %s", round_index, self.config.n_rounds,
                         mean_train_loss(rows), "" if test_loss is None else f", test loss {test_loss:.4g}",
                         time.perf_counter() - began, pace.eta(round_index),
                         extra={ROUND_LINE: True, LOG_ONLY: test_loss is None})

    def train_round(self, round_index: int) -> list[dict[str, Any]]:
        """Sample, train and aggregate one round; returns its training metric rows."""
        # Temporal skew: only clients holding rows in this round are drawn (network/schedule.py).
        sampled = sample_clients(holding_clients(self.clients, round_index), self.config.client_fraction,
                                 self.config.seed, round_index)
        broadcast = self.algorithm.broadcast(self.server)
        if self.privacy is not None:  # client-level DP: the round's clipping norm goes out with the model
            broadcast = {**broadcast, DP_GROUP: self.privacy.broadcast()}
        lr = float(self.config.lr_schedule(round_index))
        results: dict[str, dict[str, float]] = {}

        def uploads() -> Iterator[Upload]:
            for client_id, result in self.client_results(round_index, sampled, broadcast, lr):
                results[client_id] = result.metrics
                if self.drift is not None:
                    self.drift.add(client_id, result.upload)
                yield Upload(client_id, result.upload, result.num_samples, result.metrics)

        private = None if self.privacy is None else self.privacy.start_round(round_index)
        self.server = self.algorithm.aggregate(self.server, uploads() if private is None else private.uploads(uploads()))
        finite = [torch.isfinite(value).all() for weights in self.server.models.values()
                  for value in weights.values() if value.is_floating_point()]
        if finite and not bool(torch.stack(finite).all()):  # one device sync per round
            raise NonFiniteLossError(f"round {round_index}: the aggregated server models are not finite; "
                                     f"{self._stop_message()}")
        rows = [metric_row(round_index, TRAIN_SPLIT, client_id, metric, value)
                for client_id, metrics in results.items() for metric, value in metrics.items()]
        for metric in dict.fromkeys(metric for metrics in results.values() for metric in metrics):
            values = [metrics[metric] for metrics in results.values() if metric in metrics]
            rows.append(metric_row(round_index, TRAIN_SPLIT, "mean", metric, sum(values) / len(values)))
        if self.drift is not None:
            rows += self.drift.finish(round_index, plot=self.config.plots and self._evaluates(round_index))
        if private is not None:
            rows += [metric_row(round_index, PRIVACY_SPLIT, SERVER_CLIENT, metric, value)
                     for metric, value in private.finish()]
        return rows

    # ----- how an engine reaches its clients (the Flower engine overrides these two) -----
    def client_results(self, round_index: int, sampled: list[str], broadcast: dict[str, Weights],
                       lr: float) -> Iterator[tuple[str, ClientResult]]:
        """``(client_id, result)`` of the sampled clients, in the sampled order (the summation order)."""
        chunk = self.config.vectorize_chunk
        if not chunk:
            for client_id in sampled:
                yield client_id, self._train_client(round_index, client_id, broadcast, lr)
            return
        for start in range(0, len(sampled), chunk):
            members = sampled[start:start + chunk]
            yield from zip(members, self._train_chunk(round_index, members, broadcast, lr))

    def client_config(self, lr: float, num_samples: int, client_id: str | None = None) -> ClientConfig:
        """The round's ClientConfig for one client: its own local steps under unequal local work."""
        steps = self.config.local_steps if client_id is None else self.config.local_steps_of(client_id)
        return ClientConfig(lr=lr, loss_fn=self.loss_fn, device=self.device, num_samples=num_samples,
                            local_steps=steps, local_epochs=self.config.local_epochs,
                            momentum=self.config.momentum, weight_decay=self.config.weight_decay)

    # ----- pieces -----
    def _train_client(self, round_index: int, client_id: str, broadcast: dict[str, Weights], lr: float) -> ClientResult:
        client = client_at(self.clients[client_id], round_index)
        try:
            result = train_client(self.algorithm, self.model,
                                  self.algorithm.client_broadcast(self.server, broadcast, client_id),
                                  self.store.get(client_id), client,
                                  client_seed(self.config.seed, round_index, client_id),
                                  self.client_config(lr, client.num_samples, client_id))
        except NonFiniteLossError as error:
            raise NonFiniteLossError(f"round {round_index}, client {client_id}: {error}; "
                                     f"{self._stop_message()}") from None
        except Exception as error:  # any failure inside a client names the client
            raise ClientFailure(f"round {round_index}, client {client_id} failed: {type(error).__name__}: {error}; "
                                f"{self._stop_message()}") from error
        self.store.put(client_id, result.client_state)
        return result

    def _train_chunk(self, round_index: int, client_ids: list[str], broadcast: dict[str, Weights],
                     lr: float) -> list[ClientResult]:
        clients = [client_at(self.clients[client_id], round_index) for client_id in client_ids]
        if any(self.algorithm.client_broadcast(self.server, broadcast, client_id) is not broadcast
               for client_id in client_ids):
            raise TaskHetError(f"--vectorize_clients: {self.algorithm.name} sends each client its own message "
                               "(client_broadcast), which a lock-step chunk cannot take; run without it")
        try:
            results = train_clients(self.algorithm, self.model, broadcast,
                                    [self.store.get(client_id) for client_id in client_ids], clients,
                                    [client_seed(self.config.seed, round_index, client_id) for client_id in client_ids],
                                    [self.client_config(lr, client.num_samples, client_id)
                                     for client_id, client in zip(client_ids, clients)])
        except NonFiniteLossError as error:
            raise NonFiniteLossError(f"round {round_index}, {error}; {self._stop_message()}") from None
        except Exception as error:  # any failure inside a chunk names its clients
            raise ClientFailure(f"round {round_index}, the vectorised chunk of clients {', '.join(client_ids)} failed: "
                                f"{type(error).__name__}: {error}; {self._stop_message()}") from error
        for client_id, result in zip(client_ids, results):
            self.store.put(client_id, result.client_state)
        return results

    def _stop_message(self) -> str:
        return f"the run stopped; the last good checkpoint is {self.checkpoint_path} (round {self.checkpoint_round})"

    def _start(self) -> int:
        """Restore the checkpoint (resume) or evaluate round 0; returns the last finished round."""
        remove_stale_temporaries(self.out_dir)  # half-written files of a killed earlier run of this folder
        if self.config.resume and self.checkpoint_path.exists():
            checkpoint = load_resumable(self.checkpoint_path, self._fingerprint(), self.frozen)
            if checkpoint.get(DROPPED_STATES) and self.config.n_rounds > checkpoint["round"]:
                raise TaskHetError(f"{self.checkpoint_path}: the run ended at round {checkpoint['round']} and dropped its "
                                   f"{checkpoint[DROPPED_STATES]} clients' states, so it cannot train on to round "
                                   f"{self.config.n_rounds}; start over with --no-resume (or keep them next time: "
                                   "--keep_client_state)")
            self.server = ServerState(**checkpoint["server"]).to(self.device)
            self.store.restore(checkpoint["client_states"])
            if self.privacy is not None:
                self.privacy.load_state(checkpoint[PRIVACY_STATE])
            torch.set_rng_state(checkpoint["rng"]["torch"])
            self.best_loss = checkpoint["best_loss"]
            self.metrics.truncate_after("round", checkpoint["round"])
            self.checkpoint_round = checkpoint["round"]
            self.logger.info("resumed from %s after round %d", self.checkpoint_path, checkpoint["round"])
            return checkpoint["round"]
        self.metrics.truncate_after("round", -1)
        self.store.restore({})
        self.server = self.algorithm.calibrate_server(self.server, self.model, self.calibration_loader, self.device)
        rows, test_loss = self.evaluate(0)
        self._finish_round(0, rows + self.diagnose(0), test_loss)
        self.logger.info("round 0 of %d: test loss %.4g (before training)", self.config.n_rounds, test_loss,
                         extra={ROUND_LINE: True})
        return 0

    def _finish_round(self, round_index: int, rows: list[dict[str, Any]], test_loss: float | None) -> None:
        # Metrics first, checkpoint last: a kill in between redoes this round and truncates its rows.
        self.metrics.write(rows)
        server = self.server.to("cpu")
        global_weights = next(iter(self.algorithm.evaluated_models(server).values()))
        val_loss = validation_loss(rows)  # best.pt is chosen on the validation rows, never on the test split
        if val_loss is not None and val_loss < self.best_loss:
            self.best_loss = val_loss
            atomic_torch_save(strip_frozen_encoder({"model": global_weights, "models": server.models,
                                                    "model_config": self.model_config, "round": round_index,
                                                    "val_loss": val_loss, "test_loss": test_loss}, self.frozen),
                              self.out_dir / BEST_FILE)
        if self._checkpoints(round_index):
            self._write_checkpoint(round_index, server, global_weights)

    def _checkpoints(self, round_index: int) -> bool:
        if round_index in (0, self.config.n_rounds):
            return True
        minutes = self.config.checkpoint_minutes
        if minutes is not None:  # a budget of time lost to a kill, whatever a round costs
            return time.monotonic() - self._checkpointed_at >= 60 * minutes
        return round_index % self.config.checkpoint_every == 0

    def _write_checkpoint(self, round_index: int, server: ServerState, global_weights: Weights) -> None:
        finished = (round_index == self.config.n_rounds and not self.config.keep_client_state
                    and not self.algorithm.client_state_is_a_result())
        states = {} if finished else self.store.snapshot()
        atomic_torch_save(strip_frozen_encoder({
            "round": round_index, "model": global_weights, "model_config": self.model_config,
            "server": server.as_dict(), "client_states": states, "best_loss": self.best_loss,
            # Every draw derives from (seed, round, client), so the global torch state is the only RNG left.
            "rng": {"torch": torch.get_rng_state()}, "run": self._fingerprint(),
            DROPPED_STATES: self.store.count if finished else 0,
            PRIVACY_STATE: None if self.privacy is None else self.privacy.state(),
        }, self.frozen), self.checkpoint_path)
        self.checkpoint_round = round_index  # after the write: an interrupt inside it leaves the previous one
        self._checkpointed_at = time.monotonic()
        if finished:
            self.store.drop_spilled()  # the run is over: its states' evaluation is in metrics.csv

    def _fingerprint(self) -> dict[str, Any]:
        return run_fingerprint(self.algorithm, self.config, list(self.clients))


def unseen_by_id(unseen: list[ClientData], seen_ids: list[str], algorithm: Algorithm) -> dict[str, ClientData]:
    """The unseen clients by id, after checking that no id is twice, a seen client's or one the algorithm's
    federation counts (an unseen client must never weigh in an aggregate)."""
    by_id = {str(client.client_id): client for client in unseen}
    counted = set(seen_ids) | set(algorithm.federation.client_sizes)
    clash = sorted(set(by_id) & counted)
    if len(by_id) != len(unseen) or clash:
        raise TaskHetError(f"unseen clients must have their own ids, outside the federation; got "
                           f"{[str(client.client_id) for client in unseen]} (in the federation: {clash})")
    return by_id


def check_vectorizable(model: nn.Module, algorithm: Algorithm) -> None:
    """One clear error unless ``algorithm`` declares vectorised clients and ``model`` can train vectorised."""
    require_vectorizable(model, algorithm.name, algorithm.vectorizable,
                         [name for name in ALGORITHMS.names() if ALGORITHMS.get(name).vectorizable])
