"""The grid on a real Ray cluster on this machine (run_pipeline.py --executor ray): a head and a second worker node,
two raylets, each declaring fake GPUs. Every test starts its own cluster and stops it (so pytest-xdist may run them
anywhere), on ports Ray chooses.

A tiny digits main job runs with the local executor once (in this process, one thread); the Ray grids then run
its pooled stages (step-3c readings, step-4 runs) on the cluster, from a copy of its steps 1-3, and every run's
metrics.csv must equal the local one byte for byte.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

import run_pipeline  # noqa: E402
from pipeline import ray_executor  # noqa: E402
from pipeline.pool import PLACEMENT_FILE, PoolStage  # noqa: E402
from pipeline.ray_checks import check_resources  # noqa: E402
from pipeline.ray_executor import RayExecutor, lost_head_message  # noqa: E402
from tests.test_digits import tiny_digits_experiment  # noqa: E402
from tests.test_worker_death import parent_of, stat_fields  # noqa: E402
from utils.errors import TaskHetError  # noqa: E402
from utils.locks import LOCK_FILE  # noqa: E402
from utils.stages import MARKER  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NAME = "tinydigits"
POOLED = ("federated",)  # the folders of the pooled stages; the rest is steps 1-3 and the report
SMALL_STORE = 80 * 2**20  # bytes of object store per node: the tasks return a placement record each


def experiment_config() -> dict:
    config = tiny_digits_experiment(None)
    config["model"]["image_size"] = 8
    config["federated"]["algorithms"]["fedprox"] = {"mu": 0.01}
    config["federated"]["n_rounds"] = 4  # a checkpoint per round: a run killed mid-way resumes from one
    config["heterogeneity_meter"] = False  # step 3c runs through the same run_pool_stage (tests/test_executors.py)
    return config  # 2 groupings x 2 algorithms = 4 runs


@pytest.fixture(scope="module")
def local_grid(tmp_path_factory) -> Path:
    """The experiment run by the local executor (one stage after another in this process, one thread)."""
    base = tmp_path_factory.mktemp("local")
    experiment = base / "digits.yaml"
    experiment.write_text(yaml.safe_dump(experiment_config()))
    run_pipeline.main([str(experiment), "--results", str(base / "results"), "--threads", "1"])
    return base


def copy_of_steps_1_to_3(local_grid: Path, results: Path) -> Path:
    """A results folder holding the local run's steps 1-3 only (stage keys are relative: the copy reuses them)."""
    shutil.copytree(local_grid / "results" / NAME, results / NAME,
                    ignore=lambda folder, names: [name for name in names if Path(folder) == local_grid / "results" / NAME
                                                  and (name in POOLED or name.startswith("report"))])
    return local_grid / "digits.yaml"


def metrics_files(results: Path) -> dict[str, bytes]:
    return {path.relative_to(results).as_posix(): path.read_bytes()
            for path in sorted((results / NAME / "federated").rglob("metrics.csv"))}


def placements(results: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted((results / NAME).rglob(PLACEMENT_FILE))]


def start_cluster(*nodes: dict) -> Cluster:
    """A head node (``nodes[0]``) and worker nodes, each its own raylet, with no dashboard."""
    cluster = Cluster(initialize_head=True, head_node_args={"include_dashboard": False,
                                                            "object_store_memory": SMALL_STORE, **nodes[0]})
    for node in nodes[1:]:
        cluster.add_node(object_store_memory=SMALL_STORE, **node)
    return cluster


def raylet_pid(node) -> int:
    return node.all_processes[ray._private.ray_constants.PROCESS_TYPE_RAYLET][0].process.pid


