"""A study's grid: partitions (or named situations) × local steps J × algorithm variants × seeds.

The values here are already validated (pipeline/studies/grid/config.py builds them from the study file);
this module only names them, expands the grid into runs and derives each run's rounds. The runner
(pipeline/studies/grid/runner.py) and every grid study report read runs through these classes.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any

from utils.errors import TaskHetError

# Short names of scheme parameters in folder names and report rows (nc_shards-nc5, dirichlet_split-a0.1).
PARAM_LABELS = {"groups_per_client": "nc", "alpha": "a", "size_skew": "skew"}
UNSAFE_IN_LABEL = re.compile(r"[^A-Za-z0-9._-]")  # a label names a folder: lognormal:1.0 becomes lognormal_1.0


@dataclass(frozen=True)
class Partition:
    """A registered scheme with its step-3b options; ``label`` names its folder and report rows.

    Attributes:
        scheme: the registered partition scheme.
        params: every other step-3b option of the entry (scheme parameters such as ``alpha``, ``size_skew``, and any
            step-3b flag the entry sets), sorted by name.
        situation: the entry's name in a heterogeneity study (``mild_label_skew``); it is the label when given.
        class_groups: the classes of each group, when clients are drawn from groups of classes: the study writes a
            groups file mapping every sample to the index of its class's group and passes it as step 3b's
            ``--groups`` (so ``nc_shards`` with one group per client gives every client one group's classes).
        work: the situation's unequal local work, step 4's options (``straggler_fraction``, ``straggler_share``,
            ``local_steps_range``: network/local_work.py), sorted by name; empty: every client takes J steps.
    """

    scheme: str
    params: tuple[tuple[str, Any], ...]
    situation: str | None = None
    class_groups: tuple[tuple[int, ...], ...] | None = None
    work: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        if self.situation:
            return self.situation
        parts = [self.scheme] + [f"{PARAM_LABELS.get(key, key)}{value}" for key, value in self.params + self.work]
        return UNSAFE_IN_LABEL.sub("_", "-".join(parts))

    @property
    def groups_per_client(self) -> int | None:
        return dict(self.params).get("groups_per_client")


@dataclass(frozen=True)
class Variant:
    """An algorithm with one value of each setting; ``label`` names its folder and report rows."""

    algorithm: str
    settings: tuple[tuple[str, Any], ...]

    @property
    def label(self) -> str:
        return "-".join([self.algorithm] + [f"{key}{value}" for key, value in self.settings])


@dataclass(frozen=True)
class StudyRun:
    """One federated run of the study grid."""

    partition: Partition
    local_steps: int
    variant: Variant
    seed: int


def study_runs(config: dict[str, Any]) -> list[StudyRun]:
    """Every federated run of the grid in block order, each (partition, J, variant, seed) once."""
    runs = [StudyRun(partition, local_steps, variant, int(seed))
            for block in config["grid"]
            for partition, local_steps, variant, seed in itertools.product(block["partitions"], block["local_steps"],
                                                                            block["variants"], config["seeds"])]
    return list(dict.fromkeys(runs))


def rounds_for(config: dict[str, Any], local_steps: int) -> int:
    """Rounds of a run with J local steps: the budget rounds × J over J (a TaskHetError if J does not divide it)."""
    budget = config["federated"]["rounds_x_local_steps"]
    if budget % local_steps:
        raise TaskHetError(f"federated.rounds_x_local_steps {budget} is not a multiple of local_steps {local_steps}: "
                           "rounds × J could not stay constant")
    return budget // local_steps
