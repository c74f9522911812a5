"""Step 4: federated training of a task model over the clients of an assignment file."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import torch
from torch.utils.data import DataLoader

from datasets.taskonomy import read_manifest
from models import build_task_model, get_task, load_task_model
from network.aggregation import SERVER_OPTIMIZERS
from network.algorithms import AlgorithmConfig, get_algorithm, list_algorithms
from network.algorithms.scaffold import OPTIONS as SCAFFOLD_OPTIONS
from network.client_data import global_test_loader, make_clients
from network.engine_sequential import (GLOBAL_CLIENT, GLOBAL_TEST_SPLIT, PERSONAL_TEST_SPLIT, ClientData, EngineConfig, SequentialEngine,
                                       make_lr_schedule)
from partitioning.assignments import load_assignments
from partitioning.groupings import EMBEDDING_BASED, GROUPINGS, LABEL_BASED, canonical_grouping
from training.loop import evaluate
from utils.cli import positive_float, positive_int, run_main
from utils.device import pick_device, prepare_model
from utils.errors import TaskHetError
from utils.run_dir import setup_logging, write_config
from utils.seeding import set_deterministic

__all__ = ["GLOBAL_CLIENT", "GLOBAL_TEST_SPLIT", "PERSONAL_TEST_SPLIT", "main"]

DESCRIPTION = """Step 4 of TaskHet: federated training (FedAvg, FedProx, SCAFFOLD, FedRep) of one task's model.
Inputs: the step-1 manifest (--manifest), the data under --data_path and a step-3b assignments.csv (--assignments;
default <assignment_files_path>/<type>/<task|labels>[/k<n_clusters>]/a<alpha>/assignments.csv), checked against
the manifest. Clients train on their 'train' rows; their 'test' rows and the manifest's test split evaluate.
Outputs in --out: config.json, run.log, metrics.csv (round, split, client, metric, value), checkpoint.pt (every
round; --resume continues from it), best.pt (lowest global test loss) and curves.png."""

ENGINES = ("sequential", "flower")  # round loops over the same algorithm objects
# Arguments that do not change what a run computes: a resumed run may differ in them.
NOT_IN_SIGNATURE = ("out", "resume", "use_accelerator", "num_workers", "cache_dir", "deterministic", "n_rounds",
                    "eval_every", "progress", "client_state_memory_mb", "engine", "flower_mode", "flower_num_cpus",
                    "flower_num_gpus", "min_available_clients")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--task", required=True, help="task to train (depth_euclidean, normal, segment_semantic, class_scene, ...)")
    add("--method", default="fedavg", choices=list_algorithms(), help="federated algorithm (default: fedavg)")
    add("--engine", default="sequential", choices=ENGINES, help="round loop (default: sequential)")
    add("--flower_mode", choices=("simulation",), default="simulation",
        help="--engine flower: Flower's simulation runtime on this machine (a real deployment: docs/FLOWER.md)")
    add("--flower_num_cpus", type=positive_float, default=1.0, help="--engine flower: CPU cores per client (default: 1)")
    add("--flower_num_gpus", type=float, default=0.0, help="--engine flower: share of a GPU per client, e.g. 0.25 (default: 0)")
    add("--min_available_clients", type=positive_int, default=None,
        help="--engine flower: results a round needs; failed clients beyond that are logged by id (default: all sampled)")
    add("--manifest", type=Path, default=Path("results/datapoints/manifest.csv"), help="step-1 manifest.csv")
    add("--data_path", type=Path, default=Path("data/synthetic"), help="data root (default: data/synthetic)")
    add("--assignments", type=Path, default=None, help="assignments.csv of step 3b (default: see above)")
    add("--assignment_files_path", type=Path, default=Path("results/assignments"), help="folder of assignment files")
    add("--type", type=canonical_grouping, choices=GROUPINGS, default=None,
        help="partition kind, checked against the file (class_based: the old name of label_based)")
    add("--alpha", type=positive_float, default=None, help="Dirichlet α of the partition (checked against the file)")
    add("--n_clients", type=positive_int, default=None, help="number of clients (checked against the file)")
    add("--n_clusters", type=positive_int, default=10, help="KMeans clusters of an embedding-based partition (default path)")
    add("--encoder", default="resnet50", help="encoder of a model built from scratch (default: resnet50)")
    add("--weights", default="none", help="encoder weights from scratch: none | imagenet | clip | PATH (default: none)")
    add("--init_from", choices=("scratch", "centralized"), default="scratch", help="initial global model (default: scratch)")
    add("--centralized_checkpoint", type=Path, default=None, help="step-2 best.pt for --init_from centralized")
    add("--image_size", type=positive_int, default=224, help="image side length (default: 224)")
    add("--n_rounds", type=positive_int, default=100, help="federated rounds (default: 100)")
    add("--local_steps", "--sgd_per_epoch", type=positive_int, default=None, help="J local SGD steps per round (default: 50)")
    add("--local_epochs", type=positive_int, default=None, help="E local epochs per round instead of --local_steps")
    add("--batch_size", type=positive_int, default=16, help="local batch size (default: 16)")
    add("--init_lr", type=positive_float, default=0.01, help="local learning rate of round 1 (default: 0.01)")
    add("--lr_schedule", default="constant", help="constant | cosine | exponential:RATE | step:EVERY:GAMMA (per round)")
    add("--momentum", type=float, default=0.0, help="local SGD momentum (default: 0)")
    add("--weight_decay", type=float, default=0.0, help="local SGD weight decay (default: 0)")
    add("--client_fraction", type=positive_float, default=1.0, help="share of clients per round (default: 1)")
    add("--mu", type=float, default=0.01, help="FedProx μ (default: 0.01)")
    add("--server_opt", choices=SERVER_OPTIMIZERS, default="sgd", help="server optimizer (FedAvgM, FedAdam)")
    add("--server_lr", type=positive_float, default=1.0, help="server learning rate η_g (default: 1)")
    add("--scaffold_option", choices=SCAFFOLD_OPTIONS, default="II", help="SCAFFOLD control-variate update (default: II)")
    add("--head_epochs", type=int, default=1, help="FedRep head phase, in local budgets (default: 1)")
    add("--body_epochs", type=int, default=1, help="FedRep body phase, in local budgets (default: 1)")
    add("--eval_every", type=positive_int, default=1, help="evaluate every this many rounds (default: 1)")
    add("--rand_seed", "--seed", type=int, default=42, help="root seed of init, sampling and training (default: 42)")
    add("--deterministic", action=argparse.BooleanOptionalAction, default=False, help="deterministic kernels")
    add("--use_accelerator", action=argparse.BooleanOptionalAction, default=True, help="CUDA/MPS when present")
    add("--num_workers", type=int, default=0, help="DataLoader worker processes (default: 0)")
    add("--cache_dir", type=Path, default=None, help="decoded-sample cache folder (default: none)")
    add("--client_state_memory_mb", type=float, default=2048, help="client state kept in memory, MB; more spills to disk")
    add("--progress", action=argparse.BooleanOptionalAction, default=True, help="tqdm bar over rounds")
    add("--resume", action=argparse.BooleanOptionalAction, default=True, help="continue from <out>/checkpoint.pt")
    add("--out", type=Path, default=None, help="run folder (default: results/test_federated/<task>/<type>/<method>/...)")
    return parser


def resolve(args: argparse.Namespace, meta: dict) -> argparse.Namespace:
    """Check the arguments against each other and against the assignment file's sidecar ``meta``."""
    if args.local_steps is not None and args.local_epochs is not None:
        raise TaskHetError("pass one of --local_steps (--sgd_per_epoch) and --local_epochs, not both")
    if args.local_steps is None and args.local_epochs is None:
        args.local_steps = 50
    kind = EMBEDDING_BASED if str(meta.get("groups", "scene_class")).endswith(".csv") else LABEL_BASED
    for flag, given, recorded in (("type", args.type, kind if meta else None), ("n_clients", args.n_clients, meta.get("n_clients")),
                                  ("alpha", args.alpha, meta.get("alpha"))):
        if given is not None and recorded is not None and given != recorded:
            raise TaskHetError(f"--{flag} {given} does not match {args.assignments}, made with {flag} {recorded}")
    args.type = args.type or kind
    args.alpha = args.alpha if args.alpha is not None else meta.get("alpha")
    if args.init_from == "centralized" and args.centralized_checkpoint is None:
        raise TaskHetError("--init_from centralized needs --centralized_checkpoint (a step-2 best.pt)")
    if args.out is None:
        args.out = Path("results/test_federated") / args.task / args.type / args.method / f"a{args.alpha}-s{args.rand_seed}"
    return args