def run_on(results: Path, raylet: int) -> tuple[Path, int] | None:
    """A step-4 folder with a checkpoint whose lock a worker of the node with this raylet holds (the workers are the
    raylet's children), and that worker: a run in the middle, on that node. Only the lock holders' own parents are
    read: the test polls this 20 times a second, and reading every process's entry each time cost seconds of CPU."""
    # os.walk, not rglob: a folder made only to wait for a lock is removed again while it is read (rglob raises; seen)
    for folder, _, names in os.walk(results / NAME / "federated"):
        if LOCK_FILE not in names or "checkpoint.pt" not in names:
            continue
        try:
            holder = json.loads((Path(folder) / LOCK_FILE).read_text() or "{}")
        except (OSError, ValueError):
            continue
        if "pid" in holder and parent_of(holder["pid"]) == raylet:
            return Path(folder), holder["pid"]
    return None


def freeze_in_the_middle(caught: tuple[Path, int] | None) -> tuple[Path, int] | None:
    """Stop the caught run's process (SIGSTOP) so that it is still in the middle when its node is removed: a round
    of this grid takes a fifth of a second, less than removing a node takes, so an unfrozen run could finish on the
    node first. None when the run had finished before it was frozen."""
    if caught is None:
        return None
    folder, pid = caught
    try:
        os.kill(pid, signal.SIGSTOP)
    except ProcessLookupError:
        return None
    if (folder / MARKER).exists():
        os.kill(pid, signal.SIGCONT)
        return None
    return caught


# ----- the resource check on fake node lists (the part of ray.nodes() it reads; no cluster) -----

def fake_nodes(*resources: tuple[float, float]) -> list[dict]:
    """One ``ray.nodes()`` entry per (CPUs, GPUs); a node without GPUs lists none, as Ray's do."""
    return [{"NodeID": f"node-{number}", "Alive": True, "Resources": {"CPU": cpus, **({"GPU": gpus} if gpus else {})}}
            for number, (cpus, gpus) in enumerate(resources)]


@pytest.mark.parametrize("resources, cpus, gpus", [
    (((2, 0), (4, 0)), 4, 0),  # exactly the larger node's CPUs
    (((2, 1), (2, 1)), 2, 1),  # exactly one node's CPUs and GPU, both at once
    (((4, 0), (1, 1)), 1, 1),  # the GPU node holds it whole; the other is never asked
    (((1, 0.3),), 1, 0.1 + 0.1 + 0.1),  # 0.30000000000000004 GPU on a node of 0.3: float sums, not a shortage
])
def test_a_run_one_node_holds_whole_is_feasible(resources, cpus, gpus):
    assert check_resources(fake_nodes(*resources), cpus, gpus, "a stand-in") is None


@pytest.mark.parametrize("resources, cpus, gpus, message", [
    # more than every node, no more than the cluster's total: Ray would wait forever
    (((2, 0), (2, 0)), 4, 0, "--cpus_per_run 4: no node of a stand-in has 4 CPUs (the largest node has 2 CPUs and "
                             "0 GPUs; 4 CPUs and 0 GPUs on 2 node(s) together, but Ray places a run on one node), so a "
                             "run would never start"),
    (((2, 0), (2, 0)), 2.5, 0, "--cpus_per_run 2.5: no node of a stand-in has 2.5 CPUs (the largest node has 2 CPUs "
                               "and 0 GPUs; 4 CPUs and 0 GPUs on 2 node(s) together, but Ray places a run on one "
                               "node), so a run would never start"),
    # the CPUs on one node, the GPU on another: each flag alone is met, the run is not
    (((4, 0), (1, 1)), 4, 1, "--cpus_per_run 4 and --gpus_per_run 1: no node of a stand-in has 4 CPUs and 1 GPU "
                             "together (the largest node has 4 CPUs and 0 GPUs; 5 CPUs and 1 GPU on 2 node(s) "
                             "together, but Ray places a run on one node), so a run would never start"),
    # GPUs short: the largest node is the one with the most GPUs, a tie broken by its CPUs
    (((4, 0), (1, 1), (2, 1)), 1, 2, "--gpus_per_run 2: no node of a stand-in has 2 GPUs (the largest node has 2 CPUs "
                                     "and 1 GPU; 7 CPUs and 2 GPUs on 3 node(s) together, but Ray places a run on one "
                                     "node), so a run would never start"),
])
def test_a_run_beyond_every_node_is_refused_naming_the_largest_node(resources, cpus, gpus, message):
    with pytest.raises(TaskHetError) as raised:
        check_resources(fake_nodes(*resources), cpus, gpus, "a stand-in")
    assert str(raised.value) == message


