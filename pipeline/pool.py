"""The stages run_pipeline.py pools (step-3c readings, step-4 runs) and the local worker pool that runs them.

Each stage is a module's ``main(argv)`` run through ``utils.stages.run_stage`` (skip if done, resume
otherwise), so a worker runs exactly what the user's numbered script runs, wherever it runs: in a local
worker process (:func:`run_in_workers`, ``--jobs N``) or as a Ray task (pipeline/ray_executor.py), both
through :func:`run_pool_stage`. Local workers die with the pipeline (utils/parent_death.py), each sees one
GPU when there are any, a stage is handed to a worker only when one is free, and the first failure cancels
the stages not yet started.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import socket
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from steps import federated as step4
from steps import meter as step3c
from utils.device import VISIBLE_DEVICES
from utils.errors import TaskHetError
from utils.interrupts import WorkerStopped, stages_message, stop_workers, stoppable_worker
from utils.parent_death import die_with_parent
from utils.run_dir import atomic_write_text

STEP2 = "steps.train_centralized"  # by name: importing step 2 here would load accelerate into every pool's fork server
from utils.stages import run_stage

PLACEMENT_FILE = "placement.json"  # where and when a pooled stage ran: host, pid, visible GPUs, Ray node


@dataclass(frozen=True)
class PoolStage:
    """One stage for the worker pool: its progress label, folder, stage parameters, command line and script
    (a module name with a ``main(argv)``, so that a worker can import it: step 4 or step 3c)."""

    name: str
    stage_dir: Path
    params: dict[str, Any]
    argv: list[str]
    script: str = step4.__name__


def stage_counts(stages: list[PoolStage]) -> str:
    """What ``stages`` hold, e.g. ``step 3c: 48 readings; step 4: 216 runs`` (``step 2: 4 models`` first, where
    the pool trains centralized models)."""
    models = sum(stage.script == STEP2 for stage in stages)
    readings = sum(stage.script == step3c.__name__ for stage in stages)
    runs = len(stages) - models - readings
    parts = [f"step 2: {_counted(models, 'model')}"] if models else []
    parts += [f"step 3c: {_counted(readings, 'reading')}"] if readings else []
    parts += [f"step 4: {_counted(runs, 'run')}"] if runs or not parts else []
    return "; ".join(parts)


def _counted(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


def worker_devices(jobs: int, visible: list[str]) -> list[str]:
    """The GPU each of ``jobs`` workers sees: worker i gets ``visible[i % G]``, so runs spread over every GPU."""
    return [visible[index % len(visible)] for index in range(jobs)] if visible else []


def worker_pool(jobs: int, threads: int | None, devices: list[str] | None = None) -> ProcessPoolExecutor:
    """``jobs`` worker processes of ``threads`` torch threads, forked from a fork server that has imported this
    module once; worker i sees ``devices[i]`` (None or empty: the GPUs this process sees now).

    Not ``fork``: a forked child of a process that already ran OpenMP threads (steps 2-3) can hang; the fork
    server is a fresh interpreter that has run nothing. Not ``spawn``: each spawned worker imported torch, pandas
    and the steps again, about 4 s of CPU a worker (6 s under run_pipeline.py, whose ``__main__`` it imported
    too); forked from the server, a worker starts in milliseconds. The server starts with the first pool and
    serves every later pool of this process, with the environment of its start: so each pool passes the GPUs
    this process sees to its workers. The server also imports ``torch._dynamo``: every stage's first optimizer step
    (and ``torch.use_deterministic_algorithms``) imports it, about 1.6 s of CPU that each worker paid again.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["__main__", __name__, "torch._dynamo"])
    queue = None
    if devices:
        queue = context.Queue()
        for device in devices:
            queue.put(device)
    # Workers die with this process, even when it is killed with SIGKILL (utils/parent_death.py).
    return ProcessPoolExecutor(jobs, mp_context=context, initializer=init_worker,
                               initargs=(threads, queue, os.environ.get(VISIBLE_DEVICES)))


