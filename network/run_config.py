"""A federated run's inputs: :class:`RunConfig`, and the checks it passes before anything is read or written.

:class:`RunConfig` holds every input of a run: what ``test_fed.py`` parses, what an experiment file's federated
section gives, and what a Flower deployment carries in its run config (serialised generically:
:meth:`RunConfig.to_json`). :func:`resolve` checks it against itself and against the assignment file's sidecar;
:func:`check_flower_counts` the Flower engine's counts against the clients. ``network.run`` builds and runs what
they describe.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from network.client_data import LOCAL_TESTS
from network.diagnostics import check_diagnostics_options
from network.privacy import DEFAULT_CLIP_LR, PrivacySettings, check_dp_algorithm
from network.local_work import LocalWork, check_not_lockstep, client_step_budgets, parse_steps_range
from partitioning.assignments import UNSEEN_KEY
from partitioning.groupings import EMBEDDING_BASED, LABEL_BASED
from utils.errors import TaskHetError

ENGINES = ("sequential", "flower")
DP_FLAGS = ("dp_noise_multiplier", "dp_target_epsilon", "dp_delta", "dp_adaptive_quantile", "dp_clip_lr",
            "dp_count_noise")  # round loops over the same algorithm objects
# Fields that do not change what a run computes: a resumed run may differ in them.
NOT_IN_SIGNATURE = ("out", "resume", "use_accelerator", "num_workers", "cache_dir", "deterministic", "n_rounds",
                    "eval_every", "checkpoint_every", "checkpoint_minutes", "keep_client_state", "diagnostics", "progress", "client_state_memory_mb", "engine", "flower_mode", "flower_num_cpus",
                    "flower_num_gpus", "flower_num_nodes", "min_available_clients", "threads", "tensorboard", "round_lines", "plots",
                    "diagnostics_every", "diagnostics_max_samples")


@dataclass(frozen=True)
class RunConfig:
    """Every input of one federated run (``test_fed.py --help`` documents each field as a flag).

    ``settings`` holds the algorithm's own settings (name -> value), checked against the
    algorithm's ``Settings`` by :func:`network.algorithms.build_algorithm`.
    """

    task: str
    method: str = "fedavg"
    settings: dict[str, Any] = field(default_factory=dict)
    manifest: Path = Path("results/datapoints/manifest.csv")
    data_path: Path = Path("data/synthetic")
    assignments: Path | None = None
    assignment_files_path: Path = Path("results/assignments")
    type: str | None = None
    alpha: float | None = None
    n_clients: int | None = None
    n_clusters: int = 10
    encoder: str = "resnet50"
    weights: str = "none"
    freeze_encoder: bool = False
    cache_features: bool = False
    decoder_width: int | None = None
    init_from: str = "scratch"
    centralized_checkpoint: Path | None = None
    image_size: int = 224
    n_rounds: int = 100
    local_steps: int | None = None
    local_epochs: int | None = None
    batch_size: int = 16
    init_lr: float = 0.01
    lr_schedule: str = "constant"
    momentum: float = 0.0
    weight_decay: float = 0.0
    client_fraction: float = 1.0
    straggler_fraction: float = 0.0
    straggler_share: float = 0.5
    local_steps_range: str | None = None
    calibration_fraction: float = 0.0
    finetune_steps: int = 0
    local_test: str = "assigned"
    diagnostics: bool = False
    diagnostics_every: int = 1
    diagnostics_max_samples: int | None = None
    eval_every: int = 1
    checkpoint_every: int = 1
    checkpoint_minutes: float | None = None
    keep_client_state: bool = False
    rand_seed: int = 42
    deterministic: bool = False
    use_accelerator: bool = True
    num_workers: int = 0
    cache_dir: Path | None = None
    client_state_memory_mb: float = 2048
    progress: bool = True
    threads: int | None = None
    tensorboard: bool = False
    round_lines: bool = True
    plots: bool = True
    resume: bool = True
    out: Path | None = None
    engine: str = "sequential"
    vectorize_clients: bool = False
    vectorize_chunk: int = 32
    flower_mode: str = "simulation"
    flower_num_cpus: float = 1.0
    flower_num_gpus: float = 0.0
    flower_num_nodes: int | None = None
    min_available_clients: int | None = None
    dp_clip: float | None = None
    dp_noise_multiplier: float | None = None
    dp_target_epsilon: float | None = None
    dp_delta: float = 1e-5
    dp_adaptive_quantile: float | None = None
    dp_clip_lr: float = DEFAULT_CLIP_LR
    dp_count_noise: float | None = None

    def __post_init__(self) -> None:
        """Every RunConfig is checked where it is made (test_fed.py, the pipeline, a Flower deployment's JSON): its
        numbers are finite and its algorithm's settings pass that algorithm's own ``Settings``, so both engines and
        the Flower app refuse the same values with the same message."""
        from network.algorithms.base import get_settings_class
        from network.settings import build_settings

        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if isinstance(value, float) and not math.isfinite(value) and not (item.name == "dp_clip" and value == math.inf):
                raise TaskHetError(f"--{item.name} must be a finite number, got {value!r}")
        check_diagnostics_options(self.diagnostics_every, self.diagnostics_max_samples)
        if self.engine == "flower" and self.checkpoint_minutes is not None:
            raise TaskHetError("--checkpoint_minutes: the Flower engine's clients keep their state on their nodes, so it "
                               "checkpoints every round (drop --checkpoint_minutes)")
        if self.engine == "flower" and self.checkpoint_every != 1:
            raise TaskHetError(f"--checkpoint_every {self.checkpoint_every}: the Flower engine's clients keep their state "
                               "on their nodes, so a checkpoint older than the last round could not resume them; "
                               "it checkpoints every round (drop --checkpoint_every)")
        if not isinstance(self.settings, dict):
            raise TaskHetError(f"the run's settings must map setting names to values, got {self.settings!r}")
        settings = build_settings(get_settings_class(self.method), self.settings, self.method)
        check_private_run(self, settings)

    def to_json(self) -> str:
        """Every field as JSON (paths as strings): what a Flower deployment's run config carries."""
        return json.dumps(dataclasses.asdict(self), default=str, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RunConfig":
        """The inverse of :meth:`to_json` (paths restored from the field types)."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise TaskHetError(f"the run config is not valid JSON (line {error.lineno}: {error.msg})") from None
        names = {item.name for item in dataclasses.fields(cls)}
        if not isinstance(values, dict) or "task" not in values or set(values) - names:
            unknown = sorted(set(values) - names) if isinstance(values, dict) else []
            raise TaskHetError("the run config must be a RunConfig as JSON with a 'task'"
                               + (f"; unknown field(s): {', '.join(unknown)}" if unknown else ""))
        paths = {item.name for item in dataclasses.fields(cls) if "Path" in str(item.type)}
        return cls(**{key: Path(value) if key in paths and value is not None else value for key, value in values.items()})

    def replace(self, **changes: Any) -> "RunConfig":
        return dataclasses.replace(self, **changes)


def check_flower_counts(config: RunConfig, n_clients: int) -> None:
    """The Flower engine's counts against the run's ``n_clients``: ``--min_available_clients`` (at most the clients a
    round samples) and ``--flower_num_nodes`` (at most the clients). Nothing to check for another engine."""
    if config.engine != "flower":
        return
    from network.flower.server import check_min_available  # only here: the sequential path never imports flwr
    from network.flower.simulation import check_num_nodes

    check_min_available(config.min_available_clients, n_clients, config.client_fraction)
    check_num_nodes(config.flower_num_nodes, n_clients)


def resolve(config: RunConfig, meta: dict) -> RunConfig:
    """Check the config against itself and against the assignment file's sidecar ``meta``."""
    if config.local_steps is not None and config.local_epochs is not None:
        raise TaskHetError("pass one of --local_steps (--sgd_per_epoch) and --local_epochs, not both")
    if config.local_steps is None and config.local_epochs is None:
        config = config.replace(local_steps=50)
    # Groups are a clusters CSV (embedding-based) or a manifest column (label-based).
    kind = EMBEDDING_BASED if str(meta.get("groups", "")).endswith(".csv") else LABEL_BASED
    for name, given, recorded in (("type", config.type, kind if meta else None),
                                  ("n_clients", config.n_clients, meta.get("n_clients")),
                                  ("alpha", config.alpha, meta.get("alpha"))):
        if given is not None and recorded is not None and given != recorded:
            raise TaskHetError(f"--{name} {given} does not match {config.assignments}, made with {name} {recorded}")
    config = config.replace(type=config.type or kind, alpha=config.alpha if config.alpha is not None else meta.get("alpha"))
    if config.init_from == "centralized" and config.centralized_checkpoint is None:
        raise TaskHetError("--init_from centralized needs --centralized_checkpoint (a step-2 best.pt)")
    if not 0 <= config.calibration_fraction < 1:
        raise TaskHetError(f"--calibration_fraction must be in [0, 1), got {config.calibration_fraction}")
    if config.calibration_fraction and config.engine != "sequential":
        raise TaskHetError(f"--calibration_fraction needs --engine sequential (the {config.engine} engine has no "
                           "server-side calibration yet)")
    if meta.get(UNSEEN_KEY) and config.engine != "sequential":
        raise TaskHetError(f"{config.assignments} holds out unseen clients (assignments.json's {UNSEEN_KEY}), which "
                           f"the {config.engine} engine does not evaluate: run it with --engine sequential")
    if config.vectorize_clients and config.engine != "sequential":
        raise TaskHetError(f"--vectorize_clients needs --engine sequential (the {config.engine} engine trains each "
                           "client on its own node)")
    work = local_work(config)
    client_step_budgets(work, config.local_steps, [], config.rand_seed)  # --local_epochs with unequal work: refused
    check_not_lockstep(not work.is_equal, config.vectorize_clients)
    if config.vectorize_chunk < 1:
        raise TaskHetError(f"--vectorize_chunk must be >= 1, got {config.vectorize_chunk}")
    if config.local_test not in LOCAL_TESTS:
        raise TaskHetError(f"--local_test must be one of {', '.join(LOCAL_TESTS)}, got {config.local_test!r}")
    if config.finetune_steps < 0:
        raise TaskHetError(f"--finetune_steps must be >= 0, got {config.finetune_steps}")
    if config.out is None:
        config = config.replace(out=Path("results/test_federated") / config.task / config.type / config.method
                                / f"a{config.alpha}-s{config.rand_seed}")
    return config


def privacy_settings(config: RunConfig) -> PrivacySettings | None:
    """The run's client-level DP settings (None: no DP, ``--dp_clip`` not given)."""
    if config.dp_clip is None:
        return None
    return PrivacySettings(config.dp_clip, config.dp_noise_multiplier, config.dp_target_epsilon, config.dp_delta,
                           config.dp_adaptive_quantile, config.dp_clip_lr, config.dp_count_noise)


def check_private_run(config: RunConfig, settings: Any) -> None:
    """Client-level DP's checks that need no file: its settings, the algorithm, the weighting (one line each)."""
    from network.algorithms.base import ALGORITHMS

    if config.dp_clip is None:
        given = [name for name in DP_FLAGS if getattr(config, name) != getattr(RunConfig, name)]
        if given:
            raise TaskHetError(f"--{given[0]} needs --dp_clip C (client-level DP is on when a clipping norm is given)")
        return
    privacy_settings(config)
    check_dp_algorithm(ALGORITHMS.get(config.method), settings)


def local_work(config: RunConfig) -> LocalWork:
    """The run's unequal-local-work settings (network/local_work.py)."""
    return LocalWork(config.straggler_fraction, config.straggler_share, parse_steps_range(config.local_steps_range))
