"""A grid without a cluster: ``run_pipeline.py EXP --shard i/n`` runs only its share of the federated runs.

A Slurm array (or any scheduler, or n shells) starts n processes on one experiment, shard 0/n to (n−1)/n, on storage
they all see. Each runs every stage its runs depend on (step 1, the centralized models, the partitions, the step-3c
readings): a stage lock (``utils.stages.run_stage``) lets one process run a stage while the others wait for it and
then skip it, so each stage runs once. The step-4 runs, the grid's bulk, are split: shard i runs runs i, i + n,
i + 2n, … in the grid's own order (the same order in every process: it comes from the validated file). A shard
writes no report; a final call without ``--shard`` finishes whatever is left (a failed or unstarted shard's runs)
and writes the report. Each run keeps its own folder lock, so two processes never write one run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pipeline.pool import PoolStage
from steps import federated as step4
from utils.errors import TaskHetError

MAX_SHARDS = 100_000
SHARD_PATTERN = re.compile(r"^(\d+)/(\d+)$", re.ASCII)


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count`` (0 <= index < count)."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if not 1 <= self.count <= MAX_SHARDS or not 0 <= self.index < self.count:
            raise TaskHetError(f"--shard must be i/n with 1 <= n <= {MAX_SHARDS} and 0 <= i < n, got "
                               f"{self.index}/{self.count}")

    @classmethod
    def parse(cls, text: str) -> "Shard":
        """``"2/8"`` -> Shard(2, 8); anything else is one error naming the flag."""
        match = SHARD_PATTERN.match(str(text).strip())
        if match is None:
            raise TaskHetError(f"--shard must be i/n (two whole numbers: shard i of n, counted from 0), got {text!r}")
        return cls(int(match.group(1)), int(match.group(2)))

    @property
    def label(self) -> str:
        return f"{self.index}/{self.count}"

    @property
    def folder_name(self) -> str:
        """The name of the shard's lock folder under ``<results>/<name>/shards/``."""
        return f"{self.index}-of-{self.count}"

    def share(self, stages: list[PoolStage]) -> list[PoolStage]:
        """The stages this shard runs: its share of the step-4 runs (every count-th, from index, in the given order),
        and every other stage (models and readings the runs depend on; the stage lock runs each once)."""
        runs = [stage for stage in stages if stage.script == step4.__name__]
        mine = set(map(id, runs[self.index::self.count]))
        return [stage for stage in stages if stage.script != step4.__name__ or id(stage) in mine]
