"""The main job's experiment-file keys: every key with its default (:data:`SCHEMA`), its type (:data:`TYPES`) and what
it does (:data:`HELP`, which the experiment-key reference shows). The checks that read them live in
:mod:`pipeline.studies.main_job.config`."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from partitioning.client_tests import CLIENT_TESTS, DEFAULT_TEST_FRACTION, HELD_OUT
from partitioning.groupings import GROUPINGS
from partitioning.assignments import MAX_ALPHA, MAX_CLIENTS
from partitioning.temporal import MAX_ROUNDS
from pipeline.schema import LEARNING_RATE, MOMENTUM, SHARED_TYPES, Bool, Check, Float, Int, ListOf, Mapping, Optional, Str
from pipeline.sections import LOCAL_TRAINING_HELP, SHARED_HELP, shared_sections
from steps.embed import MAX_PCA_DIM
from steps.federated import MAX_LOCAL_STEPS
from utils.cli import MAX_BATCH_SIZE, MAX_CLUSTERS

IID_SCHEME = "iid"
# Every key an experiment file may set, with its default. Nested dicts are sections.
SCHEMA: dict[str, Any] = {
    "name": "experiment",
    **shared_sections(),
    "tasks": ["depth_euclidean", "normal", "segment_semantic", "class_scene"],
    # allow_untrained: embed a centralized model whose best epoch is 0, the untrained one (step 3's --allow_untrained;
    # refused otherwise): only for a pipeline that tests plumbing, not embeddings. No stage key holds it
    "embeddings": {"n_clusters": 10, "pca_dim": None, "allow_untrained": False},
    "partition": {
        "groupings": list(GROUPINGS),
        "scheme": "dirichlet_mixture",
        "alphas": [0.1, 1.0],
        "property_alphas": None,  # the positive control's α (property_based in groupings); None: every alphas value
        "n_clients": 10,
        "client_test_fraction": DEFAULT_TEST_FRACTION,  # client_tests held_out: share of each client's rows held out as its test set
        "client_tests": HELD_OUT,  # or test_split: the manifest's test rows, dealt to clients (step 3b --client_tests)
        "size_skew": None,
        "temporal": None,  # temporal skew (step 3b's --temporal, scheduled up to federated.n_rounds)
        "skews": {},  # step 3b's per-client skews by flag name, e.g. {feature_noise: 0.2, label_swap: 1, concept_fraction: 0.3}
        "iid_reference": False,  # also run every algorithm and seed on an iid partition (the report's reference)
    },
    "heterogeneity_meter": True,  # step 3c: G² and B² of every label/embedding partition at the centralized model
    "federated": {
        "algorithms": {"fedavg": {}, "fedprox": {"mu": 0.01}, "scaffold": {}, "fedrep": {}},
        "n_rounds": 10,
        "local_steps": 5,
        "batch_size": 16,
        "init_lr": 0.01,
        "task_init_lr": {},  # task -> its own local learning rate (tasks not listed use init_lr)
        "per_task": {},  # task -> {federated key: value} for that task's runs (e.g. a cheap head trains longer)
        "momentum": 0.0,  # local SGD momentum (a fresh buffer each round)
        "weight_decay": 0.0,  # local SGD weight decay
        "lr_schedule": "constant",
        "client_fraction": 1.0,
        "eval_every": 1,
        "checkpoint_every": 1,  # step 4 writes checkpoint.pt every this many rounds (a killed run redoes the rest)
        "init_from": "scratch",
        "privacy": {},  # step 4's client-level DP flags by name, e.g. {dp_clip: 0.15, dp_target_epsilon: 8}
    },
    "seeds": [0, 1],
    "use_accelerator": True,
    # TensorBoard logs of every step-2 and step-4 run, in its own folder (run_pipeline.py --tensorboard says the same);
    # how a run shows itself, not what it computes: no stage key holds it
    "tensorboard": False,
    # Each step-2, step-3b and step-4 stage's own pictures (curves.png, the heatmap; run_pipeline.py --no-run_plots says the
    # same); the report's pictures are always drawn. How a run shows itself, not what it computes: no stage key holds it
    "run_plots": True,
}
# Sections whose values are free-form mappings (algorithm name -> its hyperparameters).
FREE_FORM = frozenset({"federated.algorithms", "federated.task_init_lr", "federated.per_task", "federated.privacy",
                       "partition.skews"})
# federated keys that federated.per_task may not change: the grid and the other per-task mappings.
NOT_PER_TASK = ("algorithms", "task_init_lr", "per_task", "privacy")

TYPES: dict[str, Check] = {
    **SHARED_TYPES,
    "tasks": ListOf(Str()),
    "embeddings.n_clusters": Int(1, MAX_CLUSTERS),
    "embeddings.pca_dim": Optional(Int(1, MAX_PCA_DIM)),
    "embeddings.allow_untrained": Bool(),
    "partition.groupings": ListOf(Str()),
    "partition.scheme": Str(),
    "partition.alphas": ListOf(Float(0, MAX_ALPHA, low_open=True)),
    "partition.property_alphas": Optional(ListOf(Float(0, MAX_ALPHA, low_open=True))),
    "partition.n_clients": Int(1, MAX_CLIENTS),
    "partition.client_test_fraction": Float(0, 1, high_open=True),
    "partition.client_tests": Str(CLIENT_TESTS),
    "partition.size_skew": Optional(Str()),
    "partition.temporal": Optional(Str()),
    "partition.skews": Mapping("map step 3b's skew flags to values", "{feature_noise: 0.2, label_swap: 1}", allow_empty=True),
    "partition.iid_reference": Bool(),
    "federated.algorithms": Mapping(),
    "federated.n_rounds": Int(1, MAX_ROUNDS),
    "federated.local_steps": Int(1, MAX_LOCAL_STEPS),
    "federated.batch_size": Int(1, MAX_BATCH_SIZE),
    "federated.init_lr": LEARNING_RATE,
    "federated.task_init_lr": Mapping("map task names to their learning rates", "{class_scene: 0.05}", allow_empty=True),
    "federated.per_task": Mapping("map task names to the federated keys their runs change",
                                  "{class_scene: {batch_size: 64, lr_schedule: cosine}}", allow_empty=True),
    "federated.momentum": MOMENTUM,
    "federated.weight_decay": Float(0, 1),
    "federated.lr_schedule": Str(),
    "federated.client_fraction": Float(0, 1, low_open=True),
    "federated.eval_every": Int(1, MAX_ROUNDS),
    "federated.checkpoint_every": Int(1, MAX_ROUNDS),
    "federated.init_from": Str(("scratch", "centralized")),
    "federated.privacy": Mapping("map step 4's --dp_* flags to values", "{dp_clip: 0.15, dp_target_epsilon: 8}",
                                 allow_empty=True),
    "heterogeneity_meter": Bool(),
    "tensorboard": Bool(),
    "run_plots": Bool(),
}

# What each key of the main job does (the reference page prints it; a test requires one for every key of TYPES).
HELP = MappingProxyType({
    **SHARED_HELP, **LOCAL_TRAINING_HELP,
    "tasks": "the tasks studied, each with its own models through every step (tasks the data source can feed)",
    "embeddings.n_clusters": "step 3: KMeans clusters of the centralized model's embeddings, the groups of an "
                             "embedding-based partition",
    "embeddings.pca_dim": "step 3: PCA components before KMeans (null: no PCA)",
    "embeddings.allow_untrained": "step 3: embed a centralized model whose best epoch is 0, the untrained one (refused "
                                  "otherwise): only for a pipeline that tests the plumbing, not the embeddings",
    "partition.groupings": "what the clients are drawn from: label_based (the scene labels) and embedding_based (step 3's "
                           "clusters), compared at equal α; add property_based for the positive control (quantile bins "
                           "of each sample's mean target, as many as embeddings.n_clusters; dense tasks only)",
    "partition.scheme": "step 3b's partition scheme (a registered scheme), for every grouping and α",
    "partition.alphas": "the Dirichlet concentrations α: one partition per grouping and α (smaller: more heterogeneous)",
    "partition.property_alphas": "the α values of the positive control's property_based partitions, each one of "
                                 "partition.alphas (null: all of them): the control can cost less than the question",
    "partition.n_clients": "clients of every partition",
    "partition.client_test_fraction": "partition.client_tests held_out: share of each client's rows held out as its "
                                      "test set",
    "partition.client_tests": "where each client's test rows come from: held_out (a share of its own rows) or "
                              "test_split (the manifest's test rows, dealt to the clients)",
    "partition.size_skew": "quantity skew of the clients' sizes: lognormal:SIGMA or powerlaw:A (null: equal sizes)",
    "partition.temporal": "temporal skew: rotate:PHASES:ROUNDS_PER_PHASE or abrupt:ROUND, scheduled up to "
                          "federated.n_rounds (null: every row held every round)",
    "partition.skews": "step 3b's per-client skews by flag name, e.g. {feature_noise: 0.2, label_swap: 1}",
    "partition.iid_reference": "also run every task, algorithm and seed on an iid partition: the report's reference",
    "federated.algorithms": "the algorithms run on every partition, each with its settings (the algorithms page)",
    "federated.n_rounds": "step 4: federated rounds of every run",
    "federated.local_steps": "step 4: local SGD steps J of each sampled client per round",
    "federated.task_init_lr": "a task's own local learning rate (a task not listed uses federated.init_lr)",
    "federated.per_task": "a task's own federated keys for its runs (e.g. a cheap head trains longer)",
    "federated.eval_every": "step 4: evaluate the global model every this many rounds",
    "federated.checkpoint_every": "step 4: write checkpoint.pt every this many rounds (a killed run redoes the rounds "
                                  "after the last one)",
    "federated.init_from": "the federated runs' starting model: scratch (untrained) or centralized (step 2's model)",
    "federated.privacy": "step 4's client-level differential privacy, its --dp_* flags by name (dp_clip, "
                         "dp_noise_multiplier, dp_target_epsilon, dp_delta, dp_adaptive_quantile, dp_clip_lr, "
                         "dp_count_noise); every algorithm then needs weighting: uniform (empty: no DP)",
    "heterogeneity_meter": "step 3c: G² and B² of every label- and embedding-based partition at the centralized model",
    "tensorboard": "TensorBoard logs of every step-2 and step-4 run (run_pipeline.py --tensorboard says the same)",
    "run_plots": "each step-2, step-3b and step-4 stage's own pictures (curves.png, the partition's heatmap); the "
                 "report's pictures are always drawn",
})