# ----- a lost head and a lost raylet without a cluster -----

def test_a_lost_head_is_one_line_naming_the_finished_and_the_running_runs():
    assert lost_head_message("the Ray cluster at h:1", "h:1", ["step 4: a"],
                             ["step 4: b", "step 3c: c", "step 4: d", "step 4: e", "step 4: f"], 2) == (
        "the Ray cluster at h:1 lost its head (its GCS at h:1 stopped answering): of 8 run(s), 1 finished (step 4: a), "
        "5 were running or queued (step 4: b, step 3c: c, step 4: d and 2 more), 2 not yet submitted; rerun the same "
        "command to resume once the cluster is back (`ray start --head` again, then the other nodes): finished runs "
        "are kept, the others go on from their checkpoints")
    assert lost_head_message("a Ray instance on this machine", "10.0.0.1:6379", [], ["x", "y", "z"], 0) == (
        "a Ray instance on this machine lost its head (its GCS at 10.0.0.1:6379 stopped answering): of 3 run(s), 0 "
        "finished, 3 were running or queued (x, y, z); rerun the same command to resume once the cluster is back "
        "(`ray start --head` again, then the other nodes): finished runs are kept, the others go on from their "
        "checkpoints")


class HeadDiesRay:
    """A stand-in for ``ray`` whose first ``wait`` finds the first task done and whose later waits find nothing,
    the head (a listening socket) closed by the second wait. Records what was cancelled and whether it was shut
    down."""

    class exceptions:  # noqa: N801 (ray.exceptions)
        RayError = RuntimeError
        RayTaskError = ValueError

    def __init__(self, head: socket.socket):
        self.head, self.waits, self.cancelled, self.shut = head, 0, [], False

    def remote(self, **resources):
        class Task:
            @staticmethod
            def options(name):
                class Call:
                    @staticmethod
                    def remote(*args):
                        return name
                return Call
        return lambda fn: Task

    def wait(self, refs, num_returns, timeout):
        self.waits += 1
        assert self.waits < 10, "the driver did not notice that the head had gone"
        if self.waits == 1:
            return refs[:1], refs[1:]
        self.head.close()
        return [], refs

    def get(self, ref):
        return {"ran": False}

    def cancel(self, ref, force):
        self.cancelled.append(ref)

    def shutdown(self):
        self.shut = True


def test_a_head_that_stops_answering_mid_grid_is_one_line_and_nothing_more_is_asked_of_ray(monkeypatch):
    monkeypatch.setattr(ray_executor, "HEAD_CHECK_SECONDS", 0.01)
    head = socket.create_server(("127.0.0.1", 0))  # a GCS port that accepts connections until it is closed
    address = f"127.0.0.1:{head.getsockname()[1]}"
    fake = HeadDiesRay(head)
    executor = RayExecutor(fake, "the Ray cluster at h:1", [{"Resources": {"CPU": 2.0}}], 1.0, 0.0, 0, 2, "/",
                           None, gcs_address=address)
    stages = [PoolStage(f"step 4: {name}", Path(name), {}, []) for name in "abcd"]
    done = []
    with pytest.raises(TaskHetError) as raised:
        executor.run(stages, lambda stage, record: done.append(stage.name))
    assert str(raised.value) == lost_head_message("the Ray cluster at h:1", address, ["step 4: a"],
                                                  ["step 4: b", "step 4: c"], 1)
    assert done == ["step 4: a"] and fake.waits == 2  # --jobs 2: a finished, b and c in flight, d never sent
    executor.close()
    assert fake.cancelled == [] and not fake.shut  # cancelling and shutting down would wait for the dead GCS
    assert executor.head_lost


