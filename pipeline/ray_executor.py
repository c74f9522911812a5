"""The Ray executor (run_pipeline.py ``--executor ray``): every pooled stage a Ray task (pipeline/executors.py).

Each step-3c reading and step-4 run is a task declaring ``--cpus_per_run`` CPUs and ``--gpus_per_run`` GPUs; Ray
places it on a node with room and sets its ``CUDA_VISIBLE_DEVICES``, so a task sees only its GPUs (a task that
takes a GPU runs in a fresh worker process: CUDA reads the variable once per process). The task runs the same
``pipeline.pool.run_pool_stage`` as a local worker, in the driver's working directory, so every relative path means
what it means on the driver. A task whose worker or node dies is rerun by Ray (``--max_retries``); the rerun finds
the run's ``checkpoint.pt`` and resumes (the pool's step-4 command line has ``--resume``), after waiting for the
dead run's folder lock to be let go. A task's worker ends itself when its raylet dies (:func:`exit_with_raylet`), so
a run on a lost node is rerun elsewhere rather than finished by an orphan.

While the grid runs, the driver checks between waits that the head's GCS still answers: a lost head is one line
naming the finished and the running runs, within seconds, rather than Ray's own exit a minute later. Ray's
messages about dead workers and nodes stay in its log files (:func:`quiet_ray_messages`).

Before any step runs, :meth:`RayExecutor.connect` checks the address answers, that some node can hold one run's
resources, and that every node sees the results folder: each node reads a file the driver wrote there and writes
one back (pipeline/ray_checks.py). Ray is imported here only, so the rest of the pipeline runs without it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import socket
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from pipeline.pool import PoolStage, named_failure, run_pool_stage
from pipeline.ray_checks import (accepts_connection, check_gcs, check_reachable, check_resources,
                                 check_shared_storage)
from utils.errors import FolderInUseError, TaskHetError
from utils.locks import folder_lock

WARM_SECONDS = 60  # a warm-up task waits this long at most for the others to check in (a busy node starts late)
WARM_FOLDER = ".ray-workers-starting"
LOCK_WAIT_SECONDS = 300  # a rerun waits this long for the folder lock of a run whose node died (NFS frees it late)
# A lost head: Ray's driver waits RAY_gcs_rpc_server_reconnect_timeout_s (60 s) and then exits with its own message.
WAIT_SECONDS = 1.0  # the driver looks at the head at least this often while runs are in flight
HEAD_CHECKS = 3  # the head is lost when its GCS refuses this many TCP connections in a row ...
HEAD_CHECK_SECONDS = 1.0  # ... tried this far apart, each given this long (a dead machine answers nothing at all)
NAMES_SHOWN = 3  # a lost head's line names this many runs of each kind, then counts the rest
WATCH_THREAD = "taskhet-raylet-watch"  # the thread of a Ray worker that ends it when its raylet dies
WATCH_SECONDS = 0.5  # ... looking this often
RAYLET_GONE_EXIT = 75  # its exit code (EX_TEMPFAIL: the run is retried elsewhere)
PROJECT_ROOT = Path(__file__).resolve().parent.parent
# A failed try that Ray will retry is not an error for the console: without this, the driver's core worker sends each
# one to the GCS as an error message, and says so on stderr when it cannot (a lost head). A last try still reports.
RAY_DRIVER_SETTINGS = (("RAY_enable_output_error_log_if_still_retry", "0"),)


def import_ray() -> Any:
    """The ``ray`` module, or one line saying how to install it."""
    try:
        import ray
    except ImportError:
        raise TaskHetError("--executor ray needs Ray: pip install -c constraints.txt -r requirements-flower.txt") from None
    return ray


@dataclass
class RayExecutor:
    """A connected Ray driver running pooled stages as tasks of ``cpus`` CPUs and ``gpus`` GPUs each."""

    ray: Any
    cluster: str  # "the Ray cluster at ADDRESS" or "a Ray instance on this machine", for messages
    nodes: list[dict[str, Any]]
    cpus: float
    gpus: float
    max_retries: int
    jobs: int | None  # runs in flight at most (None: as many as the resources allow)
    cwd: str
    out_dir: Path | None = None  # the results folder every node sees (start_workers' check-in folder goes there)
    in_process: bool = False
    gcs_address: str | None = None  # the head's GCS (HOST:PORT) this driver joined; None: not watched
    head_lost: bool = False  # set when the head stopped answering: nothing more is asked of Ray, close() included

    @classmethod
    def connect(cls, address: str | None, out_dir: Path, cpus: float, gpus: float | None, max_retries: int,
                jobs: int | None, use_accelerator: bool) -> "RayExecutor":
        """Join the cluster at ``address`` (None: start one here) and check the settings against it (every failure is
        one line); ``gpus`` None: one GPU per run where there are GPUs and the experiment uses them, else none."""
        ray = import_ray()
        cluster = start_ray(ray, address)
        try:
            nodes = [node for node in ray.nodes() if node.get("Alive")]
            if gpus is None:
                gpus = 1.0 if use_accelerator and any(node["Resources"].get("GPU", 0) for node in nodes) else 0.0
            check_resources(nodes, cpus, gpus, cluster)
            cwd = os.getcwd()
            check_shared_storage(ray, nodes, Path(out_dir), cwd)
        except BaseException:
            close_ray(ray)
            raise
        return cls(ray, cluster, nodes, cpus, gpus, max_retries, jobs, cwd, Path(out_dir),
                   gcs_address=ray.get_runtime_context().gcs_address)

    def describe(self) -> str:
        most = f", at most {self.jobs} at a time" if self.jobs else ""
        return (f"Ray tasks on {self.cluster} ({len(self.nodes)} node{'s' * (len(self.nodes) != 1)}), "
                f"{self.cpus:g} CPU and {self.gpus:g} GPU per run{most}")

    def run(self, stages: list[PoolStage], on_done: Callable[[PoolStage, dict[str, Any]], None]) -> None:
        """Submit ``stages`` (at most ``jobs`` in flight), report each as it finishes; the first failure cancels the
        rest (a cancelled run resumes from its checkpoint on a rerun) and is raised naming its stage. A lost head is
        one line naming the runs that finished and those that were running (:func:`lost_head_message`)."""
        ray = self.ray
        self.start_workers(min(self.jobs or len(stages), len(stages), self.slots()))
        # max_calls=1: a task that takes a GPU gets a fresh process, whose CUDA sees only the GPUs Ray gave it.
        task = ray.remote(num_cpus=self.cpus, num_gpus=self.gpus, max_retries=self.max_retries,
                          retry_exceptions=False, max_calls=1 if self.gpus else 0)(run_ray_task)
        waiting, running, finished = deque(stages), {}, []
        try:
            while waiting or running:
                while waiting and len(running) < (self.jobs or len(stages)):
                    stage = waiting.popleft()
                    ref = task.options(name=stage.name).remote(stage.script, str(stage.stage_dir), stage.params,
                                                               stage.argv, self.cwd)
                    running[ref] = stage
                # Bounded, so that a lost head is noticed between runs (Ray's driver would wait a minute, then exit).
                ready, _ = ray.wait(list(running), num_returns=1, timeout=WAIT_SECONDS)
                for ref in ready:
                    record = self.result(ref, running[ref])
                    stage = running.pop(ref)
                    finished.append(stage.name)
                    on_done(stage, record)
                if not self.head_answers():
                    raise HeadLost
        except HeadLost:
            self.head_lost = True  # cancelling asks the GCS: nothing to cancel with, and each run's folder resumes
            raise TaskHetError(lost_head_message(self.cluster, self.gcs_address, finished,
                                                 [stage.name for stage in running.values()], len(waiting))) from None
        except BaseException:
            for ref in running:
                ray.cancel(ref, force=True)
            raise

    def head_answers(self) -> bool:
        """Whether the head's GCS accepts a TCP connection, tried :data:`HEAD_CHECKS` times :data:`HEAD_CHECK_SECONDS`
        apart before saying no (one connection, well under a millisecond, while it is up)."""
        if self.gcs_address is None:
            return True
        for attempt in range(HEAD_CHECKS):
            if attempt:
                time.sleep(HEAD_CHECK_SECONDS)
            if accepts_connection(self.gcs_address, HEAD_CHECK_SECONDS):
                return True
        return False

    def slots(self) -> int:
        """Runs the cluster can hold at once by CPUs (GPUs limit it further; Ray enforces both)."""
        return sum(int(node["Resources"].get("CPU", 0.0) / self.cpus + 1e-9) for node in self.nodes) if self.cpus else 0

    def start_workers(self, count: int) -> None:
        """Start ``count`` worker processes together before the first run.

        Ray starts a worker for this job's runtime environment only when a task asks for one, one lease at a time,
        so without this the grid's second run waited while its worker started beside the first run: 1.7 s on an
        idle machine, about 7 s with the first run importing what a run imports (docs/BENCHMARKS.md, "The grid on
        Ray"). Each warm-up task checks in to a folder on the shared results storage and holds its worker until
        all ``count`` have checked in (at most :data:`WARM_SECONDS`), so they need ``count`` processes, each of
        which has imported the pipeline when the first run starts, as the local pool's workers have. A task with
        GPUs gets a fresh process anyway (``max_calls=1``): nothing to start then.
        """
        if self.gpus or count < 2 or self.out_dir is None:
            return
        folder = self.out_dir.resolve() / f"{WARM_FOLDER}-{secrets.token_hex(8)}"
        folder.mkdir(parents=True)
        try:
            warm = self.ray.remote(num_cpus=self.cpus, max_retries=0)(hold_a_worker)
            self.ray.get([warm.remote(str(folder), count, WARM_SECONDS) for _ in range(count)])
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def result(self, ref: Any, stage: PoolStage) -> dict[str, Any]:
        """A finished task's placement record; its failure as one line naming the stage (a bug keeps its traceback)."""
        ray = self.ray
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as error:
            if isinstance(error.cause, TaskHetError):
                raise named_failure(stage, error.cause) from None
            raise
        except ray.exceptions.RayError as error:
            if not self.head_answers():  # a run the dead head took with it: the head is the news, not the run
                raise HeadLost from None
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise TaskHetError(f"{stage.name}: its Ray task failed {self.max_retries + 1} time(s), the last with "
                               f"{type(error).__name__} ({reason}); rerun to resume it from its checkpoint, or raise "
                               "--max_retries") from None

    def close(self) -> None:
        # Without a head, ray.shutdown waits about 5 s for it; Ray's own exit hook does that after the error line.
        if not self.head_lost:
            close_ray(self.ray)


class HeadLost(Exception):
    """Raised inside :meth:`RayExecutor.run` when the head's GCS stopped answering; run turns it into one line."""


def lost_head_message(cluster: str, gcs_address: str | None, finished: list[str], running: list[str],
                      waiting: int) -> str:
    """The one line of a lost head: which runs finished, which were running (or queued on Ray), what to do.

    ``finished`` and ``running`` are stage names; each list shows its first :data:`NAMES_SHOWN` and counts the rest;
    ``waiting`` counts the runs not yet handed to Ray (``--jobs``).
    """
    total = len(finished) + len(running) + waiting
    parts = [f"{len(finished)} finished{named(finished)}", f"{len(running)} were running or queued{named(running)}"]
    if waiting:
        parts.append(f"{waiting} not yet submitted")
    return (f"{cluster} lost its head (its GCS at {gcs_address} stopped answering): of {total} run(s), "
            f"{', '.join(parts)}; rerun the same command to resume once the cluster is back (`ray start --head` "
            "again, then the other nodes): finished runs are kept, the others go on from their checkpoints")


def named(names: list[str]) -> str:
    """`` (a, b, c and 2 more)``; empty for none."""
    if not names:
        return ""
    rest = len(names) - NAMES_SHOWN
    return f" ({', '.join(names[:NAMES_SHOWN])}{f' and {rest} more' if rest > 0 else ''})"


def quiet_ray_messages(ray: Any, quiet: bool) -> None:
    """Keep Ray's error messages to the driver off the console (``quiet``), or let them through again.

    With ``log_to_driver=False`` Ray still prints what its nodes publish as errors: a node marked dead and, for each
    of a dead raylet's two agents, the raylet's last 20 log lines (46 lines for one raylet), and the like. They
    are in Ray's log files already (the agents' and the GCS's, under the head's ``session_latest/logs``); the
    switch is the one Ray turns off itself while a debugger holds the console (ray/util/rpdb.py)."""
    ray._private.worker._worker_logs_enabled = not quiet


def close_ray(ray: Any) -> None:
    """Disconnect from Ray, then let its messages through again (the ones it held back are dropped, not printed)."""
    ray.shutdown()
    quiet_ray_messages(ray, False)


def start_ray(ray: Any, address: str | None) -> str:
    """``ray.init`` at ``address`` (None: a new Ray instance on this machine, never someone else's cluster); returns
    how messages name the cluster. An address that does not answer is one line, not Ray's minute of retries."""
    if address is not None and address != "auto":
        check_reachable(address)
        if not address.startswith("ray://"):  # the Ray Client server speaks another protocol than the GCS
            check_gcs(address, ray.__version__)
    with warnings.catch_warnings():
        # Ray's notice that a future version leaves CUDA_VISIBLE_DEVICES alone for tasks without GPUs.
        warnings.filterwarnings("ignore", message=".*RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO.*", category=FutureWarning)
        try:
            # Runs report to the driver through their results; their own console lines stay in each node's Ray logs.
            options = {"log_to_driver": False, "logging_level": logging.WARNING, "runtime_env": project_env()}
            with driver_settings(RAY_DRIVER_SETTINGS):
                if address is None:
                    ray.init(address="local", include_dashboard=False, **options)
                else:
                    ray.init(address=address, **options)
            quiet_ray_messages(ray, True)
        except (ConnectionError, RuntimeError, ValueError) as error:
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise TaskHetError(f"--ray_address {address}: could not join a Ray cluster there ({reason}); start one "
                               "with `ray start --head` and pass the address it prints") from None
    return "a Ray instance on this machine" if address is None else f"the Ray cluster at {address}"


@contextlib.contextmanager
def driver_settings(settings: tuple[tuple[str, str], ...]) -> Iterator[None]:
    """Ray's settings, (``RAY_<name>``, value) pairs, for the driver's core worker, which reads them when ``ray.init``
    starts it; the environment is put back afterwards (a Ray started here inherits them too, harmlessly)."""
    before = {name: os.environ.get(name) for name, _ in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def project_env() -> dict[str, Any]:
    """The tasks' runtime environment: this repository first on their ``PYTHONPATH`` (every node has it at this
    path), so a task imports the project wherever the driver was started from."""
    paths = [str(PROJECT_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(paths)}}


def hold_a_worker(folder: str, count: int, seconds: float) -> int:
    """A warm-up task (:meth:`RayExecutor.start_workers`): checks in to ``folder`` and keeps its worker until ``count``
    tasks have checked in, or ``seconds`` have passed; returns its pid."""
    Path(folder, f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}").touch()
    deadline = time.monotonic() + seconds
    while len(os.listdir(folder)) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return os.getpid()


def run_ray_task(script: str, stage_dir: str, params: dict[str, Any], argv: list[str], cwd: str) -> dict[str, Any]:
    """One pooled stage as a Ray task: in the driver's working directory, after the lock of a dead earlier try is let
    go; returns its placement record (with the Ray node). Its worker ends itself when its raylet dies."""
    import ray

    exit_with_raylet()
    try:
        os.chdir(cwd)
    except OSError as error:
        raise TaskHetError(f"this Ray node has no folder {cwd}, the driver's working directory ({error.strerror})") from None
    where = {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address()}
    wait_for_folder(Path(stage_dir))
    return run_pool_stage(script, Path(stage_dir), params, argv, where)


def exit_with_raylet() -> None:
    """Start, once per Ray worker process, a daemon thread that ends the process when its parent, the raylet, is gone.

    A worker whose raylet was killed alone went on with its run on a node already marked dead, returned it to the
    driver itself (so Ray never retried it), then stayed an orphan ``ray::IDLE`` process for minutes. Ended at once,
    its task fails as the node's, and Ray reruns it elsewhere, resuming from the checkpoint. The thread is found by
    its name: a worker runs many tasks, and one watcher is enough."""
    if any(thread.name == WATCH_THREAD for thread in threading.enumerate()):
        return
    threading.Thread(target=watch_parent, args=(os.getppid(), WATCH_SECONDS, RAYLET_GONE_EXIT), name=WATCH_THREAD,
                     daemon=True).start()


def watch_parent(parent: int, seconds: float, code: int) -> None:
    """Exit this process with ``code`` (no cleanup: its run is half done) once its parent is no longer ``parent``:
    an orphan is adopted by init or a subreaper, so its parent id changes."""
    while os.getppid() == parent:
        time.sleep(seconds)
    os._exit(code)


def wait_for_folder(stage_dir: Path, seconds: float = LOCK_WAIT_SECONDS) -> None:
    """Wait until no live run holds ``stage_dir``'s lock: after a node dies, Ray may rerun its task before the dead
    run's lock is let go (its processes still exiting, or an NFS server that has not yet noticed)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            with folder_lock(stage_dir):
                return
        except FolderInUseError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
