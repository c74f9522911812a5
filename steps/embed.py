"""Step 3: embed every manifest sample with a step-2 model and cluster the embeddings.

Inputs: a step-2 checkpoint (best.pt), manifest.csv (step 1) and the data root.
Outputs in --out: embeddings.npy (float32, rows in manifest order) with
sample_ids.csv, clusters.csv (sample_id, cluster), centers.npy, agreement.json
(NMI/ARI of clusters vs the data family's class labels), cluster_diagnostics.json, scatter and
contingency plots, metrics.csv, config.json, run.log. The clusters are the
embedding-based groups of step 3b (make_client_assignments.py --groups clusters.csv).
A best.pt of epoch 0 (the untrained model: no trained epoch lowered step 2's validation loss) is
refused unless --allow_untrained asks for it.
"""

from __future__ import annotations

import utils.tv_compat  # noqa: F401  (before anything imports torchvision)

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd

from datasets.family import DataFamily, load_manifest
from models import load_task_model
from partitioning.clustering import MINIBATCH_THRESHOLD, cluster_embeddings, embed_samples, write_diagnostics
from utils.stages import stage_key
from training.loop import make_loader
from utils import cli
from utils.device import pick_device, prepare_model
from utils.errors import TaskHetError
from utils.loaders import load_checkpoint, load_json, load_npy, require_file, require_finished
from utils.locks import folder_lock
from utils.run_dir import atomic_write_text, claim_folder, run_log, unfinished, write_config

STEP = "step 3"
MAX_PCA_DIM = 100_000  # PCA components: beyond any embedding's width here
MAX_KMEANS_RESTARTS = 1_000


def build_parser() -> argparse.ArgumentParser:
    """The step-3 command line (extract_embeddings.py --help)."""
    parser = cli.ArgumentParser(description=__doc__, formatter_class=cli.DefaultsHelpFormatter)
    add_model_input_arguments(parser, "step-1 manifest.csv (train and test rows are embedded)")
    parser.add_argument("--num_workers", type=cli.WORKERS, default=0, help="DataLoader worker processes")
    parser.add_argument("--pca_dim", type=cli.ints(1, MAX_PCA_DIM), default=None,
                        help="PCA components before KMeans (default: none)")
    parser.add_argument("--n_clusters", type=cli.ints(1, cli.MAX_CLUSTERS), default=10,
                        help="KMeans clusters: the groups of an embedding-based partition")
    parser.add_argument("--n_init", type=cli.ints(1, MAX_KMEANS_RESTARTS), default=10, help="KMeans restarts")
    parser.add_argument("--minibatch_threshold", type=cli.ints(1, cli.MAX_SAMPLES), default=MINIBATCH_THRESHOLD,
                        help="MiniBatchKMeans above this many samples")
    parser.add_argument("--seed", type=cli.SEEDS, default=0, help="seed of the PCA, KMeans and the plots' samples")
    parser.add_argument("--allow_untrained", action=argparse.BooleanOptionalAction, default=False,
                        help="embed a best.pt of epoch 0, the untrained model (no trained epoch lowered step 2's "
                             "validation loss); refused otherwise")
    cli.add_runtime_flags(parser)
    return parser


def add_model_input_arguments(parser: argparse.ArgumentParser, manifest_help: str) -> None:
    """The flags of a step that runs a trained step-2 model over manifest samples (steps 3 and 3c)."""
    parser.add_argument("--checkpoint", type=Path, required=True, help="step-2 best.pt")
    parser.add_argument("--manifest", type=Path, required=True, help=manifest_help)
    parser.add_argument("--data_path", type=Path, required=True,
                        help="data root of the manifest's files (ignored by families that ship their data)")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--image_size", type=cli.IMAGE_SIZES, default=None,
                        help="input side; default: the step-2 run's (its config.json)")
    parser.add_argument("--batch_size", type=cli.BATCH_SIZES, default=64, help="samples per forward pass")
    parser.add_argument("--cache_dir", type=Path, default=None, help="decoded-sample cache folder")
    parser.add_argument("--use_accelerator", action=argparse.BooleanOptionalAction, default=True, help="use CUDA/MPS when present")


def trained_model_checkpoint(checkpoint: Path) -> None:
    """Refuse a missing step-2 checkpoint, or one from a step 2 that did not finish."""
    require_file(checkpoint, "--checkpoint", "a step-2 best.pt: run step 2, train_centralized_task_model.py")
    require_finished(checkpoint, "--checkpoint")


def refuse_untrained(checkpoint: Path, allow_untrained: bool) -> None:
    """Refuse a step-2 best.pt of epoch 0 (the untrained network: its embedding clusters say nothing about the task)
    unless ``allow_untrained``; a checkpoint without an epoch (not written by step 2's loop) passes."""
    if allow_untrained:
        return
    loaded = load_checkpoint(checkpoint, "--checkpoint (a step-2 best.pt)")
    if isinstance(loaded, dict) and loaded.get("epoch") == 0:  # anything else is the model loader's to judge
        raise TaskHetError(f"--checkpoint {checkpoint} is epoch 0, the untrained model (no trained epoch of step 2 "
                           "lowered its validation loss): its embeddings would cluster noise; train longer, or pass "
                           "--allow_untrained to embed it anyway")