def test_a_worker_whose_raylet_dies_ends_itself():
    """A process (the Ray worker) started by another (its raylet) runs while its parent lives, starts one watcher
    however often asked, and is gone within a few watch periods of its parent's death."""
    reader, writer = os.pipe()
    raylet = os.fork()
    if raylet == 0:  # the raylet's stand-in: starts the worker, then waits to be killed
        try:
            if os.fork() == 0:
                try:
                    ray_executor.exit_with_raylet()
                    ray_executor.exit_with_raylet()
                    watchers = sum(thread.name == ray_executor.WATCH_THREAD for thread in threading.enumerate())
                    os.write(writer, f"{os.getpid()} {watchers}".encode())
                    time.sleep(60)
                finally:
                    os._exit(0)
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(writer)
    worker, watchers = map(int, os.read(reader, 100).split())
    os.close(reader)
    process = {worker: started(worker)}
    try:
        assert watchers == 1
        time.sleep(3 * ray_executor.WATCH_SECONDS)
        assert left_running(process) != {}, "the worker ended while its raylet lived"
        os.kill(raylet, signal.SIGKILL)
        os.waitpid(raylet, 0)
        gone = time.monotonic()
        assert wait_until_gone(process, 10) == {}
        assert time.monotonic() - gone < 5 * ray_executor.WATCH_SECONDS + 1
    finally:
        kill_all(process)


@pytest.mark.slow
def test_a_grid_on_two_nodes_equals_the_local_one_each_run_sees_its_own_gpu_and_a_lost_node_is_survived(
        local_grid, tmp_path):
    """One grid on a head (2 CPUs, 2 fake GPUs: two runs at once) and a worker node (1 CPU, 2 fake GPUs), 1 GPU per
    run; the worker node is killed while a run on it is in the middle. The grid still ends with the local
    executor's metrics.csv byte for byte, every run saw exactly one GPU id, two runs at once on a node never shared
    one, and the lost run went on from its checkpoint on the head."""
    cluster = start_cluster({"num_cpus": 2, "num_gpus": 2}, {"num_cpus": 1, "num_gpus": 2})
    worker, head, address = next(iter(cluster.worker_nodes)), cluster.head_node.node_id, cluster.address
    results = tmp_path / "results"
    experiment = copy_of_steps_1_to_3(local_grid, results)
    log = tmp_path / "driver.log"
    with log.open("w") as console:
        driver = subprocess.Popen([sys.executable, "run_pipeline.py", str(experiment), "--results", str(results),
                                   "--threads", "1", "--executor", "ray", "--ray_address", address,
                                   "--gpus_per_run", "1", "--cpus_per_run", "1", "--max_retries", "2"],
                                  cwd=ROOT, stdout=console, stderr=subprocess.STDOUT)
    try:
        deadline, caught = time.time() + 600, None
        while caught is None and driver.poll() is None and time.time() < deadline:
            caught = freeze_in_the_middle(run_on(results, raylet_pid(worker)))
            time.sleep(0.05)
        assert caught is not None, "no run was caught in the middle on the worker node"
        killed, frozen_pid = caught
        cluster.remove_node(worker, allow_graceful=False)  # the raylet and its workers die with SIGKILL
        with contextlib.suppress(ProcessLookupError):  # and the frozen run, which cannot notice its raylet is gone
            os.kill(frozen_pid, signal.SIGKILL)
        driver.wait(timeout=900)
    finally:
        if driver.poll() is None:
            driver.kill()
        cluster.shutdown()
    out = log.read_text()
    assert driver.returncode == 0, out
    assert f"step 4: 4 runs, Ray tasks on the Ray cluster at {address} (2 nodes), 1 CPU and 1 GPU per run" in out
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("run ")] == [
        f"run {k} of 4 done" for k in range(1, 5)]
    local = metrics_files(local_grid / "results")
    assert len(local) == 4 and metrics_files(results) == local
    # The run that died went on from its checkpoint on the head, not from round 0.
    assert "resumed from" in (killed / "run.log").read_text()
    assert json.loads((killed / PLACEMENT_FILE).read_text())["node_id"] == head
    records = placements(results)
    assert len(records) == 4
    for record in records:
        assert record["devices"] in ("0", "1")  # exactly one of its node's two GPUs
    for first in records:  # tasks of one node that ran at the same time never shared a GPU (1 GPU per run)
        for second in records:
            overlap = first["started"] < second["finished"] and second["started"] < first["finished"]
            if first is not second and first["node_id"] == second["node_id"] and overlap:
                assert first["devices"] != second["devices"]
    assert any(first is not second and first["node_id"] == second["node_id"] == head
               and first["started"] < second["finished"] and second["started"] < first["finished"]
               for first in records for second in records), "no two runs overlapped on the head: nothing was checked"


