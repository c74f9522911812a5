"""Benchmark: what one Flower message costs a deployed node, TaskHet's ClientApp against a bare PyTorch one.

A Flower 1.41 SuperNode answers every message in a fresh ``flwr-clientapp`` process
(``--isolation subprocess`` and ``process`` alike; docs/FLOWER.md): the process starts
Python, imports Flower's runtime, pulls the message, imports the app's module, calls the
ClientApp, pushes the reply and exits. This bench runs that life in a fresh process per
message, for two apps and the same kind of message (one ``train`` message, one local step,
32×32 images, batch 2):

* **bare**: ``bench/bench_flower_bare_app.py``, Flower's PyTorch template cut to its core
  (import flwr and torch, build a small CNN, one SGD step on a seeded batch);
* **taskhet**: ``network.flower.app:client_app`` for a node hosting 5 of 10 clients of
  a tiny synthetic Taskonomy run (FedAvg, depth, the ``small_cnn`` encoder): the message is
  the first train message the real ``FlowerEngine`` sends, captured from its Grid.

Only the SuperNode's transport (HTTP to the SuperNode) is left out: the process decodes the
message from Flower's protobuf and encodes its reply, which both apps pay alike. Per process
the bench records wall time (start to exit) and, inside it, when each phase ended:
interpreter up, Flower runtime imported, message decoded, app module imported, handler done,
reply encoded. Runs alternate (bare, taskhet, taskhet, bare, ...) so that load from other
jobs on a shared machine falls on both; the ratio is taskhet ÷ bare of the medians.

``--before DIR`` adds a third app: TaskHet's ClientApp from another checkout ``DIR`` (say the
commit before a change, ``git archive <commit> | tar -x -C DIR``), run on the same message
and this checkout's virtual environment, so a change is measured against its baseline in the
same run.

Then, for this checkout's TaskHet and the bare app: ``python -X importtime`` of one message
(the cumulative import time of each heavy package), and one TaskHet message with timers
around the node's work (prepare and its parts, the data opening, the train step).

``--threads N`` starts every app's processes with N torch threads (``OMP_NUM_THREADS``; default:
torch's own choice, one per core).

Run: ``.venv/bin/python bench/bench_flower_message.py [--before DIR] [--threads N]`` (``--help`` for the repeats).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BARE_APP = "bench.bench_flower_bare_app:app"
TASKHET_APP = "network.flower.app:client_app"
NODE_ID = 1
NODE_CLIENTS = "0,1,2,3,4"  # the node the message goes to hosts half of the 10 clients
PHASES = ("interpreter", "flower runtime", "message decoded", "app imported", "handler", "reply encoded")
HEAVY = ("torch", "flwr", "numpy", "torchvision", "torch._dynamo", "pandas", "PIL", "scipy", "sklearn", "matplotlib",
         "tqdm", "tensorboard", "timm", "clip")
TASKHET_PACKAGES = ("network", "datasets", "models", "training", "partitioning", "losses", "utils", "sparse", "steps",
                    "pipeline")
OWN = "TaskHet's own modules (self time)"
BEFORE = "taskhet-before"
# (module, function) pairs the breakdown times on a node (a missing one is skipped).
BREAKDOWN = (("network.flower.app", "prepare"), ("network.run", "load_manifest"), ("network.run", "load_assignments"),
             ("network.run", "set_deterministic"), ("network.run", "initial_model"), ("network.run", "build_algorithm"),
             ("network.client_data", "make_clients"), ("network.flower.node", "train_client"))


# ----- the child: one message in a fresh process, as flwr-clientapp handles it -----
def child(spec_path: Path, out_path: Path, breakdown: bool) -> None:
    """Handle the message of ``spec_path`` like ``flwr-clientapp``; write the phase times to ``out_path``."""
    marks = {"interpreter": time.time()}
    import flwr.supernode.runtime.run_clientapp  # noqa: F401  (Flower's ClientApp process imports it first)
    from flwr.app import Context, RecordDict
    from flwr.common import serde
    from flwr.proto.message_pb2 import Message as ProtoMessage
    from flwr.supercore.task_identity import TaskIdentity

    marks["flower runtime"] = time.time()
    spec = json.loads(spec_path.read_text())
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, NODE_ID, 2
    message = serde.message_from_proto(ProtoMessage.FromString(Path(spec["message"]).read_bytes()))
    context = Context(run_id=1, node_id=NODE_ID, node_config=spec["node_config"], state=RecordDict(),
                      run_config=spec["run_config"])
    marks["message decoded"] = time.time()
    module, attribute = spec["app"].split(":")
    app = getattr(importlib.import_module(module), attribute)
    marks["app imported"] = time.time()
    timers = install_timers() if breakdown else {}
    reply = app(message=message, context=context)
    marks["handler"] = time.time()
    serde.message_to_proto(reply).SerializeToString()
    marks["reply encoded"] = time.time()
    if reply.has_error():
        raise SystemExit(f"the ClientApp answered with an error: {reply.error.reason}")
    loaded = sorted(name for name in HEAVY if name in sys.modules)
    out_path.write_text(json.dumps({"marks": marks, "timers": timers, "loaded": loaded}))


def install_timers() -> dict[str, float]:
    """Wrap :data:`BREAKDOWN`'s functions so that each adds its seconds to the returned dict (imports first)."""
    timers: dict[str, float] = {}
    began = time.perf_counter()
    for module_name, name in BREAKDOWN:
        module = importlib.import_module(module_name)
        if hasattr(module, name):
            setattr(module, name, timed(getattr(module, name), name, timers))
    timers["imports for the timers"] = time.perf_counter() - began
    return timers