def training_image_size(checkpoint: Path) -> int:
    """The image size of the step-2 run that wrote ``checkpoint`` (its folder's config.json)."""
    config_path = checkpoint.parent / "config.json"
    try:
        size = load_json(config_path, "the step-2 run's config")["args"]["image_size"]
    except (TaskHetError, KeyError, TypeError) as error:
        raise TaskHetError(f"cannot read image_size from {config_path} ({error}); pass --image_size") from None
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise TaskHetError(f"{config_path}: args.image_size must be an integer >= 1, got {size!r}; pass --image_size")
    return size


def embed(args: argparse.Namespace, family: DataFamily, manifest: pd.DataFrame, logger) -> np.ndarray:
    """Embeddings in manifest order, reused from --out when made from the same inputs."""
    key = stage_key({"data_path": str(args.data_path), "image_size": args.image_size}, [args.checkpoint, args.manifest])
    key_path, embeddings_path = args.out / "embeddings_key.txt", args.out / "embeddings.npy"
    if key_path.is_file() and key_path.read_text() == key and embeddings_path.is_file():
        logger.info("reusing %s (same checkpoint, manifest and image size)", embeddings_path)
        return load_npy(embeddings_path, "reused embeddings", shape=(len(manifest), -1))
    device = pick_device(args.use_accelerator)
    model = prepare_model(load_task_model(args.checkpoint, "--checkpoint (a step-2 best.pt)"), device)
    dataset = family.dataset(args.data_path, manifest, None, args.image_size, args.cache_dir)
    loader = make_loader(dataset, args.batch_size, shuffle=False, seed=args.seed, num_workers=args.num_workers)
    embeddings, sample_ids = embed_samples(model, loader, device, family.input_key, progress=args.progress)
    if sample_ids != manifest["sample_id"].tolist():
        raise TaskHetError("the loader changed the manifest's order; embeddings would be misaligned")
    np.save(embeddings_path, embeddings)
    pd.DataFrame({"sample_id": sample_ids}).to_csv(args.out / "sample_ids.csv", index=False)
    atomic_write_text(key_path, key)
    logger.info("embedded %d samples on %s: dimension %d", len(sample_ids), device, embeddings.shape[1])
    return embeddings


def main(argv: list[str] | None = None) -> Path:
    """Embed every manifest sample with a step-2 model, cluster the embeddings and write diagnostics.

    Args:
        argv: command-line arguments; None reads sys.argv.

    Returns:
        The path of the clusters.csv written.
    """
    args = cli.apply_runtime_flags(build_parser().parse_args(argv))
    with folder_lock(args.out):  # one run at a time writes the folder
        return embed_and_cluster(args)


def embed_and_cluster(args: argparse.Namespace) -> Path:
    """Embed, cluster and write, holding the lock of ``args.out`` (see :func:`main`)."""
    claim_folder(args.out, STEP)
    trained_model_checkpoint(args.checkpoint)
    refuse_untrained(args.checkpoint, args.allow_untrained)  # before config.json: a refused run writes nothing
    args.image_size = args.image_size or training_image_size(args.checkpoint)
    family, manifest = load_manifest(args.manifest)
    args.out.mkdir(parents=True, exist_ok=True)
    write_config(args.out, vars(args), step=STEP)
    with run_log(args.out) as logger:
        with unfinished(args.out, STEP):
            return cluster(args, family, manifest, logger)


def cluster(args: argparse.Namespace, family: DataFamily, manifest: pd.DataFrame, logger) -> Path:
    """Embed (or reuse the embeddings), cluster and write every output of the step; returns clusters.csv."""
    embeddings = embed(args, family, manifest, logger)

    clustering = cluster_embeddings(embeddings, args.n_clusters, args.seed, args.pca_dim, args.n_init, args.minibatch_threshold)
    pd.DataFrame({"sample_id": manifest["sample_id"], "cluster": clustering.labels}).to_csv(args.out / "clusters.csv", index=False)
    np.save(args.out / "centers.npy", clustering.centers)
    labels = manifest[family.label_column].to_numpy()
    summary = write_diagnostics(args.out, clustering, labels, args.seed, label_name=family.label_column)
    atomic_write_text(args.out / "cluster_diagnostics.json", json.dumps(summary, indent=2))
    atomic_write_text(args.out / "agreement.json", json.dumps({"nmi": summary["nmi"], "ari": summary["ari"]}, indent=2))
    scalars = {k: v for k, v in summary.items() if isinstance(v, (int, float))}
    pd.DataFrame({"metric": list(scalars), "value": list(scalars.values())}).to_csv(args.out / "metrics.csv", index=False)
    logger.info("%s: %d clusters, sizes %s; silhouette %.3f; vs %s NMI %.3f, ARI %.3f", clustering.algorithm, args.n_clusters,
                summary["cluster_sizes"], summary["silhouette"], family.label_column, summary["nmi"], summary["ari"])
    return args.out / "clusters.csv"