def can_hide_a_folder() -> bool:
    """Whether this machine lets a process see its own folder at a path (a mount namespace with a tmpfs)."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--mount", "--map-root-user", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not can_hide_a_folder(), reason="no mount namespaces here (unshare)")
@pytest.mark.slow
def test_settings_the_cluster_cannot_meet_and_an_unshared_results_folder_are_one_line(tmp_path):
    config = experiment_config()
    experiment = tmp_path / "digits.yaml"
    experiment.write_text(yaml.safe_dump(config))
    results = tmp_path / "results"
    results.mkdir()
    cluster = start_cluster({"num_cpus": 1, "num_gpus": 0})
    node = None
    try:
        ray_flags = ["--executor", "ray", "--ray_address", cluster.address]
        with pytest.raises(TaskHetError) as raised:
            run_pipeline.main([str(experiment), "--results", str(results), *ray_flags, "--gpus_per_run", "1"])
        assert str(raised.value) == (f"--gpus_per_run 1: no node of the Ray cluster at {cluster.address} has 1 GPU "
                                     "(the largest node has 1 CPU and 0 GPUs; 1 CPU and 0 GPUs on 1 node(s) together, "
                                     "but Ray places a run on one node), so a run would never start")
        with pytest.raises(TaskHetError, match=r"^--cpus_per_run 2: no node of the Ray cluster at .* has 2 CPUs \(the "
                                               r"largest node has 1 CPU and 0 GPUs; 1 CPU and 0 GPUs on 1 node\(s\) "
                                               r"together, but Ray places a run on one node\), so a run would never "
                                               r"start$"):
            run_pipeline.main([str(experiment), "--results", str(results), *ray_flags, "--cpus_per_run", "2"])
        # A second node that sees its own (empty) folder at the results' path, as a machine without the shared disk.
        node = subprocess.Popen(
            ["unshare", "--mount", "--map-root-user", "sh", "-c",
             f'mount -t tmpfs tmpfs "$0" && exec "$1" start --address="$2" --num-cpus=1 --block --disable-usage-stats '
             f"--object-store-memory={SMALL_STORE} --min-worker-port=0 --max-worker-port=0 "
             "--dashboard-agent-listen-port=0",
             str(results), str(Path(sys.executable).parent / "ray"), cluster.address],
            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 300
        while sum(entry["Alive"] for entry in cluster.global_state.node_table()) < 2 and time.time() < deadline:
            assert node.poll() is None, "the second node did not start"
            time.sleep(0.2)
        with pytest.raises(TaskHetError) as raised:
            run_pipeline.main([str(experiment), "--results", str(results), *ray_flags])
    finally:
        if node is not None:
            os.killpg(node.pid, signal.SIGTERM)  # the node's whole process group: ray start, its raylet, its workers
            node.wait(60)
        cluster.shutdown()
    message = str(raised.value)
    assert message.startswith(f"--results {results / NAME} is not on storage every Ray node sees: node ")
    assert "cannot read" in message and "(No such file or directory)" in message and "\n" not in message
    assert list(results.rglob("*")) == []  # refused before step 0: nothing written, the marker removed


# ----- a raylet or the head lost mid-grid (pipeline/ray_executor.py: exit_with_raylet, RayExecutor.head_answers) -----

def started(pid: int) -> str | None:
    """``pid``'s start time (clock ticks since boot; None once it has gone or is a zombie): with the pid, it names one
    process, so a pid the kernel reused for someone else's process is never taken for a cluster's."""
    fields = stat_fields(pid)
    return None if fields is None or fields[0] == "Z" else fields[19]


def children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def node_processes(node) -> dict[int, str]:
    """pid -> start time of a node's Ray processes: the ones Ray started for it (GCS, raylet, monitor, ...) and the
    raylet's children (its two agents and the workers), which Ray does not list."""
    pids = [info.process.pid for infos in node.all_processes.values() for info in infos]
    pids += children(raylet_pid(node))
    return {pid: when for pid in pids if (when := started(pid)) is not None}