def timed(function, name: str, timers: dict[str, float]):
    """``function``, adding the seconds of each call to ``timers[name]``."""
    def wrapper(*args, **kwargs):
        began = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            timers[name] = timers.get(name, 0.0) + time.perf_counter() - began
    return wrapper


# ----- the parent: the run, the two messages, the interleaved processes -----
def make_run(folder: Path) -> list[str]:
    """A tiny synthetic Taskonomy run of 10 clients (rendered here); its test_fed.py flags."""
    import pandas as pd

    from datasets.selection import SelectionConfig, select_datapoints, write_selection
    from datasets.synthetic import RenderConfig, render_dataset
    from datasets.taskonomy import read_manifest
    from partitioning.assignments import write_assignments

    data = render_dataset(folder / "data", RenderConfig(num_buildings=6, views_per_building=12, views_per_point=3,
                                                        image_size=32, seed=0), workers=1, progress=False)
    selection = select_datapoints(SelectionConfig(data_path=data, top_k_classes=6, test_fraction=0.25,
                                                  split_by="sample", seed=0), progress=False)
    manifest = write_selection(selection, folder / "step1")["manifest"]
    train = read_manifest(manifest).query("split == 'train'").sort_values("sample_id").reset_index(drop=True)
    table = pd.DataFrame({"sample_id": train["sample_id"], "client_id": train.index % 10, "group": train["scene_class"],
                          "subset": ["test" if index % 4 == 3 else "train" for index in train.index]})
    write_assignments(folder / "assignments.csv", table, {"scheme": "round_robin", "n_clients": 10,
                                                          "groups": "scene_class"})
    return ["--task", "depth_euclidean", "--method", "fedavg", "--data_path", str(data), "--manifest", str(manifest),
            "--assignments", str(folder / "assignments.csv"), "--encoder", "small_cnn", "--image_size", "32",
            "--batch_size", "2", "--local_steps", "1", "--n_rounds", "2", "--client_fraction", "0.2",
            "--no-use_accelerator", "--no-progress", "--engine", "flower", "--out", str(folder / "run")]


class CaptureGrid:
    """A Grid that answers node discovery and evaluation in this process and keeps the first train message."""

    def __init__(self, client_app, context) -> None:
        self.client_app, self.context = client_app, context
        self.replies: dict = {}
        self.train_message = None

    def get_node_ids(self) -> list[int]:
        return [NODE_ID]

    def push_messages(self, messages):
        from uuid import uuid4

        from flwr.app import MessageType

        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = str(uuid4())
            if message.metadata.message_type == MessageType.TRAIN:
                self.train_message = message
                raise Captured
            self.replies[message.metadata.message_id] = self.client_app(message, self.context)
            ids.append(message.metadata.message_id)
        return ids

    def pull_messages(self, message_ids):
        return [self.replies.pop(message_id) for message_id in message_ids if message_id in self.replies]


