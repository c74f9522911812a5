"""The sequential engine: every client of a round trained in turn on one reused model.

The fast path on one machine (DESIGN.md §4). It owns the round loop and nothing
else: client sampling (network.sampling), per-client seeds, streaming aggregation
(each upload is folded into the algorithm's running mean as soon as its client
finishes), client state (network.client_store), evaluation, checkpoints and the
metrics file. It depends only on a model, ``loss_fn(model, batch)``, an
``evaluate_fn(model, loader)`` and per-client loaders, so a Taskonomy TaskModel
and the least-squares oracle of the tests run through the very same code.

Run folder: ``metrics.csv`` (round, split, client, metric, value), ``checkpoint.pt``
after every round (written atomically), ``best.pt`` (lowest global test loss; the
``{"model", "model_config"}`` layout of step 2, so models.load_task_model reads it),
``curves.png``. A resumed run ends bit-identical to an uninterrupted one on CPU.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from network.aggregation import Weights, client_summary
from network.algorithms.base import TRAIN_LOSS, Algorithm, ClientConfig, ClientResult, LossFn, load_weights
from network.client_store import ClientStore
from network.local_train import NonFiniteLossError
from network.sampling import client_seed, sample_clients
from utils.errors import TaskHetError
from utils.run_dir import MetricsCSV, atomic_torch_save, load_checkpoint

# Names in metrics.csv, shared with every engine and with the report.
GLOBAL_TEST_SPLIT = "test"  # the global model on the manifest's test split
CLIENT_TEST_SPLIT = "client_test"  # the global model on each client's held-out samples
PERSONAL_TEST_SPLIT = "client_test_personal"  # each client's own model (algorithms with personal keys)
TRAIN_SPLIT = "train"  # the clients' local training metrics
GLOBAL_CLIENT = "global"
SUMMARY_CLIENTS = ("mean", "std", "worst_decile")
METRICS_COLUMNS = ("round", "split", "client", "metric", "value")
CHECKPOINT_FILE, BEST_FILE, METRICS_FILE, CURVES_FILE = "checkpoint.pt", "best.pt", "metrics.csv", "curves.png"

EvaluateFn = Callable[[nn.Module, Iterable[dict]], dict[str, float]]


@dataclass(frozen=True)
class ClientData:
    """One client as the engine sees it.

    Attributes:
        client_id: the id in assignments.csv (kept as a string).
        num_samples: size of its training split (its FedAvg weight).
        train_loader: ``train_loader(seed) -> iterable of batch dicts``; the seed fixes the order.
        test_loader: its held-out client-test batches, or None.
    """

    client_id: str
    num_samples: int
    train_loader: Callable[[int], Iterable[dict]]
    test_loader: Iterable[dict] | None = None


@dataclass(frozen=True)
class EngineConfig:
    """Round-loop settings (identical for every algorithm).

    Attributes:
        out_dir: the run folder.
        n_rounds: rounds to train (round 0 is the initial model, evaluated only).
        lr_schedule: local learning rate as a function of the round (see make_lr_schedule).
        seed: root seed of sampling and of every client's training.
        local_steps / local_epochs: the local budget (exactly one is set).
        client_fraction: share of clients per round.
        eval_every: evaluate every this many rounds (and round 0 and the last round).
        momentum / weight_decay: local SGD settings.
        resume: continue from ``out_dir/checkpoint.pt`` if present (else start over).
        max_state_memory_bytes: client state kept in memory before spilling to disk (None: no limit).
        progress: show a tqdm bar over rounds.
        signature: the caller's description of the run (its arguments); resuming a
            checkpoint written with another signature is refused.
    """

    out_dir: Path
    n_rounds: int
    lr_schedule: Callable[[int], float]
    seed: int = 0
    local_steps: int | None = None
    local_epochs: int | None = None
    client_fraction: float = 1.0
    eval_every: int = 1
    momentum: float = 0.0
    weight_decay: float = 0.0
    resume: bool = True
    max_state_memory_bytes: int | None = None
    progress: bool = True
    signature: dict[str, str] | None = None


class SequentialEngine:
    """Runs ``algorithm`` over ``clients`` for ``config.n_rounds`` rounds; see the module docstring."""

    def __init__(self, model: nn.Module, algorithm: Algorithm, clients: list[ClientData], loss_fn: LossFn,
                 evaluate_fn: EvaluateFn, test_loader: Iterable[dict], config: EngineConfig,
                 device: torch.device, model_config: dict[str, Any] | None = None,
                 logger: logging.Logger | None = None) -> None:
        if (config.local_steps is None) == (config.local_epochs is None):
            raise TaskHetError("set exactly one of --local_steps and --local_epochs")
        ids = [str(client.client_id) for client in clients]
        if not ids or len(set(ids)) != len(ids):
            raise TaskHetError(f"the engine needs at least one client and unique client ids, got {len(ids)} ids")
        self.model, self.algorithm, self.loss_fn, self.evaluate_fn = model, algorithm, loss_fn, evaluate_fn
        self.clients = {client_id: client for client_id, client in zip(ids, clients)}
        self.test_loader, self.config, self.device = test_loader, config, device
        self.model_config, self.logger = model_config, logger or logging.getLogger(__name__)
        self.out_dir = Path(config.out_dir)
        self.checkpoint_path = self.out_dir / CHECKPOINT_FILE
        self.store = ClientStore(self.out_dir / "client_states", config.max_state_memory_bytes)
        self.global_weights: Weights = {key: value.detach().clone() for key, value in model.state_dict().items()}
        self.server_state: Weights = algorithm.init_server_state(self.global_weights)
        self.personal_keys = algorithm.personal_keys(model)
        self.best_loss = math.inf
        self.metrics = MetricsCSV(self.out_dir / METRICS_FILE, METRICS_COLUMNS)

    # ----- the loop -----
    def run(self) -> Weights:
        """Train (or finish training) and return the final global weights."""
        start = self._start()
        bar = tqdm(range(start + 1, self.config.n_rounds + 1), initial=start, total=self.config.n_rounds,
                   desc=f"{self.algorithm.name} rounds", unit="round", disable=not self.config.progress)
        with logging_redirect_tqdm(loggers=[self.logger]):  # log lines above the bar, not through it
            for round_index in bar:
                self._run_round(round_index, bar)
        plot_curves(self.out_dir / METRICS_FILE, self.out_dir / CURVES_FILE)
        return self.global_weights

    def _run_round(self, round_index: int, bar: tqdm) -> None:
        began = time.perf_counter()
        rows = self.train_round(round_index)
        test_loss = None
        if round_index % self.config.eval_every == 0 or round_index == self.config.n_rounds:
            eval_rows, test_loss = self.evaluate(round_index)
            rows += eval_rows
        self._finish_round(round_index, rows, test_loss)
        if test_loss is not None:
            bar.set_postfix(test_loss=f"{test_loss:.4g}")
        self.logger.info("round %d: train loss %.4g%s (%.1fs)", round_index, _mean_train_loss(rows),
                         "" if test_loss is None else f", test loss {test_loss:.4g}", time.perf_counter() - began)

    def train_round(self, round_index: int) -> list[dict[str, Any]]:
        """Sample, train and aggregate one round; returns its training metric rows."""
        sampled = sample_clients(list(self.clients), self.config.client_fraction, self.config.seed, round_index)
        broadcast = self.algorithm.broadcast(self.global_weights, self.server_state)
        lr = float(self.config.lr_schedule(round_index))
        results: dict[str, dict[str, float]] = {}

        def uploads() -> Iterator[tuple[Weights, int]]:
            for client_id, result in self.client_results(round_index, sampled, broadcast, lr):
                results[client_id] = result.metrics
                yield result.upload, result.num_samples

        self.global_weights, self.server_state = self.algorithm.aggregate(self.global_weights, self.server_state,
                                                                          uploads())
        finite = [torch.isfinite(value).all() for value in self.global_weights.values() if value.is_floating_point()]
        if finite and not bool(torch.stack(finite).all()):  # one device sync per round
            raise NonFiniteLossError(f"round {round_index}: the aggregated global weights are not finite; "
                                     f"{self._stop_message(round_index)}")
        rows = [_row(round_index, TRAIN_SPLIT, client_id, metric, value)
                for client_id, metrics in results.items() for metric, value in metrics.items()]
        for metric in dict.fromkeys(metric for metrics in results.values() for metric in metrics):
            values = [metrics[metric] for metrics in results.values() if metric in metrics]
            rows.append(_row(round_index, TRAIN_SPLIT, "mean", metric, sum(values) / len(values)))
        return rows

    def evaluate(self, round_index: int) -> tuple[list[dict[str, Any]], float]:
        """Global model on the global test split and on every client's test split (plus personal models).

        Returns:
            The metric rows and the global test loss.
        """
        load_weights(self.model, self.global_weights)
        test = self._evaluate(self.test_loader)
        rows = [_row(round_index, GLOBAL_TEST_SPLIT, GLOBAL_CLIENT, metric, value) for metric, value in test.items()]
        per_client, personal = self.client_evaluations(round_index)
        rows += _client_rows(round_index, CLIENT_TEST_SPLIT, per_client)
        if self.personal_keys:
            rows += _client_rows(round_index, PERSONAL_TEST_SPLIT, personal)
        return rows, float(test["loss"])

    # ----- how an engine reaches its clients (the Flower engine overrides these two) -----
    def client_results(self, round_index: int, sampled: list[str], broadcast: Weights,
                       lr: float) -> Iterator[tuple[str, ClientResult]]:
        """``(client_id, result)`` of the sampled clients, in the sampled order (the summation order)."""
        for client_id in sampled:
            yield client_id, self._train_client(round_index, client_id, broadcast, lr)

    def client_evaluations(self, round_index: int) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
        """Per-client metrics of the global model, and of each client's own model (empty without personal keys).

        Both dicts are keyed by client id in the engine's client order, clients without test samples left out.
        """
        testable = [client_id for client_id, client in self.clients.items() if client.test_loader is not None]
        per_client = {client_id: self._evaluate(self.clients[client_id].test_loader) for client_id in testable}
        personal = {client_id: evaluate_personal(self.algorithm, self.model, self.evaluate_fn, self.global_weights,
                                                 self.store.get(client_id), self.clients[client_id].test_loader)
                    for client_id in (testable if self.personal_keys else ())}
        return per_client, personal

    # ----- pieces -----
    def _train_client(self, round_index: int, client_id: str, broadcast: Weights, lr: float) -> ClientResult:
        client = self.clients[client_id]
        cfg = ClientConfig(lr=lr, loss_fn=self.loss_fn, device=self.device, num_samples=client.num_samples,
                           local_steps=self.config.local_steps, local_epochs=self.config.local_epochs,
                           momentum=self.config.momentum, weight_decay=self.config.weight_decay)
        try:
            result = train_client(self.algorithm, self.model, broadcast, self.store.get(client_id), client,
                                  client_seed(self.config.seed, round_index, client_id), cfg)
        except NonFiniteLossError as error:
            raise NonFiniteLossError(f"round {round_index}, client {client_id}: {error}; "
                                     f"{self._stop_message(round_index)}") from None
        self.store.put(client_id, result.client_state)
        return result

    def _evaluate(self, loader: Iterable[dict]) -> dict[str, float]:
        return evaluate_model(self.model, self.evaluate_fn, loader)

    def _stop_message(self, round_index: int) -> str:
        return f"the run stopped; the last good checkpoint is {self.checkpoint_path} (round {round_index - 1})"

    def _start(self) -> int:
        """Restore the checkpoint (resume) or evaluate round 0; returns the last finished round."""
        if self.config.resume and self.checkpoint_path.exists():
            checkpoint = load_checkpoint(self.checkpoint_path)
            if checkpoint["run"] != self._fingerprint():
                raise TaskHetError(f"{self.checkpoint_path} belongs to a different run ({checkpoint['run']}); "
                                   "use --no-resume or another --out")
            self.global_weights = {key: value.to(self.device) for key, value in checkpoint["model"].items()}
            self.server_state = {key: value.to(self.device) for key, value in checkpoint["server_state"].items()}
            self.store.restore(checkpoint["client_states"])
            torch.set_rng_state(checkpoint["rng"]["torch"])
            self.best_loss = checkpoint["best_loss"]
            self.metrics.truncate_after("round", checkpoint["round"])
            self.logger.info("resumed from %s after round %d", self.checkpoint_path, checkpoint["round"])
            return checkpoint["round"]
        self.metrics.truncate_after("round", -1)
        self.store.restore({})
        rows, test_loss = self.evaluate(0)
        self._finish_round(0, rows, test_loss)
        self.logger.info("round 0: test loss %.4g", test_loss)
        return 0

    def _finish_round(self, round_index: int, rows: list[dict[str, Any]], test_loss: float | None) -> None:
        # Metrics first, checkpoint last: a kill in between redoes this round and truncates its rows.
        self.metrics.write(rows)
        cpu_weights = {key: value.detach().cpu() for key, value in self.global_weights.items()}
        if test_loss is not None and test_loss < self.best_loss:
            self.best_loss = test_loss
            atomic_torch_save({"model": cpu_weights, "model_config": self.model_config, "round": round_index,
                               "test_loss": test_loss}, self.out_dir / BEST_FILE)
        atomic_torch_save({
            "round": round_index, "model": cpu_weights, "model_config": self.model_config,
            "server_state": {key: value.detach().cpu() for key, value in self.server_state.items()},
            "client_states": self.store.snapshot(), "best_loss": self.best_loss,
            # Every draw derives from (seed, round, client), so the global torch state is the only RNG left.
            "rng": {"torch": torch.get_rng_state()}, "run": self._fingerprint(),
        }, self.checkpoint_path)

    def _fingerprint(self) -> dict[str, Any]:
        return {"algorithm": self.algorithm.name, "seed": self.config.seed, "clients": list(self.clients),
                "signature": dict(self.config.signature or {})}


# ----- one client's work, shared by both engines (the Flower node calls these too) -----
def train_client(algorithm: Algorithm, model: nn.Module, broadcast: Weights, state: Weights | None,
                 client: ClientData, seed: int, cfg: ClientConfig) -> ClientResult:
    """``client_update`` of one client, seeded by its (seed, round, client) seed; ``state`` None = its first round."""
    state = algorithm.init_client_state(broadcast) if state is None else state
    with seeded_torch_rng(seed, cfg.device):
        return algorithm.client_update(model, broadcast, state, client.train_loader(seed), cfg)


def evaluate_model(model: nn.Module, evaluate_fn: EvaluateFn, loader: Iterable[dict]) -> dict[str, float]:
    """``evaluate_fn`` in eval mode without gradients, every metric as a float."""
    model.eval()
    with torch.no_grad():
        return {metric: float(value) for metric, value in evaluate_fn(model, loader).items()}


def evaluate_personal(algorithm: Algorithm, model: nn.Module, evaluate_fn: EvaluateFn, global_weights: Weights,
                      state: Weights | None, loader: Iterable[dict]) -> dict[str, float]:
    """A client's own model (``personalized_weights`` of its state) on ``loader``."""
    state = algorithm.init_client_state(global_weights) if state is None else state
    load_weights(model, algorithm.personalized_weights(global_weights, state))
    return evaluate_model(model, evaluate_fn, loader)