def default_assignments(args: argparse.Namespace) -> Path:
    if args.alpha is None or args.type is None:
        raise TaskHetError("pass --assignments FILE, or --type and --alpha to find it under --assignment_files_path")
    owner = Path(args.task, f"k{args.n_clusters}") if args.type == EMBEDDING_BASED else Path("labels")
    return args.assignment_files_path / args.type / owner / f"a{args.alpha:g}" / "assignments.csv"


def initial_model(args: argparse.Namespace, num_classes: int | None):
    if args.init_from == "scratch":
        return build_task_model(args.task, args.encoder, args.weights, num_classes=num_classes, seed=args.rand_seed)
    model = load_task_model(args.centralized_checkpoint)
    if model.config["task"] != args.task:
        raise TaskHetError(f"--centralized_checkpoint {args.centralized_checkpoint} is a {model.config['task']} model, "
                           f"not {args.task}")
    return model


@dataclass
class FedSetup:
    """Everything a run needs except the client data (which a Flower node builds for its own clients only)."""

    args: argparse.Namespace
    task: Any
    manifest: pd.DataFrame
    table: pd.DataFrame
    model: torch.nn.Module
    algorithm: Any
    config: EngineConfig
    device: torch.device
    loss_fn: Callable
    evaluate_fn: Callable