def init_worker(threads: int | None, devices: Any = None, parent_devices: str | None = None) -> None:
    """A pool worker process: dies with the pipeline; sees the one GPU it takes from the queue ``devices`` (None:
    ``parent_devices``, the GPUs the pipeline sees: the fork server kept the environment of the time it started);
    ``threads`` torch threads (None: torch's choice). Ctrl-C is left to the pipeline, and SIGTERM from it unwinds
    the running stage and ends the worker without a word (utils/interrupts.py, :func:`run_pool_stage`)."""
    stoppable_worker()
    die_with_parent()
    # tqdm's default lock is a named semaphore, which the resource tracker reports as leaked when a stopped worker
    # ends (os._exit runs no finalizer); a worker's bars share no lock with another process, so a thread lock does.
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    torch = sys.modules.get("torch")
    # CUDA reads the variable once, when it starts: a worker that had started it would keep every GPU.
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError("CUDA started in a pool worker before its GPU was chosen")
    visible = devices.get() if devices is not None else parent_devices
    if visible is None:
        os.environ.pop(VISIBLE_DEVICES, None)
    else:
        os.environ[VISIBLE_DEVICES] = visible
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def placement(where: dict[str, Any] | None = None) -> dict[str, Any]:
    """This process's place: host, pid, the GPUs it sees (``CUDA_VISIBLE_DEVICES``; None: unset) and ``where``."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "devices": os.environ.get(VISIBLE_DEVICES), **(where or {})}


def run_pool_stage(script: str, stage_dir: Path, params: dict[str, Any], argv: list[str],
                   where: dict[str, Any] | None = None) -> dict[str, Any]:
    """One stage in a worker (module level, so a pool worker or a Ray worker can import it).

    Returns where and when it ran (its placement record, also written to the stage's ``placement.json`` before
    its ``stage.json``), with ``ran`` False when the stage was already done (nothing was run). A local worker
    stopped by the pipeline (:class:`utils.interrupts.WorkerStopped`) ends here, once the stage has unwound.
    """
    record = {**placement(where), "started": time.time()}

    def work() -> None:
        importlib.import_module(script).main(argv)
        record["finished"] = time.time()
        atomic_write_text(Path(stage_dir) / PLACEMENT_FILE, json.dumps(record, indent=2, sort_keys=True))

    try:
        ran = run_stage(stage_dir, params, work)  # before the record is copied: work() adds its finish time
    except WorkerStopped as stopped:
        end_stopped_worker(stopped)
        raise  # not reached
    return {**record, "ran": ran}


def end_stopped_worker(stopped: WorkerStopped) -> None:
    """End this worker at once with the stop's code: raised on, the stop would reach the pool's worker loop, which
    sends it back as the stage's result and takes the next stage."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(stopped.code)


def named_failure(stage: PoolStage, error: TaskHetError) -> TaskHetError:
    """A stage's error with the stage's name in front (one line: the grid's first failure), of the same class, so a
    caller can still tell a full disk or a folder in use from other bad input."""
    message = f"{stage.name}: {error}"
    try:
        return type(error)(message)
    except TypeError:  # a subclass with another constructor
        return TaskHetError(message)


def run_in_workers(stages: list[PoolStage], jobs: int, threads: int | None,
                   on_done: Callable[[PoolStage, dict[str, Any]], None], devices: list[str] | None = None) -> None:
    """Run ``stages`` (each ``argv`` complete) ``jobs`` at a time in worker processes (:func:`worker_pool`) of
    ``threads`` torch threads each.

    ``devices`` (one per worker, from :func:`worker_devices`; None or empty: unchanged) sets each worker's
    ``CUDA_VISIBLE_DEVICES``. ``on_done(stage, placement)`` is called per finished stage, in the order of
    ``stages`` among those finishing together. The first failure stops the rest and is raised here, a
    :class:`TaskHetError` with the stage's name. Ctrl-C or SIGTERM stops every worker (each running stage unwinds,
    releasing its folder's lock, and resumes from its checkpoint on a rerun) and is raised as one
    :class:`utils.interrupts.Interrupted` naming the stages that were running and those not started.
    """
    waiting = list(stages)  # no worker has been handed these
    running: dict[Future, PoolStage] = {}
    with worker_pool(jobs, threads, devices) as pool:
        try:
            while waiting or running:
                # Only as many stages as workers: the pool would queue more, marked running though no worker has them.
                while waiting and len(running) < jobs:
                    stage = waiting[0]
                    future = pool.submit(run_pool_stage, stage.script, stage.stage_dir, stage.params, stage.argv)
                    running[future] = waiting.pop(0)
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in [future for future in running if future in finished]:
                    stage = running.pop(future)
                    try:
                        done = future.result()
                    except TaskHetError as error:
                        raise named_failure(stage, error) from error
                    on_done(stage, done)
        except KeyboardInterrupt as error:  # Ctrl-C, or SIGTERM: the workers end quietly, this process says where
            stop_workers()
            pool.shutdown(cancel_futures=True)
            raise stages_message(error, [stage.name for stage in running.values()],
                                 [stage.name for stage in waiting]) from None
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise
