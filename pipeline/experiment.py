"""The public face of the experiment layer: read and validate an experiment file, then run it.

``load_experiment`` reads the YAML file and hands it to its study kind (the ``study:`` key; none: the main
job), which checks every key before any work; ``run_experiment`` runs a validated config through the shared
step runner and the kind's own runner and report. ``run_pipeline.py`` is these two calls.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from pipeline.executors import Executor
from pipeline.overrides import Override, apply_overrides, dotted, parse_overrides
from pipeline.runner import Pipeline
from pipeline.shards import Shard
from pipeline.studies import MAIN_JOB, StudyKind, get_study
from utils.errors import TaskHetError
from utils.loaders import load_yaml


def load_experiment(path: Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Read, type-check, merge with its kind's defaults and validate an experiment file (errors name the key).

    Args:
        path: the YAML file.
        overrides: ``key=value`` texts (pipeline/overrides.py) applied to the file before any check, so they meet
            the same checks; the config records them under ``"overrides"``.

    The returned config records its kind under ``"study"``.
    """
    path = Path(path)
    raw = load_yaml(path, "experiment file")
    if not isinstance(raw, dict):
        raise TaskHetError(f"{path}: expected a mapping of keys at the top level, got {type(raw).__name__}")
    kind = study_kind(raw, path)
    parsed = parse_overrides(list(overrides))
    raw = apply_overrides(raw, parsed, kind.schema, kind.free_form)
    # the main job's schema has no study key (a file leaves it out; ``study: main_job`` says the same)
    try:
        config = kind.load({key: value for key, value in raw.items() if key != "study"} if kind.name == MAIN_JOB else raw,
                           path)
    except TaskHetError as error:
        named = [override.text for override in parsed if names(override, str(error))]
        raise TaskHetError(str(error) + (f" (set by the override {named[0]!r})" if named else "")) from None
    config["study"] = kind.name
    config["overrides"] = [override.text for override in parsed]
    return config


def names(override: Override, message: str) -> bool:
    """Whether a kind's error is about the key ``override`` sets, or about the list it changes an item of
    (``seeds[2]=1`` makes ``seeds lists an item twice``)."""
    path = override.path
    while len(path) > 1 and isinstance(path[-1], int):
        path = path[:-1]
    return override.key in message or dotted(path) in message


def study_kind(raw: dict[str, Any], path: Path) -> StudyKind:
    """The kind named by the file's ``study:`` key (the main job without one); an unknown name is a key error."""
    name = raw.get("study", MAIN_JOB)
    try:
        return get_study(name if isinstance(name, str) else repr(name))
    except TaskHetError as error:
        raise TaskHetError(f"{path}: study: {error}") from None


def run_experiment(config: dict[str, Any], out_dir: Path, command: str, jobs: int = 1, threads: int | None = None,
                   show_progress: bool = True, executor: Executor | None = None,
                   record: dict[str, Any] | None = None, shard: Shard | None = None) -> pd.DataFrame:
    """Run a validated config (from :func:`load_experiment`) into ``out_dir``; returns its report table.

    Args:
        command: the command line recorded in the report.
        jobs: federated runs and step-3c readings at once, each in its own process (1: in this process).
        threads: torch threads of every step (None: torch's choice).
        show_progress: draw the top-level bar.
        executor: where the federated runs and step-3c readings run, opened by
            ``pipeline.executors.open_executor`` (None: ``jobs`` local worker processes, spread over the GPUs).
        record: what was run, written to ``out_dir/config.json`` once the inputs are checked (None: nothing).
        shard: run only this shard's share of the step-4 runs and write no report (pipeline/shards.py; the table
            returned is then empty).
    """
    pipeline = Pipeline(config, Path(out_dir), command, jobs=jobs, threads=threads, show_progress=show_progress,
                        executor=executor, record=record, shard=shard)
    return get_study(config["study"]).run(pipeline)
