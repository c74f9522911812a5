"""Where the pipeline's pooled stages run (run_pipeline.py ``--executor``): the local worker pool or a Ray cluster.

Both executors run a list of :class:`pipeline.pool.PoolStage` (step-3c readings, step-4 runs) with one contract:
each stage runs through ``pipeline.pool.run_pool_stage`` (skip if done, resume from its checkpoint, the folder's
lock, atomic outputs), ``on_done(stage, placement)`` is called once per finished stage, and the first failure is
raised as one :class:`TaskHetError` naming the stage. Where a stage runs changes nothing in its folder's results
(metrics.csv is the same file byte for byte), so these settings are flags of run_pipeline.py, never experiment
keys, and enter no stage key.

- ``local`` (the default): ``--jobs N`` worker processes on this machine (1: the pipeline's own process,
  one stage after another). With G visible GPUs, worker i sees only GPU ``i mod G``.
- ``ray``: every stage is a Ray task declaring ``--cpus_per_run`` CPUs and ``--gpus_per_run`` GPUs, on the cluster
  at ``--ray_address`` (none: a Ray instance started on this machine); Ray places it and sets its
  ``CUDA_VISIBLE_DEVICES``. A task whose node dies is retried (``--max_retries``) and resumes from its checkpoint.
  The code lives in pipeline/ray_executor.py, imported only when chosen (Ray is an optional dependency).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

from tqdm.auto import tqdm

from pipeline.pool import PoolStage, run_in_workers, worker_devices
from utils import cli
from utils.device import VISIBLE_DEVICES, visible_gpu_ids
from utils.errors import TaskHetError
from utils.progress import clock_text, eta_text, seconds_left
from utils.registry import Registry

GPU_FRACTIONS = cli.floats(0.0, 1.0, low_open=True)  # --gpus_per_run: a share of one GPU (a run uses one device)
CPUS_PER_RUN = cli.floats(0.0, cli.MAX_THREADS, low_open=True)
MAX_RETRIES = 100  # --max_retries: tries after a task's worker or node died, beyond the first
RETRIES = cli.ints(0, MAX_RETRIES)
DEFAULT_MAX_RETRIES = 3
RAY_ONLY = ("ray_address", "cpus_per_run", "max_retries")  # settings the local executor has no use for

OnDone = Callable[[PoolStage, dict[str, Any]], None]


@dataclass(frozen=True)
class ExecutorSettings:
    """Where the pooled stages run (run_pipeline.py's flags; None: the flag was not given).

    Attributes:
        executor: a name in :data:`EXECUTORS` (``local`` or ``ray``).
        jobs: local: worker processes (None: 1, the pipeline's own process); ray: runs in flight at most
            (None: as many as the cluster's resources allow).
        threads: torch threads a local worker starts with (None: torch's choice); each stage then sets its own
            from its ``--threads``, one for the pooled steps, which sum gradients (pipeline/runner.py).
        ray_address: the Ray cluster to join (``auto``, ``host:port`` or ``ray://host:port``; None: start one here).
        gpus_per_run: the share of one GPU each run takes, in (0, 1] (None: on Ray, one GPU per run where there
            are GPUs and the experiment uses them, else none; locally, the workers go round-robin over the GPUs).
            Given, it is reserved even by an experiment that keeps to the CPU (``use_accelerator: false``).
        cpus_per_run: CPUs each Ray task declares (None: 1).
        max_retries: how often Ray reruns a task whose worker or node died (None: 3).
    """

    executor: str = "local"
    jobs: int | None = None
    threads: int | None = None
    ray_address: str | None = None
    gpus_per_run: float | None = None
    cpus_per_run: float | None = None
    max_retries: int | None = None

    def check(self) -> None:
        """The checks that need no cluster (one :class:`TaskHetError` naming the flag), made before any work."""
        EXECUTORS.get(self.executor)
        for name, kind in (("jobs", cli.ints(1, cli.MAX_WORKERS)), ("threads", cli.THREADS), ("gpus_per_run", GPU_FRACTIONS),
                           ("cpus_per_run", CPUS_PER_RUN), ("max_retries", RETRIES)):
            value = getattr(self, name)
            if value is not None:
                try:
                    kind.check(value)
                except ValueError as error:
                    raise TaskHetError(f"--{name} {error}") from None
        if self.executor != "ray":
            given = [f"--{name}" for name in RAY_ONLY if getattr(self, name) is not None]
            if given:
                raise TaskHetError(f"{given[0]} is a setting of --executor ray; the local executor runs --jobs worker "
                                   "processes on this machine (their torch threads: --threads)")
        if self.ray_address is not None:
            check_ray_address(self.ray_address)


def check_ray_address(address: str) -> None:
    """``auto``, ``host:port`` or ``ray://host:port`` (what ``ray start --head`` prints), else one line."""
    rest = address[len("ray://"):] if address.startswith("ray://") else address
    host, _, port = rest.rpartition(":")
    if address == "auto" or (host and port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        return
    raise TaskHetError(f"--ray_address {address!r} must be auto, HOST:PORT or ray://HOST:PORT (the address "
                       "`ray start --head` prints)")


class Executor(Protocol):
    """What runs a grid's pooled stages (see the module docstring for the contract)."""

    in_process: bool  # the stages run in the pipeline's own process, one after another (the pipeline does that)

    def describe(self) -> str:
        """How the stages run, after the stage counts: ``2 at a time in worker processes``."""

    def run(self, stages: list[PoolStage], on_done: OnDone) -> None:
        """Run ``stages`` (unfinished, each ``argv`` complete); raise the first failure naming its stage."""

    def close(self) -> None:
        """Give back what the executor holds (a Ray connection)."""


# An executor's factory: (settings, results folder, whether the experiment uses accelerators) -> a started executor.
EXECUTORS: Registry[Callable[[ExecutorSettings, Path, bool], Executor]] = Registry("executor")


@dataclass
class LocalExecutor:
    """``jobs`` worker processes on this machine, worker i seeing only ``devices[i]`` (none: every GPU)."""

    jobs: int = 1
    threads: int | None = None
    devices: tuple[str, ...] = ()

    @property
    def in_process(self) -> bool:
        return self.jobs == 1

    def describe(self) -> str:
        if self.in_process:
            return "one at a time in this process"
        gpus = f"; each sees one GPU of {', '.join(dict.fromkeys(self.devices))}" if self.devices else ""
        return f"{self.jobs} at a time in worker processes{gpus}"

    def run(self, stages: list[PoolStage], on_done: OnDone) -> None:
        run_in_workers(stages, self.jobs, self.threads, on_done, list(self.devices))

    def close(self) -> None:
        pass


@EXECUTORS.register("local")
def open_local(settings: ExecutorSettings, out_dir: Path | None = None, use_accelerator: bool = True) -> LocalExecutor:
    """The local pool of ``settings.jobs`` workers, spread over this machine's visible GPUs; ``--gpus_per_run`` is
    checked against them."""
    jobs = settings.jobs or 1
    visible = visible_gpu_ids()
    if settings.gpus_per_run is not None and jobs * settings.gpus_per_run > len(visible) + 1e-9:
        raise TaskHetError(f"--jobs {jobs} × --gpus_per_run {settings.gpus_per_run:g} asks for "
                           f"{jobs * settings.gpus_per_run:g} GPUs, but this machine shows {len(visible)} "
                           f"({describe_visible(visible)}); lower --jobs or --gpus_per_run")
    devices = worker_devices(jobs, visible) if jobs > 1 else []
    return LocalExecutor(jobs, settings.threads, tuple(devices))


def describe_visible(visible: list[str]) -> str:
    shown = os.environ.get(VISIBLE_DEVICES)
    return f"{VISIBLE_DEVICES}={shown!r}" if shown is not None else f"torch sees {len(visible)} CUDA devices"


@EXECUTORS.register("ray")
def open_ray(settings: ExecutorSettings, out_dir: Path, use_accelerator: bool = True) -> Executor:
    """A Ray executor connected to its cluster, its settings checked against it (pipeline/ray_executor.py)."""
    from pipeline.ray_executor import RayExecutor

    cpus = 1.0 if settings.cpus_per_run is None else settings.cpus_per_run
    retries = DEFAULT_MAX_RETRIES if settings.max_retries is None else settings.max_retries
    return RayExecutor.connect(settings.ray_address, out_dir, cpus, settings.gpus_per_run, retries, settings.jobs,
                               use_accelerator)


@contextlib.contextmanager
def open_executor(settings: ExecutorSettings, out_dir: Path, use_accelerator: bool = True) -> Iterator[Executor]:
    """The executor ``settings`` name, started and checked (cluster reachable, resources, shared storage) before
    any step runs, closed when the block ends."""
    settings.check()
    executor = EXECUTORS.get(settings.executor)(settings, Path(out_dir), use_accelerator)
    try:
        yield executor
    finally:
        executor.close()


class GridProgress:
    """``run k of N done`` console lines with the elapsed time and an ETA, one per finished stage, printed whether or
    not stdout is a terminal (a long grid's log file shows them too); advances the top-level bar ``bar`` as well.
    Every executor's stages report through it, ``--jobs 1`` in the pipeline's own process included, so the lines
    are the same however the stages run.

    Times are utils/progress.py's ``H:MM:SS``, as in step 4's and step 2's lines; the ETA assumes the stages left
    take as long on average as the ones done so far, at the same parallelism.
    """

    def __init__(self, total: int, bar: tqdm | None = None, clock: Callable[[], float] = time.monotonic,
                 log: Callable[[str], None] | None = None) -> None:
        self.total, self.bar, self.clock, self.log = total, bar, clock, log  # log: the experiment's run.log too
        self.finished = 0
        self.started = clock()

    def done(self, stage: PoolStage, record: dict[str, Any]) -> None:
        self.finished += 1
        elapsed = self.clock() - self.started
        took = (f", {record['finished'] - record['started']:.0f} s" if record.get("ran", True)
                and {"started", "finished"} <= record.keys() else "")
        line = (f"run {self.finished} of {self.total} done: {stage.name} ({where(record)}{took}); "
                f"{clock_text(elapsed)} elapsed, {eta_text(seconds_left(elapsed, self.finished, self.total))}")
        if self.bar is not None:
            self.bar.update(1)
        tqdm.write(line, file=sys.stdout)  # above a drawn bar; a plain line otherwise
        sys.stdout.flush()
        if self.log is not None:
            self.log(line)


def where(record: dict[str, Any]) -> str:
    """``host h, GPU 1`` (``already done`` when the stage was finished by an earlier try) from a placement record."""
    if not record.get("ran", True):
        return "already done"
    node = f"Ray node {record['node_ip']}" if record.get("node_ip") else f"host {record.get('host')}"
    devices = record.get("devices")
    return f"{node}, GPU {devices}" if devices else node

