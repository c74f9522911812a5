"""Where run_pipeline.py's pooled stages run (pipeline/executors.py): the settings' checks, the local pool's GPU
spreading, the progress lines, and a Ray address that does not answer. Grids on a real two-node Ray cluster are in
tests/test_ray_cluster.py."""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
from pathlib import Path

import pytest
import yaml

import run_pipeline
from pipeline.executors import ExecutorSettings, GridProgress, open_local
from pipeline.pool import PLACEMENT_FILE, PoolStage, named_failure, worker_devices
from tests.test_digits import tiny_digits_experiment
from utils.device import visible_gpu_ids
from utils.errors import DiskFullError, TaskHetError


def write_experiment(tmp_path: Path, **changes) -> Path:
    config = tiny_digits_experiment(tmp_path)
    config["model"]["image_size"] = 8
    config.update(changes)
    path = tmp_path / "digits.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("flags, message", [
    (["--executor", "slurm"], "argument --executor: invalid choice: 'slurm' (choose from 'local', 'ray')"),
    (["--gpus_per_run", "0"], "argument --gpus_per_run: must be a number in (0, 1], got '0'"),
    (["--gpus_per_run", "1.5"], "argument --gpus_per_run: must be a number in (0, 1], got '1.5'"),
    (["--cpus_per_run", "0"], "argument --cpus_per_run: must be a number in (0, 1024], got '0'"),
    (["--max_retries", "-1"], "argument --max_retries: must be an integer in [0, 100], got '-1'"),
    (["--ray_address", "10.0.0.1:6379"], "--ray_address is a setting of --executor ray"),
    (["--max_retries", "2"], "--max_retries is a setting of --executor ray"),
    (["--executor", "ray", "--ray_address", "head-node"], "--ray_address 'head-node' must be auto, HOST:PORT or "
                                                          "ray://HOST:PORT"),
    (["--executor", "ray", "--ray_address", "head:99999"], "--ray_address 'head:99999' must be auto"),
])
def test_a_bad_setting_is_one_line_naming_the_flag_before_any_work(tmp_path, flags, message):
    experiment = write_experiment(tmp_path)
    with pytest.raises(TaskHetError) as raised:
        run_pipeline.main([str(experiment), "--results", str(tmp_path / "results"), *flags])
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert not (tmp_path / "results").exists()


def test_settings_made_in_code_are_checked_like_the_flags():
    with pytest.raises(TaskHetError, match=r"^unknown executor 'dask'; choose one of: local, ray$"):
        ExecutorSettings(executor="dask").check()
    with pytest.raises(TaskHetError, match=r"^--gpus_per_run must be a number in \(0, 1\], got 0$"):
        ExecutorSettings(executor="ray", gpus_per_run=0).check()
    ExecutorSettings(executor="ray", ray_address="ray://head:10001", gpus_per_run=0.25, cpus_per_run=2).check()


