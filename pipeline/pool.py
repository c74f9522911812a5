"""The worker pool of run_pipeline.py (``--jobs N``): step-3c readings and step-4 runs in spawned processes.

Each stage is a module's ``main(argv)`` run through ``utils.stages.run_stage`` (skip if done, resume
otherwise), so a worker runs exactly what the user's numbered script runs. Workers die with the pipeline
(utils/parent_death.py), and the first failure cancels the stages not yet started.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from utils.stages import run_stage
from steps import federated as step4
from steps import meter as step3c
from utils.parent_death import die_with_parent


@dataclass(frozen=True)
class PoolStage:
    """One stage for the worker pool: its progress label, folder, stage parameters, command line and script
    (a module name with a ``main(argv)``, so that a spawned worker can import it: step 4 or step 3c)."""

    name: str
    stage_dir: Path
    params: dict[str, Any]
    argv: list[str]
    script: str = step4.__name__


def pool_summary(stages: list[PoolStage], jobs: int) -> str:
    """The console line before the pool starts, e.g. ``step 3c: 48 readings; step 4: 216 runs, 2 at a time``."""
    readings = sum(stage.script == step3c.__name__ for stage in stages)
    counted = ([f"step 3c: {readings} readings"] if readings else []) + [f"step 4: {len(stages) - readings} runs"]
    return f"{'; '.join(counted)}, {jobs} at a time in worker processes"


def init_worker(threads: int | None, parent_pid: int) -> None:
    """A pool worker process: dies with the pipeline (``parent_pid``); ``threads`` torch threads (None: torch's choice)."""
    die_with_parent(parent_pid)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def run_pool_stage(script: str, stage_dir: Path, params: dict[str, Any], argv: list[str]) -> None:
    """One stage in a worker process (module level, so a spawned process can import it)."""
    run_stage(stage_dir, params, lambda: importlib.import_module(script).main(argv))


def run_in_workers(stages: list[PoolStage], jobs: int, threads: int | None, shared_flags: Callable[[Any], list[str]],
                   progress=None) -> None:
    """Run ``stages`` ``jobs`` at a time in spawned worker processes of ``threads`` torch threads each.

    ``shared_flags(module)`` gives the flags every run of a script takes (device, progress); ``progress`` (a tqdm
    bar, or None) advances by one per finished stage. The first failure stops the rest and is raised here.
    """
    # spawn, not fork: a forked child of a process that already ran OpenMP threads (steps 2-3) can hang.
    context = multiprocessing.get_context("spawn")
    # Workers die with this process, even when it is killed with SIGKILL (utils/parent_death.py). The death
    # signal follows the thread that started a worker: submit() starts them, from this (the main) thread.
    with ProcessPoolExecutor(jobs, mp_context=context, initializer=init_worker, initargs=(threads, os.getpid())) as pool:
        futures = [pool.submit(run_pool_stage, stage.script, stage.stage_dir, stage.params,
                               [*stage.argv, *shared_flags(importlib.import_module(stage.script))])
                   for stage in stages]
        try:
            for future in as_completed(futures):
                future.result()
                if progress is not None:
                    progress.update(1)
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise
