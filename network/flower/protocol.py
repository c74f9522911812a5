"""The message protocol of the Flower engine: every name the ServerApp and the ClientApp share, and the transport.

Both halves import their record names, config keys and the encoders/decoders below
from here, so a key cannot be spelt one way on the server and another on a node.

A message is a Flower ``RecordDict``:

* train (server -> node): ``ORDERS_RECORD`` (run key, algorithm, client id, round, seed,
  local-training settings, ``BUNDLE_GROUPS``) and one ArrayRecord ``broadcast/<group>``
  per non-empty group of ``algorithm.broadcast(server)``.
* train reply: ``REPLY_RECORD`` (client id, number of samples, ``BUNDLE_GROUPS``), one
  ArrayRecord ``upload/<group>`` per non-empty group of the upload, ``TRAIN_METRICS_RECORD``.
* evaluate (server -> node): ``ORDERS_RECORD`` (as for train, plus ``GLOBAL_MODEL_NAME``,
  ``MODEL_NAMES`` and the fine-tuning settings) and one ArrayRecord ``model/<name>`` per
  server model (``personal_model`` reads them all).
* evaluate reply: one MetricRecord ``split/<split>`` per split ``evaluate_client`` returned.
* gradient (``--diagnostics``; an evaluate message whose orders hold ``GRADIENT_SEED`` and
  ``GRADIENT_MAX_SAMPLES``): the global model only, as ``model/<name>``; its reply: the client's
  flat ∇F_k at it (``network.diagnostics.client_gradient``) as ``GRADIENT_RECORD``.
* query (server -> node) and its reply: ``HOSTED_CLIENTS``.

Empty groups: a bundle group may be empty (SCAFFOLD's control variate c in round 1).
The group names travel in the ConfigRecord (``BUNDLE_GROUPS``) and only non-empty
groups as ArrayRecords, so an empty group comes back as ``{}`` whatever a Flower
transport does with an ArrayRecord that holds no arrays.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from network.aggregation import Weights
from network.algorithms.base import Bundle
from network.client import Finetune
from utils.errors import TaskHetError

# ----- record names -----
ORDERS_RECORD = "orders"  # ConfigRecord: what the server asks of a node (keys below)
REPLY_RECORD = "reply"  # ConfigRecord: a node's answer (client id, number of samples, hosted clients)
TRAIN_METRICS_RECORD = "train-metrics"  # MetricRecord: ClientResult.metrics
BROADCAST_PREFIX = "broadcast/"  # + group: ArrayRecord of one broadcast group
UPLOAD_PREFIX = "upload/"  # + group: ArrayRecord of one upload group
MODEL_PREFIX = "model/"  # + model name: ArrayRecord of one server model (evaluation)
SPLIT_PREFIX = "split/"  # + split name: MetricRecord of one evaluation split
GRADIENT_RECORD = "gradient"  # ArrayRecord {GRADIENT_RECORD: flat ∇F_k}: a client's gradient at the global model

# ----- config keys of ORDERS_RECORD and REPLY_RECORD -----
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
BUNDLE_GROUPS = "groups"  # every group name of the bundle in the message, empty ones included
MODEL_NAMES = "models"  # every server model name in an evaluate message
GLOBAL_MODEL_NAME = "global-model"  # which of them is the global model
FINETUNE_STEPS = "finetune-steps"  # evaluation-time fine-tuning (network.client.Finetune); 0 = off
FINETUNE_LR = "finetune-lr"
FINETUNE_MOMENTUM = "finetune-momentum"
FINETUNE_WEIGHT_DECAY = "finetune-weight-decay"
FINETUNE_SEED = "finetune-seed"  # network.client.finetune_seed for (root seed, round, client)
RESET_STATE = "reset-state"  # discovery on a fresh start: the node drops its states of this run
NUM_SAMPLES = "num-samples"
HOSTED_CLIENTS = "client-ids"
GRADIENT_SEED = "gradient-seed"  # network.diagnostics.gradient_seed for (root seed, client): asks for ∇F_k
GRADIENT_MAX_SAMPLES = "gradient-max-samples"  # --diagnostics_max_samples; 0 = every train row

# ----- node config (flower-supernode --node-config; the simulation sets partition-id/num-partitions) -----
PARTITION_ID = "partition-id"
NUM_PARTITIONS = "num-partitions"
PARTITION_IDS = "partition-ids"  # a real node: comma-separated client ids whose data it holds
STATE_DIR = "state-dir"  # a real node: where it keeps client state
NODE_PATHS = (("data-path", "data_path"), ("manifest", "manifest"), ("assignments", "assignments"),
              ("centralized-checkpoint", "centralized_checkpoint"))  # (node config key, RunConfig field)

# ----- run config (flwr run --run-config) -----
RUN_CONFIG = "run-config"  # network.run_config.RunConfig.to_json()
REPLY_TIMEOUT = "reply-timeout-s"  # a client silent this long counts as failed; 0: wait
NODE_WAIT = "node-wait-s"  # how long the server waits for nodes hosting every client


def to_record(weights: Weights) -> ArrayRecord:
    """Tensors as a Flower ArrayRecord (copied to the CPU; dtypes, shapes and key order kept)."""
    return ArrayRecord.from_torch_state_dict(weights)


def from_record(record: ArrayRecord, device: torch.device) -> Weights:
    """An ArrayRecord back as tensors on ``device`` (bit-identical values)."""
    return {key: value.to(device) for key, value in record.to_torch_state_dict().items()}


def bundle_records(prefix: str, bundle: Mapping[str, Weights]) -> tuple[dict[str, ArrayRecord], list[str]]:
    """A bundle as ArrayRecords named ``prefix + group`` (non-empty groups only) and its group names (all).

    The names go into the message's ConfigRecord under ``BUNDLE_GROUPS`` (``MODEL_NAMES`` for models).
    """
    records = {prefix + group: to_record(weights) for group, weights in bundle.items() if weights}
    return records, list(bundle)


def read_bundle(content: RecordDict, prefix: str, groups: list[str], device: torch.device) -> Bundle:
    """The inverse of :func:`bundle_records`: every listed group, ``{}`` for one sent without a record.

    Raises:
        TaskHetError: a record under ``prefix`` whose group is not listed (sender and receiver disagree).
    """
    unlisted = [name for name in content if name.startswith(prefix) and name[len(prefix):] not in groups]
    if unlisted:
        raise TaskHetError(f"the message holds records {unlisted} that its group list {groups} does not name")
    return {group: from_record(content[prefix + group], device) if prefix + group in content else {}
            for group in groups}


def split_records(splits: Mapping[str, Mapping[str, float]]) -> dict[str, MetricRecord]:
    """``evaluate_client``'s splits (split -> metric -> value) as MetricRecords named ``split/<split>``."""
    return {SPLIT_PREFIX + split: MetricRecord({metric: float(value) for metric, value in metrics.items()})
            for split, metrics in splits.items()}