def test_visible_gpus_are_read_as_cuda_reads_them(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, GPU-8f2a,-1,3")
    assert visible_gpu_ids() == ["2", "GPU-8f2a"]  # CUDA ignores everything from the first hidden entry on
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpu_ids() == []


def test_workers_go_round_robin_over_the_gpus():
    assert worker_devices(5, ["0", "1"]) == ["0", "1", "0", "1", "0"]
    assert worker_devices(2, ["3", "5", "7"]) == ["3", "5"]
    assert worker_devices(4, []) == []


def test_the_local_pool_checks_gpus_per_run_against_the_visible_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert open_local(ExecutorSettings(jobs=4, gpus_per_run=0.5)).devices == ("0", "1", "0", "1")
    with pytest.raises(TaskHetError, match=r"^--jobs 5 × --gpus_per_run 0.5 asks for 2.5 GPUs, but this machine "
                                           r"shows 2 \(CUDA_VISIBLE_DEVICES='0,1'\); lower --jobs or --gpus_per_run$"):
        open_local(ExecutorSettings(jobs=5, gpus_per_run=0.5))
    assert open_local(ExecutorSettings(jobs=1)).in_process and open_local(ExecutorSettings(jobs=1)).devices == ()


def test_too_many_gpus_for_this_machine_stops_run_pipeline_before_step_0(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    experiment = write_experiment(tmp_path)
    with pytest.raises(TaskHetError, match=r"--jobs 3 × --gpus_per_run 1 asks for 3 GPUs, but this machine shows 2"):
        run_pipeline.main([str(experiment), "--results", str(tmp_path / "results"), "--jobs", "3", "--gpus_per_run", "1"])
    assert not (tmp_path / "results").exists()


@pytest.mark.slow
def test_each_local_worker_sees_one_gpu_of_its_own(tmp_path, monkeypatch, capsys):
    """Fake GPUs: no CUDA here, so the runs use the CPU; what each worker was given is in its runs' placement.json."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    experiment = write_experiment(tmp_path)
    run_pipeline.main([str(experiment), "--results", str(tmp_path / "results"), "--jobs", "2", "--threads", "1"])
    out = capsys.readouterr().out
    assert "step 3c: 2 readings; step 4: 2 runs, 2 at a time in worker processes; each sees one GPU of 0, 1" in out
    placements = [json.loads(path.read_text()) for path in (tmp_path / "results").rglob(PLACEMENT_FILE)]
    assert len(placements) == 4  # 2 readings and 2 runs, each recorded where it ran
    device_of = {}
    for record in placements:
        assert record["devices"] in ("0", "1")  # exactly one id, never the pipeline's "0,1"
        assert device_of.setdefault(record["pid"], record["devices"]) == record["devices"]  # a worker keeps its GPU
    assert len(set(device_of.values())) == len(device_of)  # two workers, two GPUs
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("run ")] == [
        f"run {k} of 4 done" for k in range(1, 5)]


def test_a_worker_sees_the_gpus_the_pipeline_sees_when_its_pool_starts(monkeypatch):
    """The pool's fork server keeps the environment of its own start (an earlier pool of this process); a worker
    without a GPU of its own must see what the pipeline sees now, and one given a GPU only that one."""
    from pipeline.pool import worker_pool

    for visible, devices, expected in (("5", None, ["5"]), (None, None, [None]), ("0,1", ["1"], ["1"])):
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        with worker_pool(1, 1, devices) as pool:
            assert [pool.submit(os.getenv, "CUDA_VISIBLE_DEVICES").result()] == expected


def imported(module: str) -> bool:
    return module in sys.modules


def test_a_worker_starts_with_torch_dynamo_imported_by_its_fork_server():
    """Each stage's first optimizer step imports torch._dynamo (about 1.6 s of CPU); the fork server imports it
    once, so a worker forked from it has it before it runs anything."""
    from pipeline.pool import worker_pool

    with worker_pool(1, 1) as pool:
        assert pool.submit(imported, "torch._dynamo").result()
        assert not pool.submit(imported, "sklearn.cluster").result()  # only what the server was asked to import


def test_the_storage_check_task_answers_what_a_node_cannot_do(tmp_path):
    from pipeline.ray_probe import probe_storage  # its imports: tests/test_flower_imports.py

    marker = tmp_path / "marker"
    marker.write_text("token")
    assert probe_storage(str(tmp_path), str(marker), "token", "n1") is None
    assert (tmp_path / "marker.n1").read_text() == "token"  # the reply the driver reads
    assert probe_storage(str(tmp_path / "nowhere"), str(marker), "token", "n1").startswith("has no folder")
    assert probe_storage(str(tmp_path), str(marker), "other", "n1").startswith("reads another file")
    assert probe_storage(str(tmp_path), str(tmp_path / "missing"), "token", "n1").startswith("cannot read")


def test_progress_lines_count_the_runs_and_say_the_time_left(capsys):
    times = iter([0.0, 10.0, 1500.0, 1501.0, 1530.0])  # the start, then each run's end
    logged = []
    progress = GridProgress(4, clock=lambda: next(times), log=logged.append)
    stage = PoolStage("step 4: iid seed 0", Path("x"), {}, [])
    progress.done(stage, {"host": "vm", "devices": "1", "ran": True, "started": 1000.0, "finished": 1009.6})
    progress.done(stage, {"node_ip": "10.0.0.5", "host": "b", "devices": "", "ran": True})
    progress.done(stage, {"host": "vm", "ran": False, "started": 1.0, "finished": 2.0})
    progress.done(stage, {"host": "vm", "devices": None})
    assert capsys.readouterr().out.splitlines() == [
        "run 1 of 4 done: step 4: iid seed 0 (host vm, GPU 1, 10 s); 0:00:10 elapsed, ETA 0:00:30",  # 3 left, 10 s each
        "run 2 of 4 done: step 4: iid seed 0 (Ray node 10.0.0.5); 0:25:00 elapsed, ETA 0:25:00",  # 2 left, 750 s each
        "run 3 of 4 done: step 4: iid seed 0 (already done); 0:25:01 elapsed, ETA 0:08:20",  # 1 left, 500.33 s
        "run 4 of 4 done: step 4: iid seed 0 (host vm); 0:25:30 elapsed, ETA 0:00:00"]  # none left
    assert logged[1] == "run 2 of 4 done: step 4: iid seed 0 (Ray node 10.0.0.5); 0:25:00 elapsed, ETA 0:25:00"


@pytest.mark.slow
def test_jobs_1_and_jobs_2_print_the_same_run_lines_with_an_eta(tmp_path, capsys):
    """--jobs 1 runs the stages in the pipeline's own process, --jobs 2 in workers: the same ``run k of N`` lines
    (console and run.log), and no ``step k of N`` line beside them where no bar is drawn."""
    from pipeline.runner import Pipeline

    lines = {}
    for jobs in (1, 2):
        out = tmp_path / f"jobs{jobs}"
        stages = [PoolStage(f"step 4: run {name}", out / name, {}, [str(out / f"{name}.pid"), str(out / name), "0"],
                            script="tests.sleeping_stage") for name in "ab"]
        pipeline = Pipeline({"data": {}, "use_accelerator": False}, out, "run_pipeline.py x.yaml", jobs=jobs,
                            threads=1, show_progress=False)
        with pipeline.progress_bar(2, "pipeline") as pipeline.progress:
            pipeline.run_pooled(stages)
        assert pipeline.progress.n == 2
        logged = [line.split(" ", 2)[2] for line in (out / "run.log").read_text().splitlines()]
        printed = capsys.readouterr().out.splitlines()
        assert printed == logged  # run.log keeps what the console said
        assert printed[-1].endswith(" elapsed, ETA 0:00:00")  # the last run: nothing left
        # Which of two runs in two workers ends first is the machine's choice, and so are the times.
        lines[jobs] = [re.sub(r"run [ab] \(host \S+, 0 s\); \d+:\d\d:\d\d elapsed, ETA \d+:\d\d:\d\d$",
                              "run S (host H, 0 s); H:MM:SS elapsed, ETA H:MM:SS", line) for line in printed]
    assert lines[1] == ["step 4: 2 runs, one at a time in this process",
                        "run 1 of 2 done: step 4: run S (host H, 0 s); H:MM:SS elapsed, ETA H:MM:SS",
                        "run 2 of 2 done: step 4: run S (host H, 0 s); H:MM:SS elapsed, ETA H:MM:SS"]
    assert lines[2] == ["step 4: 2 runs, 2 at a time in worker processes", *lines[1][1:]]


def test_a_stage_failure_keeps_its_class_and_gains_the_stage_name():
    error = named_failure(PoolStage("step 4: iid seed 0", Path("x"), {}, []), DiskFullError("x/metrics.csv: full"))
    assert type(error) is DiskFullError and str(error) == "step 4: iid seed 0: x/metrics.csv: full"


def test_a_ray_address_that_does_not_answer_is_one_line(tmp_path):
    pytest.importorskip("ray")
    experiment = write_experiment(tmp_path)
    with socket.socket() as closed:  # bound, never listening: a connection is refused
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
        with pytest.raises(TaskHetError) as raised:
            run_pipeline.main([str(experiment), "--results", str(tmp_path / "results"), "--executor", "ray",
                               "--ray_address", address])
    assert str(raised.value).startswith(f"--ray_address {address}: nothing answers there (Connection refused)")
    assert not (tmp_path / "results").exists()


def join_fails_in_one_line_within_10_s(tmp_path, address: str) -> str:
    """run_pipeline.py's line for ``address`` (the elapsed time includes importing Ray). The join runs in a thread
    the test waits 20 s for, so a check that lets Ray retry for minutes fails here instead of hanging the suite."""
    import threading

    experiment = write_experiment(tmp_path)
    outcome: dict[str, BaseException] = {}

    def join() -> None:
        try:
            run_pipeline.main([str(experiment), "--results", str(tmp_path / "results"), "--executor", "ray",
                               "--ray_address", address])
        except BaseException as error:  # noqa: BLE001 (handed to the test)
            outcome["error"] = error

    started = time.monotonic()
    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    thread.join(20)
    if thread.is_alive():
        pytest.fail(f"--ray_address {address}: no line after 20 s")
    assert time.monotonic() - started < 10 and isinstance(outcome.get("error"), TaskHetError), outcome
    assert "\n" not in str(outcome["error"]) and not (tmp_path / "results").exists()
    return str(outcome["error"])


def test_a_port_that_answers_http_is_no_ray_cluster_in_one_line(tmp_path):
    pytest.importorskip("ray")
    import http.server
    import threading

    class Quiet(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):  # no request lines on the test's stderr
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        address = f"127.0.0.1:{server.server_address[1]}"
        line = join_fails_in_one_line_within_10_s(tmp_path, address)
        server.shutdown()
    assert line.startswith(f"--ray_address {address}: something answers there, but not a Ray cluster's GCS (UNAVAILABLE")


def test_a_port_that_accepts_and_says_nothing_is_no_ray_cluster_within_the_bound(tmp_path):
    pytest.importorskip("ray")
    with socket.socket() as silent:  # listens, never speaks: the GCS read runs out of its time
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        line = join_fails_in_one_line_within_10_s(tmp_path, address)
    assert line.startswith(f"--ray_address {address}: something answers there, but not a Ray cluster's GCS (")


@pytest.mark.parametrize("recorded, says", [
    ({"ray_version": "1.13.0", "python_version": "3.11.7"}, "that cluster runs Ray 1.13.0 on Python 3.11.7, this machine Ray"),
    ({"ray_version": "<ours>", "python_version": "3.9.1"}, "on Python 3.9.1, this machine Ray"),
    (None, "recorded no Ray and Python versions"),
])
def test_a_gcs_of_another_version_is_one_line(tmp_path, recorded, says):
    """A gRPC server that answers the head's key-value read as a GCS does, with versions of our choosing."""
    ray = pytest.importorskip("ray")
    import json
    from concurrent import futures

    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    value = b"" if recorded is None else json.dumps(
        {key: ray.__version__ if text == "<ours>" else text for key, text in recorded.items()}).encode()

    class FakeGcs(gcs_service_pb2_grpc.InternalKVGcsServiceServicer):
        def InternalKVGet(self, request, context):  # noqa: N802 (the service's name)
            assert (request.key, request.namespace) == (b"CLUSTER_METADATA", b"cluster")
            return gcs_service_pb2.InternalKVGetReply(value=value)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    gcs_service_pb2_grpc.add_InternalKVGcsServiceServicer_to_server(FakeGcs(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        line = join_fails_in_one_line_within_10_s(tmp_path, f"127.0.0.1:{port}")
    finally:
        server.stop(None)
    assert says in line


# ----- the Ray executor starts its workers together (a stand-in for ray: each task a thread) -----
class ThreadRay:
    """``ray.remote(**resources)(fn).remote(*args)`` runs ``fn`` in a thread; ``ray.get`` joins them. Records the
    resources each remote function declared."""

    def __init__(self):
        self.declared = []

    def remote(self, **resources):
        import threading

        self.declared.append(resources)

        def wrap(fn):
            class Remote:
                @staticmethod
                def remote(*args):
                    result = {}
                    thread = threading.Thread(target=lambda: result.update(value=fn(*args)))
                    thread.start()
                    return thread, result

            return Remote

        return wrap

    @staticmethod
    def get(refs):
        for thread, _ in refs:
            thread.join()
        return [result["value"] for _, result in refs]


def thread_executor(tmp_path, cpus=1.0, gpus=0.0, node_cpus=(2.0, 3.0)):
    from pipeline.ray_executor import RayExecutor

    nodes = [{"Resources": {"CPU": value}} for value in node_cpus]
    return RayExecutor(ThreadRay(), "a stand-in", nodes, cpus, gpus, 0, None, str(tmp_path), tmp_path / "results")


def test_the_workers_start_together_each_task_held_until_all_checked_in(tmp_path):
    from pipeline import ray_executor

    executor = thread_executor(tmp_path)
    assert executor.slots() == 5  # 2 + 3 CPUs at 1 a run
    assert thread_executor(tmp_path, cpus=1.5).slots() == 1 + 2
    (tmp_path / "results").mkdir()
    executor.start_workers(3)
    assert executor.ray.declared == [{"num_cpus": 1.0, "max_retries": 0}]  # the runs' own CPUs: one worker each
    assert list((tmp_path / "results").iterdir()) == []  # the check-in folder is gone
    # A task waits for the others: with 2 of 3 checked in it returns only at its deadline.
    folder = tmp_path / "check-in"
    folder.mkdir()
    (folder / "another-1").touch()
    start = ray_executor.time.monotonic()
    assert ray_executor.hold_a_worker(str(folder), 3, 0.3) == ray_executor.os.getpid()
    waited = ray_executor.time.monotonic() - start
    assert waited >= 0.3 and len(list(folder.iterdir())) == 2
    (folder / "another-2").touch()
    start = ray_executor.time.monotonic()
    ray_executor.hold_a_worker(str(folder), 3, 30)  # the third check-in: nothing to wait for
    assert ray_executor.time.monotonic() - start < 30


@pytest.mark.parametrize("gpus, count", [(1.0, 4), (0.0, 1)])
def test_no_warm_up_for_gpu_tasks_or_a_single_run(tmp_path, gpus, count):
    executor = thread_executor(tmp_path, gpus=gpus)
    executor.start_workers(count)
    assert executor.ray.declared == []  # GPU tasks get a fresh process each; one run has nothing to wait beside