@contextlib.contextmanager
def seeded_torch_rng(seed: int, device: torch.device) -> Iterator[None]:
    """Seed torch's global generators (dropout, random augmentation) for one client, restoring them after.

    Layers such as dropout only draw from the global generator; forking it makes a
    client's training a function of its seed without disturbing any other draw.
    """
    devices = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        # Seeds only the generators in use (torch.manual_seed would also queue lazy seeding of every backend).
        torch.default_generator.manual_seed(seed)
        if device.type == "cuda":
            torch.cuda.manual_seed(seed)
        elif device.type == "mps":
            torch.mps.manual_seed(seed)
        yield


def make_lr_schedule(spec: str, init_lr: float, n_rounds: int) -> Callable[[int], float]:
    """The local learning rate of round r (1-based), the same for every client.

    ``constant``; ``cosine`` (init_lr at round 1, towards 0 at round n_rounds + 1);
    ``exponential:RATE`` (init_lr·RATE^(r−1), the original code's per-round decay);
    ``step:EVERY:GAMMA`` (init_lr·GAMMA^⌊(r−1)/EVERY⌋).
    """
    name, *params = spec.split(":")
    try:
        values = [float(param) for param in params]
        schedules = {("constant", 0): partial(_constant, init_lr), ("cosine", 0): partial(_cosine, init_lr, n_rounds)}
        if name == "exponential" and len(values) == 1 and values[0] > 0:
            return partial(_exponential, init_lr, values[0])
        if name == "step" and len(values) == 2 and values[0] >= 1 and values[1] > 0:
            return partial(_step, init_lr, int(values[0]), values[1])
        return schedules[(name, len(values))]
    except (ValueError, KeyError):
        raise TaskHetError(f"--lr_schedule {spec!r} is not one of: constant, cosine, exponential:RATE, "
                           "step:EVERY:GAMMA") from None


