"""Step 3c: the heterogeneity meter of one partition: G² and B² of the clients' gradients at a trained model.

Inputs: a step-2 checkpoint (best.pt: the centralized model the gradients are taken at),
the step-1 manifest, the data root and a step-3b assignments.csv. For every client, the
full-batch gradient of its mean loss over its train rows; then the gradient dissimilarity
G² = Σ_k p_k ‖∇F_k − ∇F‖² and FedProx's B² = Σ_k p_k ‖∇F_k‖² / ‖∇F‖² (p_k = n_k / n;
network/heterogeneity.py). Outputs in --out: meter.json (g2, b2, ‖∇F‖², clients),
metrics.csv (client, metric, value: each client's n_k and ‖∇F_k‖², and the totals),
config.json, run.log. run_pipeline.py runs it for every partition it makes.
"""

from __future__ import annotations

import utils.tv_compat  # noqa: F401  (before anything imports torchvision)

import argparse
import json
import logging
from pathlib import Path

import pandas as pd
from torch import nn

from datasets.encoded import check_frozen, model_input_key
from datasets.family import DataFamily, load_manifest
from models import get_task, load_task_model
from models.tasks import TaskSpec
from network.client_skews import client_rows_dataset, run_skews
from network.heterogeneity import dissimilarity, full_gradient
from partitioning.assignments import load_assignments
from steps.embed import add_model_input_arguments, trained_model_checkpoint, training_image_size
from training.loop import make_loader
from utils import cli
from utils.device import pick_device, prepare_model
from utils.locks import folder_lock
from utils.run_dir import MetricsCSV, atomic_write_text, claim_folder, run_log, unfinished, write_config

METER_FILE = "meter.json"
STEP = "step 3c"


def build_parser() -> argparse.ArgumentParser:
    """The step-3c command line (measure_heterogeneity.py --help)."""
    parser = cli.ArgumentParser(description=__doc__, formatter_class=cli.DefaultsHelpFormatter)
    add_model_input_arguments(parser, "step-1 manifest.csv")
    parser.add_argument("--assignments", type=Path, required=True, help="step-3b assignments.csv")
    parser.add_argument("--cache_features", action=argparse.BooleanOptionalAction, default=False,
                        help="the checkpoint's frozen encoder's maps, computed once per sample (in --cache_dir)")
    cli.add_runtime_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> dict:
    """Measure one partition; returns what meter.json holds."""
    args = cli.apply_runtime_flags(build_parser().parse_args(argv))
    with folder_lock(args.out):  # one run at a time writes the folder
        return meter(args)


def meter(args: argparse.Namespace) -> dict:
    """Measure and write, holding the lock of ``args.out`` (see :func:`main`)."""
    claim_folder(args.out, STEP)
    trained_model_checkpoint(args.checkpoint)
    family, manifest = load_manifest(args.manifest)
    table, _ = load_assignments(args.assignments, manifest)
    model = load_task_model(args.checkpoint)
    if args.cache_features:
        check_frozen(model.encoder, f"--cache_features (checkpoint {args.checkpoint})")
    task = get_task(model.config["task"])
    image_size = args.image_size or training_image_size(args.checkpoint)
    write_config(args.out, vars(args), step=STEP)
    with run_log(args.out) as logger:
        with unfinished(args.out, STEP):
            return measure(args, family, manifest, table, model, task, image_size, logger)


def measure(args: argparse.Namespace, family: DataFamily, manifest: pd.DataFrame, table: pd.DataFrame, model: nn.Module,
            task: TaskSpec, image_size: int, logger: logging.Logger) -> dict:
    """Every client's full-batch gradient at ``model``, then G² and B²; writes metrics.csv and meter.json."""
    device = pick_device(args.use_accelerator)
    model = prepare_model(model, device)
    rows_by_id = manifest.set_index("sample_id")
    input_key = model_input_key(family, args.cache_features)

    def loss_fn(net, batch, reduction="mean"):
        return task.loss(net(batch[input_key])[0].float(), batch, reduction)

    gradients, sizes, metrics = [], [], []
    # Over each client's whole schedule (temporal skew lists a sample once per window): every sample once.
    train = table[table["subset"] == "train"].drop_duplicates(["client_id", "sample_id"])
    data_args = argparse.Namespace(**{**vars(args), "image_size": image_size})
    skews = run_skews(data_args, manifest, table, task, family)  # the partition's recorded feature/concept skews
    for client_id, client_rows in train.groupby("client_id", sort=True):
        rows = rows_by_id.loc[list(client_rows["sample_id"])].reset_index()
        # with --cache_features: a frozen encoder's maps from the experiment's shared store (datasets/encoded.py)
        dataset, collate = client_rows_dataset(data_args, manifest, rows, task, family, skews.get(int(client_id)),
                                               model if args.cache_features else None)
        gradient = full_gradient(model, make_loader(dataset, args.batch_size, False, 0, collate_fn=collate), loss_fn, device)
        gradients.append(gradient)
        sizes.append(len(rows))
        metrics += [{"client": str(client_id), "metric": "n_samples", "value": len(rows)},
                    {"client": str(client_id), "metric": "grad_norm2", "value": float(gradient @ gradient)}]
    reading = dissimilarity(gradients, sizes)
    record = {"g2": reading.g2, "b2": reading.b2, "global_grad_norm2": reading.global_grad_norm2,
              "n_clients": len(sizes), "task": task.name}
    metrics += [{"client": "all", "metric": name, "value": record[name]} for name in ("g2", "b2", "global_grad_norm2")]
    MetricsCSV(args.out / "metrics.csv", ("client", "metric", "value")).write(metrics)
    atomic_write_text(args.out / METER_FILE, json.dumps(record, indent=2))
    logger.info("%s, %d clients: G² = %.4g, B² = %.4g (‖∇F‖² = %.4g)", task.name, len(sizes), reading.g2, reading.b2,
                reading.global_grad_norm2)
    return record