def prepare(args: argparse.Namespace) -> FedSetup:
    """Read and check the inputs, then build the model, algorithm and engine config (test_fed and flower_app)."""
    task = get_task(args.task)
    args.assignments = args.assignments or default_assignments(args)
    manifest = read_manifest(args.manifest)
    table, meta = load_assignments(args.assignments, manifest)
    args = resolve(args, meta)
    set_deterministic(args.deterministic)
    num_classes = int(manifest["scene_class"].max()) + 1 if task.kind == "classification" else None
    device = pick_device(args.use_accelerator)
    algorithm = get_algorithm(args.method, AlgorithmConfig(
        num_clients=int(meta.get("n_clients") or table["client_id"].nunique()), mu=args.mu,
        server_opt=args.server_opt, server_lr=args.server_lr, scaffold_option=args.scaffold_option,
        head_epochs=args.head_epochs, body_epochs=args.body_epochs))
    config = EngineConfig(
        out_dir=args.out, n_rounds=args.n_rounds, lr_schedule=make_lr_schedule(args.lr_schedule, args.init_lr, args.n_rounds),
        seed=args.rand_seed, local_steps=args.local_steps, local_epochs=args.local_epochs,
        client_fraction=args.client_fraction, eval_every=args.eval_every, momentum=args.momentum,
        weight_decay=args.weight_decay, resume=args.resume, progress=args.progress,
        max_state_memory_bytes=int(args.client_state_memory_mb * 2**20),
        signature={key: str(value) for key, value in vars(args).items() if key not in NOT_IN_SIGNATURE})
    return FedSetup(
        args=args, task=task, manifest=manifest, table=table, algorithm=algorithm, config=config, device=device,
        model=prepare_model(initial_model(args, num_classes), device),
        loss_fn=lambda net, batch: task.loss(net(batch["rgb"])[0].float(), batch),
        # The model's own device, not the server's: Flower nodes may train on another device.
        evaluate_fn=lambda net, loader: evaluate(net, loader, task, next(net.parameters()).device, progress=False))


def build_clients(args: argparse.Namespace, manifest, table, task) -> tuple[list[ClientData], DataLoader]:
    """The clients of the assignments and the global test loader."""
    return make_clients(args, manifest, table, task), global_test_loader(args, manifest, task)


def main(argv: list[str] | None = None) -> dict:
    setup = prepare(build_parser().parse_args(argv))
    args = setup.args
    args.out.mkdir(parents=True, exist_ok=True)
    logger = setup_logging(args.out, "test_fed")
    write_config(args.out, vars(args))
    clients, test_loader = build_clients(args, setup.manifest, setup.table, setup.task)
    logger.info("%s on %s: %d clients (%d train samples), %d test samples, device %s", args.method, args.task,
                len(clients), sum(client.num_samples for client in clients), len(test_loader.dataset), setup.device)
    inputs = (setup.model, setup.algorithm, clients, setup.loss_fn, setup.evaluate_fn, test_loader, setup.config,
              setup.device)
    if args.engine == "flower":
        from network.engine_flower import FlowerOptions, run_flower  # only here: the sequential path never imports flwr

        engine = run_flower(*inputs, model_config=setup.model.config, logger=logger, options=FlowerOptions(
            mode=args.flower_mode, num_cpus=args.flower_num_cpus, num_gpus=args.flower_num_gpus,
            min_available_clients=args.min_available_clients))
    else:
        engine = SequentialEngine(*inputs, model_config=setup.model.config, logger=logger)
        engine.run()
    return {"out": args.out, "best_test_loss": engine.best_loss}


if __name__ == "__main__":
    run_main(main)