def read_splits(content: RecordDict) -> dict[str, dict[str, float]]:
    """The inverse of :func:`split_records`."""
    return {name[len(SPLIT_PREFIX):]: floats(record) for name, record in content.items()
            if name.startswith(SPLIT_PREFIX)}


def floats(record: MetricRecord) -> dict[str, float]:
    """A MetricRecord as ``metric -> float``."""
    return {key: float(value) for key, value in record.items()}


def local_training(lr: float, local_steps: int | None, local_epochs: int | None, momentum: float,
                   weight_decay: float) -> dict[str, Any]:
    """Orders entries of one round's local training (the fields of ``ClientConfig`` the server decides)."""
    return {LR: float(lr), LOCAL_STEPS: local_steps or 0, LOCAL_EPOCHS: local_epochs or 0,
            MOMENTUM: float(momentum), WEIGHT_DECAY: float(weight_decay)}


def read_local_training(orders: ConfigRecord) -> dict[str, Any]:
    """``ClientConfig`` keyword arguments from :func:`local_training`'s entries."""
    return {"lr": float(orders[LR]), "local_steps": int(orders[LOCAL_STEPS]) or None,
            "local_epochs": int(orders[LOCAL_EPOCHS]) or None, "momentum": float(orders[MOMENTUM]),
            "weight_decay": float(orders[WEIGHT_DECAY])}


def finetuning(finetune: Finetune, seed: int) -> dict[str, Any]:
    """Orders entries of an evaluation's fine-tuning and its seed."""
    return {FINETUNE_STEPS: int(finetune.steps), FINETUNE_LR: float(finetune.lr),
            FINETUNE_MOMENTUM: float(finetune.momentum), FINETUNE_WEIGHT_DECAY: float(finetune.weight_decay),
            FINETUNE_SEED: int(seed)}


def read_finetuning(orders: ConfigRecord) -> tuple[Finetune, int]:
    """The inverse of :func:`finetuning`: the Finetune settings and the seed."""
    return (Finetune(int(orders[FINETUNE_STEPS]), float(orders[FINETUNE_LR]), float(orders[FINETUNE_MOMENTUM]),
                     float(orders[FINETUNE_WEIGHT_DECAY])), int(orders[FINETUNE_SEED]))
