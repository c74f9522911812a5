"""One client's work, shared by both engines: its data handle, one round of training, its evaluation.

The sequential engine calls these in-process; a Flower node calls the very same
functions for the clients it hosts, so the two engines cannot drift apart.

Evaluation of one client (:func:`evaluate_client`) gives up to three splits:

* ``client_test``: the global model on the client's held-out samples;
* ``client_test_personal``: the client's own model (``algorithm.personal_model``), for
  personalised algorithms; a client without one (e.g. never sampled) is skipped;
* ``client_test_finetuned``: with ``finetune_steps > 0``, its own model (or the global
  model) after that many local SGD steps on its training rows: the "local fine-tuning"
  baseline and FedBABU's protocol, for every algorithm. Nothing it trains is kept.

For a classifier whose client knows its training class counts (``ClientData.class_counts``), each
split is also evaluated under the one absent-class rule of the Fed-LT protocol (issue 20): a class
the client never trained on gets a −∞ logit, so it is never predicted. Those rows are the split's
name plus ``_masked`` (``client_test_masked``, ``client_test_personal_masked``,
``client_test_finetuned_masked``); the unmasked rows stay as they are, so every method is reported
both ways by the same code. A test sample of a masked class counts as wrong and its loss is +∞.

A client held out of all training (step 3b's ``--unseen_fraction``) is evaluated by
:func:`evaluate_unseen_client`: the same three splits, named ``unseen_test``,
``unseen_test_personal`` and ``unseen_test_finetuned`` (and their ``_masked`` twins), after the
algorithm's own personalisation step from the current broadcast (:func:`adapts_new_clients`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from network.aggregation import Weights
from network.algorithms.base import Algorithm, ClientConfig, ClientResult, LossFn, load_weights, make_optimizer
from network.local_train import local_train
from network.privacy import ADAPTIVE_KEY, CLIP_KEY, DP_GROUP, clip_upload
from network.sampling import client_seed
from network.vectorized import ChunkNonFiniteLoss
from utils.errors import NonFiniteLossError, TaskHetError

GLOBAL_TEST_SPLIT = "test"  # the global model on the manifest's test split
CLIENT_TEST_SPLIT = "client_test"  # the global model on each client's held-out samples
PERSONAL_TEST_SPLIT = "client_test_personal"  # each client's own model on them
FINETUNED_TEST_SPLIT = "client_test_finetuned"  # after --finetune_steps local steps
MASKED_SUFFIX = "_masked"  # the same split with the client's absent classes masked (−∞ logit)
# The same splits of the clients held out of all training (step 3b's --unseen_fraction): evaluate_unseen_client.
UNSEEN_TEST_SPLIT = "unseen_test"  # the global model on an unseen client's test rows
UNSEEN_PERSONAL_SPLIT = "unseen_test_personal"  # its own model after the algorithm's personalisation step
UNSEEN_FINETUNED_SPLIT = "unseen_test_finetuned"  # after --finetune_steps local steps
UNSEEN_SPLIT_OF = {CLIENT_TEST_SPLIT: UNSEEN_TEST_SPLIT, PERSONAL_TEST_SPLIT: UNSEEN_PERSONAL_SPLIT,
                   FINETUNED_TEST_SPLIT: UNSEEN_FINETUNED_SPLIT}
UNSEEN_SPLITS = tuple(split + suffix for split in UNSEEN_SPLIT_OF.values() for suffix in ("", MASKED_SUFFIX))

EvaluateFn = Callable[[nn.Module, Iterable[dict]], dict[str, float]]


class ClientFailure(TaskHetError):
    """A client failed and the run cannot go on; the message names the client."""


@dataclass(frozen=True)
class ClientData:
    """One client as an engine sees it.

    Attributes:
        client_id: the id in assignments.csv (kept as a string).
        num_samples: size of its training split (its FedAvg weight).
        train_loader: ``train_loader(seed) -> iterable of batch dicts``; the seed fixes the order.
        test_loader: its held-out client-test batches, or None.
        class_counts: its number of training samples per class (classification tasks), or None:
            the absent-class mask of the evaluation, and what FedRoD's balanced softmax reads.
        schedule: a ``network.schedule.ClientSchedule`` when the rows it holds change over rounds (temporal
            skew); engines then train ``network.schedule.client_at(client, round)``. None: always all its rows.
    """

    client_id: str
    num_samples: int
    train_loader: Callable[[int], Iterable[dict]]
    test_loader: Iterable[dict] | None = None
    class_counts: tuple[int, ...] | None = None
    schedule: Any = None


@dataclass(frozen=True)
class Finetune:
    """Evaluation-time personalisation: ``steps`` local SGD steps before evaluating (0: off)."""

    steps: int
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0


def train_client(algorithm: Algorithm, model: nn.Module, broadcast: dict[str, Weights], state: Weights | None,
                 client: ClientData, seed: int, cfg: ClientConfig) -> ClientResult:
    """``client_update`` of one client under its own seed; ``state`` None = its first round.

    The upload is checked against the algorithm's private entries: one in an upload is an error. Its size is the one
    the client reports (``algorithm.reported_num_samples``: bucketed or noisy under a private weighting).
    """
    if client.class_counts is not None:
        cfg = dataclasses.replace(cfg, class_counts=client.class_counts)
    with seeded_torch_rng(seed, cfg.device):
        result = algorithm.client_update(model, broadcast, dict(state or {}), client.train_loader(seed), cfg)
    _check_upload(algorithm, result, client.client_id)
    result.num_samples = algorithm.reported_num_samples(client.client_id, result.num_samples)
    result.upload = private_upload(algorithm, broadcast, result.upload)
    return result


def private_upload(algorithm: Algorithm, broadcast: dict[str, Weights], upload: dict[str, Weights]
                   ) -> dict[str, Weights]:
    """Under client-level DP (the broadcast carries the round's C), the upload clipped on the client, before it
    leaves: nothing unclipped reaches the server (network/privacy.py). Unchanged without DP."""
    dp = broadcast.get(DP_GROUP)
    if dp is None:
        return upload
    return clip_upload(upload, algorithm.dp_groups, float(dp[CLIP_KEY]), ADAPTIVE_KEY in dp)


def _check_upload(algorithm: Algorithm, result: ClientResult, client_id: str) -> None:
    leaked = sorted(algorithm.private_keys().intersection(key for group in result.upload.values() for key in group))
    if leaked:
        raise TaskHetError(f"{algorithm.name} uploaded {len(leaked)} private entries of client {client_id}, "
                           f"e.g. {leaked[:3]}")


def train_clients(algorithm: Algorithm, model: nn.Module, broadcast: dict[str, Weights], states: list[Weights | None],
                  clients: list[ClientData], seeds: list[int], cfgs: list[ClientConfig]) -> list[ClientResult]:
    """:func:`train_client` for a chunk of clients trained in lock-step (``algorithm.client_updates``,
    ``--vectorize_clients``): each client's loader is built under its own seed, as ``train_client`` builds it.

    A non-finite loss names its client (``network.vectorized.ChunkNonFiniteLoss`` carries the position).
    """
    device = cfgs[0].device
    loaders, prepared = [], []
    try:
        for client, seed, state, cfg in zip(clients, seeds, states, cfgs):
            with seeded_torch_rng(seed, device):
                loaders.append(client.train_loader(seed))
                prepared.append(algorithm.prepare_lockstep(model, broadcast, dict(state or {}), loaders[-1], cfg))
        with seeded_torch_rng(seeds[0], device):  # whatever the chunk draws stays out of the global generator
            results = algorithm.client_updates(model, broadcast, prepared, loaders, cfgs)
    except ChunkNonFiniteLoss as error:
        raise NonFiniteLossError(f"client {clients[error.position].client_id}: {error}") from None
    for client, result in zip(clients, results):
        _check_upload(algorithm, result, client.client_id)
        result.num_samples = algorithm.reported_num_samples(client.client_id, result.num_samples)
        result.upload = private_upload(algorithm, broadcast, result.upload)
    return results


def evaluate_model(model: nn.Module, evaluate_fn: EvaluateFn, loader: Iterable[dict]) -> dict[str, float]:
    """``evaluate_fn`` in eval mode without gradients, every metric as a float."""
    model.eval()
    with torch.no_grad():
        return {metric: float(value) for metric, value in evaluate_fn(model, loader).items()}


def evaluate_client(algorithm: Algorithm, model: nn.Module, evaluate_fn: EvaluateFn, models: dict[str, Weights],
                    global_weights: Weights, state: Weights | None, client: ClientData, loss_fn: LossFn,
                    device: torch.device, finetune: Finetune | None, seed: int) -> dict[str, dict[str, float]]:
    """One client's evaluation splits (see the module docstring); empty for a client without test samples.

    Args:
        models: the server's models (what ``personal_model`` reads).
        global_weights: the global model (the first of ``algorithm.evaluated_models``).
        state: the client's state (None: it has never trained).
        seed: the fine-tuning seed (the engine derives it from the run seed, round and client).
    """
    if client.test_loader is None:
        return {}
    absent = absent_classes(client.class_counts)

    def evaluate_as(split: str) -> dict[str, dict[str, float]]:
        result = {split: evaluate_model(model, evaluate_fn, client.test_loader)}
        if absent is not None:
            result[split + MASKED_SUFFIX] = evaluate_model(AbsentClassMask(model, absent), evaluate_fn,
                                                           client.test_loader)
        return result

    load_weights(model, global_weights)
    splits = evaluate_as(CLIENT_TEST_SPLIT)
    own = algorithm.personal_model(models, dict(state or {})) if algorithm.personalized else None
    if own is not None:
        load_weights(model, own)
        splits.update(evaluate_as(PERSONAL_TEST_SPLIT))
    if finetune is not None and finetune.steps > 0 and client.num_samples > 0:  # 0: a schedule holds nothing now
        load_weights(model, own if own is not None else global_weights)
        with seeded_torch_rng(seed, device):
            cfg = ClientConfig(lr=finetune.lr, loss_fn=loss_fn, device=device, num_samples=client.num_samples,
                               momentum=finetune.momentum, weight_decay=finetune.weight_decay)
            local_train(model, client.train_loader(seed), loss_fn, make_optimizer(model.parameters(), cfg), device,
                        steps=finetune.steps)
        splits.update(evaluate_as(FINETUNED_TEST_SPLIT))
    return splits


def unseen_split(split: str) -> str:
    """The unseen clients' name of a client split: ``client_test_personal_masked`` -> ``unseen_test_personal_masked``."""
    base = split.removesuffix(MASKED_SUFFIX)
    return UNSEEN_SPLIT_OF[base] + split[len(base):]


def adapts_new_clients(algorithm: Algorithm) -> bool:
    """Whether a client outside the federation gets a personal model from one ``client_update``: a personalised
    algorithm that sends every client the same broadcast.

    An algorithm that tailors each message (``client_broadcast``: CFL's cluster, FedAMP's stored model, MOCHA's Ω
    row) defines it for the members of its federation only; a newcomer has none, so it is evaluated without a
    personal model (counted in the personal split's ``skipped`` row) and, with ``--finetune_steps``, fine-tuned.
    """
    return algorithm.personalized and type(algorithm).client_broadcast is Algorithm.client_broadcast


def adaptation_seed(seed: int, round_index: int, client_id: str) -> int:
    """The seed of an unseen client's personalisation step (apart from any seen client's training seed)."""
    return client_seed(seed, round_index, f"adapt/{client_id}")


def evaluate_unseen_client(algorithm: Algorithm, model: nn.Module, evaluate_fn: EvaluateFn,
                           models: dict[str, Weights], global_weights: Weights, broadcast: dict[str, Weights],
                           client: ClientData, loss_fn: LossFn, device: torch.device, finetune: Finetune | None,
                           cfg: ClientConfig, seeds: tuple[int, int]) -> dict[str, dict[str, float]]:
    """The splits of a client held out of all training, after its own adaptation (empty without test samples).

    A personalised algorithm (:func:`adapts_new_clients`) first runs its own ``client_update`` on the client's
    train rows, from ``broadcast`` (the round's broadcast, what a newly sampled client would receive), with a fresh
    client state and the usual local budget (``cfg``); the upload is dropped and the state is used for this
    evaluation only, so nothing reaches the server or any other client. Then :func:`evaluate_client` runs exactly
    as for a seen client, with that state: the global model, the personal model and, with ``finetune``, the
    personal (else global) model after its fine-tuning steps; the splits are renamed by :func:`unseen_split`.

    Args:
        models, global_weights: the server's models and the global model (as for :func:`evaluate_client`).
        broadcast: ``algorithm.broadcast`` of the current server state.
        cfg: the personalisation step's client config (the round's learning rate and the run's local budget).
        seeds: the personalisation seed (:func:`adaptation_seed`) and the fine-tuning seed (:func:`finetune_seed`).
    """
    if client.test_loader is None:
        return {}
    adaptation, finetuning = seeds
    state = None
    if adapts_new_clients(algorithm) and client.num_samples > 0:  # 0: a schedule holds none of its rows now
        state = train_client(algorithm, model, broadcast, None, client, adaptation, cfg).client_state
    splits = evaluate_client(algorithm, model, evaluate_fn, models, global_weights, state, client, loss_fn, device,
                             finetune, finetuning)
    return {unseen_split(split): metrics for split, metrics in splits.items()}


def absent_classes(class_counts: Iterable[int] | None) -> torch.Tensor | None:
    """Bool ``[K]``: the classes a client has no training sample of (None without counts or with none absent)."""
    if class_counts is None:
        return None
    absent = torch.tensor([count == 0 for count in class_counts], dtype=torch.bool)
    return absent if bool(absent.any()) else None


class AbsentClassMask(nn.Module):
    """The Fed-LT protocol's absent-class rule around any classifier: logits of ``absent`` classes become −∞.

    Applied by :func:`evaluate_client` to every client split of every algorithm (never inside one
    algorithm), so no method is masked where another is not. Wraps a model returning logits ``[B, K]``
    or ``(logits, embedding)``.
    """

    def __init__(self, model: nn.Module, absent: torch.Tensor) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("absent", absent, persistent=False)

    def forward(self, inputs):
        output = self.model(inputs)
        logits = output[0] if isinstance(output, tuple) else output
        if logits.dim() != 2 or logits.shape[1] != self.absent.numel():
            raise TaskHetError(f"the absent-class mask needs logits [B, {self.absent.numel()}], got "
                               f"{tuple(logits.shape)}")
        masked = logits.masked_fill(self.absent.to(logits.device), float("-inf"))
        return (masked, *output[1:]) if isinstance(output, tuple) else masked


def finetune_seed(seed: int, round_index: int, client_id: str) -> int:
    """The seed of a client's evaluation-time fine-tuning (independent of its training seed)."""
    return client_seed(seed, round_index, f"finetune/{client_id}")


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