class Captured(Exception):
    """The first train message is in hand: the engine stops there."""


def taskhet_message(folder: Path) -> dict:
    """The first train message of the run, to the node hosting :data:`NODE_CLIENTS` (a spec for :func:`child`)."""
    from flwr.app import Context, RecordDict
    from flwr.common import serde

    from network.flower import app, protocol
    from steps.federated import parse_run_config

    config = parse_run_config(make_run(folder))
    run_config = {protocol.RUN_CONFIG: config.to_json(), protocol.NODE_WAIT: 5.0}
    # The capture's node hosts every client, so that the engine's discovery completes.
    everyone = Context(run_id=1, node_id=NODE_ID, state=RecordDict(), run_config=run_config,
                       node_config={protocol.PARTITION_IDS: ",".join(map(str, range(10))),
                                    protocol.STATE_DIR: str(folder / "states")})
    grid = CaptureGrid(app.client_app, everyone)
    try:
        app.build_engine(grid, Context(run_id=1, node_id=0, state=RecordDict(), node_config={},
                                       run_config=run_config)).run()
    except Captured:
        pass
    message = grid.train_message
    client = str(message.content[protocol.ORDERS_RECORD][protocol.CLIENT_ID])
    nodes = NODE_CLIENTS.split(",")
    if client not in nodes:  # send it to a node that hosts it: the node's other clients are the ones left over
        nodes = [client] + nodes[1:]
    (folder / "taskhet.bin").write_bytes(serde.message_to_proto(message).SerializeToString())
    return {"app": TASKHET_APP, "message": str(folder / "taskhet.bin"), "run_config": run_config,
            "node_config": {protocol.PARTITION_IDS: ",".join(nodes), protocol.STATE_DIR: str(folder / "states")}}


def bare_message(folder: Path) -> dict:
    """A train message of Flower's template app (weights, learning rate, one step, batch 2)."""
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
    from flwr.common import serde

    sys.path.insert(0, str(ROOT / "bench"))
    from bench_flower_bare_app import ARRAYS, CONFIG, Net

    torch.manual_seed(0)
    content = RecordDict({ARRAYS: ArrayRecord(Net().state_dict()),
                          CONFIG: ConfigRecord({"lr": 0.01, "seed": 1, "batch-size": 2, "local-steps": 1})})
    message = Message(content, dst_node_id=NODE_ID, message_type=MessageType.TRAIN, group_id="1")
    message.metadata.__dict__["_message_id"] = "bare-train-1"
    (folder / "bare.bin").write_bytes(serde.message_to_proto(message).SerializeToString())
    return {"app": BARE_APP, "message": str(folder / "bare.bin"), "run_config": {},
            "node_config": {"partition-id": 0, "num-partitions": 2}}


def spawn(spec_path: Path, folder: Path, root: Path = ROOT, breakdown: bool = False, importtime: bool = False,
          threads: int | None = None) -> dict:
    """One message in a fresh process whose code is the checkout ``root`` (with ``threads`` torch threads); its wall
    time and phase times (seconds)."""
    out = folder / f"result-{time.time_ns()}.json"
    command = [sys.executable, *(["-X", "importtime"] if importtime else []), str(Path(__file__).resolve()),
               "--child", str(spec_path), "--child_out", str(out), *(["--breakdown"] if breakdown else [])]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
                   **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    began = time.time()
    done = subprocess.run(command, cwd=root, env=environment, capture_output=True, text=True)
    wall = time.time() - began
    if done.returncode:
        raise SystemExit(f"the message process failed ({spec_path.name}):\n{done.stderr[-3000:]}")
    result = json.loads(out.read_text())
    previous, phases = began, {}
    for phase in PHASES:
        phases[phase] = result["marks"][phase] - previous
        previous = result["marks"][phase]
    phases["exit"] = began + wall - previous
    return {"wall": wall, "phases": phases, "timers": result["timers"], "loaded": result["loaded"],
            "importtime": done.stderr if importtime else ""}


