"""Benchmark: step 4's checkpoint sizes at experiments/paper.yaml's scale, per algorithm, written to disk.

paper.yaml trains ResNet50 (encoder not frozen, so checkpoints hold it whole) with 25 clients, FedAvg, FedProx,
SCAFFOLD and FedRep. For a dense task (normal) and the classification task (class_scene, 16 classes) this builds
each algorithm on that model, takes one client's state after one local step (on a random 2-image batch: the sizes
of the tensors, not their values, matter), gives every one of the 25 clients a copy of it (a copy each: torch.save
writes a storage shared by several entries once), and writes with ``atomic_torch_save`` what the engine writes:

* ``during the run``: checkpoint.pt with the server state and all 25 clients' states (every client sampled once,
  as after a few rounds at client_fraction 0.4);
* ``finished``: checkpoint.pt as a finished run writes it now (no client states; ``--keep_client_state`` keeps
  them) and best.pt.

Usage: ``.venv/bin/python bench/bench_checkpoint_sizes.py [--clients 25] [--tasks normal,class_scene]``. Prints
one line per task and algorithm, in MiB, and the grid's total at paper.yaml's 210 runs per task (7 tasks).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from models import build_task_model  # noqa: E402
from network.algorithms import build_algorithm  # noqa: E402
from network.algorithms.base import ClientConfig, Upload  # noqa: E402
from utils.run_dir import atomic_torch_save  # noqa: E402

ALGORITHMS = {"fedavg": {}, "fedprox": {"mu": 0.01}, "scaffold": {}, "fedrep": {"head_epochs": 1, "body_epochs": 1}}
CLASSES = 16  # paper.yaml's top_k_classes
MIB = 2**20


def saved_mib(obj: dict, folder: Path) -> float:
    """The size of ``obj`` written as the engine writes a checkpoint."""
    path = folder / "probe.pt"
    atomic_torch_save(obj, path)
    size = path.stat().st_size / MIB
    path.unlink()
    return size


def one_client_round(algorithm, worker: torch.nn.Module, server):
    """A client's result after one local step on a random batch (its tensors' sizes are what count)."""
    def loss_fn(net, batch, reduction="mean"):
        return net(batch["x"])[0].float().pow(2).mean()

    cfg = ClientConfig(lr=1e-3, loss_fn=loss_fn, device=torch.device("cpu"), num_samples=10, local_steps=1)
    batch = {"x": torch.rand(2, 3, 64, 64)}
    broadcast = algorithm.client_broadcast(server, algorithm.broadcast(server), "0")
    return algorithm.client_update(worker, broadcast, {}, [batch], cfg)


def measure(task: str, method: str, settings: dict, clients: int, folder: Path) -> tuple[float, float, float]:
    """(checkpoint during the run, finished checkpoint, best.pt) in MiB."""
    torch.manual_seed(0)
    model = build_task_model(task, "resnet50", "none", num_classes=CLASSES)
    ids = {str(index): 10 for index in range(clients)}
    algorithm, worker = build_algorithm(method, model, ids, settings)
    weights = {key: value.detach().clone() for key, value in worker.state_dict().items()}
    server = algorithm.init_server(weights)
    result = one_client_round(algorithm, worker, server)
    server = algorithm.aggregate(server, [Upload("0", result.upload, 10)])  # the server state after a round
    state = result.client_state
    states = {client: {key: value.clone() for key, value in state.items()} for client in ids}
    global_weights = next(iter(algorithm.evaluated_models(server).values()))
    checkpoint = {"round": 1, "model": global_weights, "server": server.as_dict(), "best_loss": 0.0}
    during = saved_mib({**checkpoint, "client_states": states}, folder)
    finished = saved_mib({**checkpoint, "client_states": {}}, folder)
    best = saved_mib({"model": global_weights, "models": server.models}, folder)
    return during, finished, best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=25, help="clients with a state (default: paper.yaml's 25)")
    parser.add_argument("--tasks", default="normal,class_scene", help="tasks to measure (default: normal,class_scene)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=".") as scratch:
        for task in args.tasks.split(","):
            for method, settings in ALGORITHMS.items():
                during, finished, best = measure(task, method, settings, args.clients, Path(scratch))
                print(f"{task:12s} {method:9s} checkpoint during the run {during:8.1f} MiB, finished {finished:6.1f} MiB, "
                      f"best.pt {best:6.1f} MiB; kept per run after it ends {finished + best:6.1f} MiB "
                      f"(with --keep_client_state {during + best:7.1f})", flush=True)


if __name__ == "__main__":
    main()