def left_running(processes: dict[int, str]) -> dict[int, str]:
    """Those of ``processes`` still running (the same pid and start time), with their command lines."""
    alive = {}
    for pid, when in processes.items():
        if started(pid) == when:
            with contextlib.suppress(OSError):
                alive[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:80]
    return alive


def wait_until_gone(processes: dict[int, str], seconds: float) -> dict[int, str]:
    """Poll until none of ``processes`` runs, ``seconds`` at most; returns those still running."""
    deadline = time.time() + seconds
    while left_running(processes) and time.time() < deadline:
        time.sleep(0.2)
    return left_running(processes)


def kill_all(processes: dict[int, str]) -> None:
    for pid in left_running(processes):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def start_driver(experiment: Path, results: Path, address: str, log: Path) -> subprocess.Popen:
    with log.open("w") as console:
        return subprocess.Popen([sys.executable, "run_pipeline.py", str(experiment), "--results", str(results),
                                 "--threads", "1", "--executor", "ray", "--ray_address", address,
                                 "--cpus_per_run", "1", "--max_retries", "2"],
                                cwd=ROOT, stdout=console, stderr=subprocess.STDOUT)


def catch_a_run(driver: subprocess.Popen, results: Path, raylet: int, log: Path | None = None,
                after: str = "") -> tuple[Path, int]:
    """A run in the middle on the node of ``raylet``, frozen (:func:`freeze_in_the_middle`); with ``log``, one caught
    after the driver's console shows ``after``."""
    deadline, caught = time.time() + 300, None
    while caught is None and driver.poll() is None and time.time() < deadline:
        if log is None or after in log.read_text():
            caught = freeze_in_the_middle(run_on(results, raylet))
        time.sleep(0.05)
    assert caught is not None, "no run was caught in the middle on that node"
    return caught


def ray_lines(out: str) -> list[str]:
    """Lines of the driver's console that Ray wrote: its error messages ((raylet) ..., a raylet's state dump) and its
    C++ core's log lines ([2026-01-01 10:00:00,000 E 123 456] file.cc:12: ...)."""
    return [line for line in out.splitlines()
            if "(raylet)" in line or "[state-dump]" in line or line.startswith("[20") or ".cc:" in line]


def done_names(out: str) -> list[str]:
    """The stage names of the ``run k of N done: NAME (...)`` lines, in order."""
    return [line.split(" done: ", 1)[1].rsplit(" (", 1)[0] for line in out.splitlines() if line.startswith("run ")]


