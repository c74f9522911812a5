"""Step 1 for the cifar family: CIFAR-10/100 (optionally long-tailed) with a stratified validation part.

The library half of ``extract_datapoints_for_experiments.py --family cifar``."""

from __future__ import annotations

import argparse
from pathlib import Path

from datasets.cifar import VAL_COLUMN, select_cifar
from datasets.cifar_files import DATASET_CLASSES, download
from datasets.family import class_counts
from steps.manifest_output import claim_step1_folder, write_step1_outputs
from utils import cli
from utils.locks import folder_lock
from utils.run_dir import run_log

DESCRIPTION = """Step 1 (--family cifar): extract the datapoints used by the experiments.
Inputs: torchvision's CIFAR files under --data_path (cifar-10-batches-py/ or cifar-100-python/; --download fetches
them). Keeps the training set (long-tailed with --imbalance_factor < 1, a seeded draw per class), sets a
stratified, seeded --val_fraction of it aside as validation (column val = 1) and keeps the whole test set.
Outputs in --out: manifest.csv (family, sample_id, dataset, image_index, label, split, val), class_counts.csv,
config.json, run.log. Next: step 2, train_centralized_task_model.py --task cifar_class."""


def build_parser() -> argparse.ArgumentParser:
    """The cifar step-1 command line (extract_datapoints_for_experiments.py --family cifar --help)."""
    parser = cli.ArgumentParser(prog="extract_datapoints_for_experiments.py --family cifar", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=sorted(DATASET_CLASSES), default="cifar10", help="which CIFAR (default: cifar10)")
    parser.add_argument("--data_path", type=Path, default=Path("data/cifar"), help="folder of torchvision's CIFAR folders (default: data/cifar)")
    parser.add_argument("--download", action=argparse.BooleanOptionalAction, default=False,
                        help="fetch the files with torchvision's downloader first (needs internet; default: no)")
    parser.add_argument("--verify_checksums", action=argparse.BooleanOptionalAction, default=True,
                        help="check torchvision's md5s of the files; turn off only for hand-made test files (default: on)")
    parser.add_argument("--imbalance_factor", type=cli.floats(0.0, 1.0, low_open=True), default=1.0,
                        help="n_min / n_max of the long-tailed training set; 1.0 keeps it balanced (default: 1.0)")
    parser.add_argument("--val_fraction", type=cli.floats(0.0, 1.0, high_open=True), default=0.1,
                        help="share of each class's training images set aside for validation (default: 0.1)")
    parser.add_argument("--seed", type=cli.SEEDS, default=0, help="seed of the long-tail draw and the validation split (default: 0)")
    parser.add_argument("--out", type=Path, default=Path("results/datapoints"), help="output folder (default: results/datapoints)")
    cli.add_runtime_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> Path:
    """Select the CIFAR images ``argv`` asks for; write the manifest and its class counts.

    Returns:
        The path of the manifest.csv written.
    """
    args = cli.apply_runtime_flags(build_parser().parse_args(argv))
    with folder_lock(args.out):  # one run at a time writes the folder
        return select_and_write(args)


def select_and_write(args: argparse.Namespace) -> Path:
    """Select and write, holding the lock of ``args.out`` (see :func:`main`)."""
    claim_step1_folder(args.out)
    if args.download:
        download(args.data_path, args.dataset)
    manifest = select_cifar(args.data_path, args.dataset, args.imbalance_factor, args.val_fraction, args.seed,
                            args.verify_checksums)
    path = write_step1_outputs(args, manifest, class_counts(manifest))
    with run_log(args.out) as logger:
        train = manifest["split"] == "train"
        num_val = int(manifest[VAL_COLUMN].sum())
        logger.info("step 1 (cifar, %s, imbalance factor %g): %d train (%d of them validation, seed %d) / %d test; wrote %s",
                    args.dataset, args.imbalance_factor, int(train.sum()), num_val, args.seed, int((~train).sum()), path)
        return path