def _constant(init_lr: float, round_index: int) -> float:
    return init_lr


def _cosine(init_lr: float, n_rounds: int, round_index: int) -> float:
    return init_lr * 0.5 * (1 + math.cos(math.pi * (round_index - 1) / max(n_rounds, 1)))


def _exponential(init_lr: float, rate: float, round_index: int) -> float:
    return init_lr * rate ** (round_index - 1)


def _step(init_lr: float, every: int, gamma: float, round_index: int) -> float:
    return init_lr * gamma ** ((round_index - 1) // every)


def _row(round_index: int, split: str, client: str, metric: str, value: float) -> dict[str, Any]:
    return {"round": round_index, "split": split, "client": client, "metric": metric, "value": float(value)}


def _client_rows(round_index: int, split: str, per_client: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """Per-client rows plus mean and std of every metric (and the worst decile of the loss)."""
    rows = [_row(round_index, split, client_id, metric, value)
            for client_id, metrics in per_client.items() for metric, value in metrics.items()]
    for metric in dict.fromkeys(metric for metrics in per_client.values() for metric in metrics):
        summary = client_summary([metrics[metric] for metrics in per_client.values() if metric in metrics])
        for name in SUMMARY_CLIENTS if metric == "loss" else SUMMARY_CLIENTS[:2]:
            rows.append(_row(round_index, split, name, metric, summary[name]))
    return rows


def _mean_train_loss(rows: list[dict[str, Any]]) -> float:
    return next((row["value"] for row in rows if row["split"] == TRAIN_SPLIT and row["client"] == "mean"
                 and row["metric"] == TRAIN_LOSS), math.nan)


def plot_curves(metrics_csv: Path, out_png: Path) -> None:
    """Loss per round: global test, client-test mean ± std (global and personal models), mean train loss."""
    # Imported here, not at the top: training never needs matplotlib. utils.plots selects Agg first.
    from utils.plots import plt, save_figure
    import pandas as pd

    metrics = pd.read_csv(metrics_csv, dtype={"client": str})
    figure, axis = plt.subplots(figsize=(7, 4))
    for split, label in ((GLOBAL_TEST_SPLIT, "global test"), (CLIENT_TEST_SPLIT, "client test (global model)"),
                         (PERSONAL_TEST_SPLIT, "client test (personal models)")):
        client = GLOBAL_CLIENT if split == GLOBAL_TEST_SPLIT else "mean"
        curve = metrics[(metrics.split == split) & (metrics.client == client) & (metrics.metric == "loss")]
        if curve.empty:
            continue
        line, = axis.plot(curve["round"], curve["value"], marker="o", markersize=3, label=label)
        spread = metrics[(metrics.split == split) & (metrics.client == "std") & (metrics.metric == "loss")]
        if not spread.empty:
            axis.fill_between(curve["round"], curve["value"].to_numpy() - spread["value"].to_numpy(),
                              curve["value"].to_numpy() + spread["value"].to_numpy(), color=line.get_color(), alpha=0.2)
    train = metrics[(metrics.split == TRAIN_SPLIT) & (metrics.client == "mean") & (metrics.metric == TRAIN_LOSS)]
    if not train.empty:
        axis.plot(train["round"], train["value"], linestyle="--", label="local train loss (mean)")
    axis.set_xlabel("round")
    axis.set_ylabel("loss")
    axis.legend()
    save_figure(figure, out_png, dpi=120)