@pytest.mark.slow
def test_a_lost_raylet_is_rerun_elsewhere_and_a_lost_head_is_one_line(local_grid, tmp_path):
    """One cluster, a head and a worker node of one CPU each, two grids.

    The worker node's raylet alone is killed (SIGKILL) while a run on it is in the middle: that run's worker ends
    itself, Ray reruns it on the head from its checkpoint, the grid ends with the local metrics.csv byte for byte,
    nothing of the dead node is left running, and Ray's messages about it stay off the console. Then the head is
    killed in the middle of a second grid: the driver says so in one line naming the finished run and the three
    others, within 15 s, and exits with 2. No process of the cluster outlives the test (the head's two agents would
    for about a minute: they wait for the dead GCS to take their report)."""
    cluster = start_cluster({"num_cpus": 1}, {"num_cpus": 1})
    worker, head, address = next(iter(cluster.worker_nodes)), cluster.head_node, cluster.address
    seen = {**node_processes(head), **node_processes(worker)}  # every process of the cluster, killed at the end
    driver = None
    try:
        results = tmp_path / "results"
        log = tmp_path / "driver.log"
        driver = start_driver(copy_of_steps_1_to_3(local_grid, results), results, address, log)
        killed, frozen_pid = catch_a_run(driver, results, raylet_pid(worker))
        dead_node = node_processes(worker)  # its raylet, its two agents and its workers, the frozen one among them
        seen.update(dead_node)
        os.kill(raylet_pid(worker), signal.SIGKILL)  # the raylet alone: its agents and workers must go by themselves
        os.kill(frozen_pid, signal.SIGCONT)  # the run goes on until its worker sees its raylet gone
        assert wait_until_gone(dead_node, 15) == {}, "a process of the dead node outlived it"
        driver.wait(timeout=600)
        out = log.read_text()
        assert driver.returncode == 0, out
        assert ray_lines(out) == [], out
        local = metrics_files(local_grid / "results")
        assert len(local) == 4 and metrics_files(results) == local
        assert "resumed from" in (killed / "run.log").read_text()  # the retry went on from the checkpoint ...
        assert json.loads((killed / PLACEMENT_FILE).read_text())["node_id"] == head.node_id  # ... on the head
        names = done_names(out)
        assert len(names) == 4

        # The head, in the middle of a second grid (one CPU left: one run at a time), once the GCS has marked the
        # worker node dead (the storage check of a new driver would ask it otherwise).
        deadline = time.time() + 60
        while any(entry["Alive"] for entry in cluster.global_state.node_table() if entry["NodeID"] == worker.node_id):
            assert time.time() < deadline, "the GCS did not mark the killed node dead"
            time.sleep(0.2)
        results = tmp_path / "results-2"
        log = tmp_path / "driver-2.log"
        driver = start_driver(copy_of_steps_1_to_3(local_grid, results), results, address, log)
        _, frozen_pid = catch_a_run(driver, results, raylet_pid(head), log, after="run 1 of 4 done")
        seen.update(node_processes(head))
        for pid in [info.process.pid for infos in head.all_processes.values() for info in infos]:
            os.kill(pid, signal.SIGKILL)  # GCS, raylet, monitor, ...; the raylet's agents and workers are left to Ray
        os.kill(frozen_pid, signal.SIGCONT)
        lost = time.time()
        while "error:" not in log.read_text() and driver.poll() is None and time.time() < lost + 60:
            time.sleep(0.1)
        said = time.time() - lost
        driver.wait(timeout=60)  # Ray's exit hook waits about 5 s for the dead GCS after the line
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
        with contextlib.suppress(Exception):  # the head is dead: Cluster.shutdown may complain
            cluster.shutdown()
        kill_all(seen)
    out = log.read_text()
    assert driver.returncode == 2, out
    assert said < 15, f"the line came {said:.1f} s after the kill"
    assert ray_lines(out) == [], out
    line = out.splitlines()[-1]  # the last line: Ray's exit says nothing after it
    finished = done_names(out)  # run 1, and on a loaded machine maybe another before the kill landed
    assert 1 <= len(finished) <= 3, out
    others = [name for name in names if name not in finished]
    assert line.startswith(f"error: the Ray cluster at {address} lost its head (its GCS at {address} stopped "
                           f"answering): of 4 run(s), {len(finished)} finished ({', '.join(finished)}), "
                           f"{len(others)} were running or queued (")
    assert all(f"{name}, " in line or f"{name})" in line for name in others), line
    assert line.endswith("; rerun the same command to resume once the cluster is back (`ray start --head` again, "
                         "then the other nodes): finished runs are kept, the others go on from their checkpoints")
    assert wait_until_gone(seen, 10) == {}