def import_breakdown(stderr: str) -> dict[str, float]:
    """Seconds of each heavy package's first import (cumulative, as ``-X importtime`` reports it) and the self
    time of TaskHet's own modules."""
    seconds: dict[str, float] = {}
    own = 0.0
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        self_us, cumulative_us, name = line[len("import time:"):].split("|")
        if not self_us.strip().isdigit():
            continue
        name = name.strip()
        if name in HEAVY and name not in seconds:
            seconds[name] = int(cumulative_us) / 1e6
        if name.split(".")[0] in TASKHET_PACKAGES:
            own += int(self_us) / 1e6
    seconds[OWN] = own
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="messages per app, interleaved (default: 5)")
    parser.add_argument("--before", type=Path, default=None,
                        help="another TaskHet checkout whose ClientApp is measured too (taskhet-before)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of every message's process (default: torch's choice, one per core)")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--child_out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--breakdown", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        child(args.child, args.child_out, args.breakdown)
        return
    sys.path.insert(0, str(ROOT))
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1  # as in a ServerApp process
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    print(f"{cpu}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start; torch threads per "
          f"message: {args.threads or 'one per core'}")
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        specs = {"bare": bare_message(folder), "taskhet": taskhet_message(folder)}
        paths = {}
        for app, spec in specs.items():
            paths[app] = folder / f"{app}.json"
            paths[app].write_text(json.dumps(spec))
        roots = {"bare": ROOT, "taskhet": ROOT}
        if args.before is not None:
            roots[BEFORE], paths[BEFORE] = args.before.resolve(), paths["taskhet"]
        runs: dict[str, list[dict]] = {app: [] for app in roots}
        for repeat in range(args.repeats):
            apps = list(roots)
            for app in apps[repeat % len(apps):] + apps[:repeat % len(apps)]:  # each app first in turn
                runs[app].append(spawn(paths[app], folder, roots[app], threads=args.threads))
                print(f"  {app:15s} {runs[app][-1]['wall']:6.2f} s", flush=True)
        detail = spawn(paths["taskhet"], folder, breakdown=True, threads=args.threads)
        imports = {app: import_breakdown(spawn(paths[app], folder, roots[app], importtime=True,
                                               threads=args.threads)["importtime"]) for app in roots}
    report(runs, detail, imports)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


def report(runs: dict[str, list[dict]], detail: dict, imports: dict[str, dict[str, float]]) -> None:
    """Print the medians per app and phase, the ratios to the bare app, the TaskHet breakdown and the heavy imports."""
    apps = list(runs)
    median = {app: statistics.median(run["wall"] for run in runs[app]) for app in apps}
    print(f"\nper message, seconds (median of {len(runs['bare'])} processes per app, interleaved):")
    print(f"{'phase':24s}" + "".join(f" {app:>15s}" for app in apps))
    for phase in (*PHASES, "exit"):
        print(f"{phase:24s}" + "".join(f" {statistics.median(run['phases'][phase] for run in runs[app]):15.2f}"
                                       for app in apps))
    print(f"{'wall (start to exit)':24s}" + "".join(f" {median[app]:15.2f}" for app in apps))
    for app in apps[1:]:
        pairs = [mine["wall"] / bare["wall"] for bare, mine in zip(runs["bare"], runs[app])]
        print(f"ratio {app} / bare = {median[app] / median['bare']:.2f} (per repeat: median "
              f"{statistics.median(pairs):.2f}, range {min(pairs):.2f}-{max(pairs):.2f})")
    print("\nTaskHet's node work in one message, seconds (indented: parts of prepare; not timed in the runs above):")
    timers = detail["timers"]
    for module, name in (("", "imports for the timers"), *BREAKDOWN):
        if name in timers:
            label = ("  " if module == "network.run" else "") + name
            print(f"  {label:28s} {timers[name]:6.3f}")
    print("\nimport time of one message, seconds, cumulative (python -X importtime; 0 = not imported):")
    print(f"  {'package':36s}" + "".join(f" {app:>15s}" for app in apps))
    for name in (*HEAVY, OWN):
        print(f"  {name:36s}" + "".join(f" {imports[app].get(name, 0.0):15.2f}" for app in apps))
    print(f"\nheavy modules loaded by TaskHet's message: {', '.join(detail['loaded'])}")


if __name__ == "__main__":
    main()
