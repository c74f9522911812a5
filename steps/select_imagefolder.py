"""Step 1 for the imagefolder family: a user's images in class folders, labelled by folder and split.

The library half of ``extract_datapoints_for_experiments.py --family imagefolder``."""

from __future__ import annotations

import argparse
from pathlib import Path

from datasets.family import class_counts
from datasets.imagefolder import FAMILY, select_imagefolder
from steps.manifest_output import claim_step1_folder, log_folder_notes, write_step1_outputs
from utils import cli
from utils.locks import folder_lock
from utils.run_dir import run_log

DESCRIPTION = """Step 1 (--family imagefolder): extract the datapoints of your own images, one folder per class.
Inputs: --data_path, a folder in torchvision's ImageFolder layout (root/<class>/<image>; classes numbered 0..K-1
in name order, images ending in .jpg .jpeg .png .ppm .bmp .pgm .tif .tiff .webp in any case; other files are
skipped, named in one warning), and optionally --split_csv (columns path,split: path relative to --data_path,
split train, val or test). Without a split CSV the split is seeded and stratified by class: --test_fraction of
each class's images for test, then --val_fraction of each class's training images for validation (val = 1);
every class keeps a training image. Every image is decoded once here, so a corrupt one stops step 1, named.
Outputs in --out: manifest.csv (family, sample_id, image_path, class_name, label, split, val), class_counts.csv,
config.json, run.log. Next: step 2, train_centralized_task_model.py --task folder_class --data_path <the folder>."""


def add_split_flags(parser: argparse.ArgumentParser, key: str) -> None:
    """The split flags both folder families take (``key``: the split CSV's first column)."""
    parser.add_argument("--data_path", type=Path, required=True, help="the folder of your images")
    parser.add_argument("--split_csv", type=Path, default=None,
                        help=f"a CSV with columns {key},split (split train, val or test) that fixes the split; relative "
                             "to --data_path unless absolute (default: none, a seeded split)")
    parser.add_argument("--test_fraction", type=cli.floats(0.0, 1.0, low_open=True, high_open=True), default=0.2,
                        help="without --split_csv: share of each label's images in the test split (default: 0.2)")
    parser.add_argument("--val_fraction", type=cli.floats(0.0, 1.0, high_open=True), default=0.1,
                        help="without --split_csv: share of each label's training images set aside for validation "
                             "(default: 0.1)")
    parser.add_argument("--seed", type=cli.SEEDS, default=0, help="seed of the split (default: 0)")
    parser.add_argument("--out", type=Path, default=Path("results/datapoints"), help="output folder (default: results/datapoints)")


def split_csv_path(args: argparse.Namespace) -> Path | None:
    """``--split_csv`` resolved: relative to ``--data_path`` unless absolute (data.split_csv's meaning)."""
    if args.split_csv is None:
        return None
    return args.split_csv if args.split_csv.is_absolute() else args.data_path / args.split_csv


def build_parser() -> argparse.ArgumentParser:
    """The imagefolder step-1 command line (extract_datapoints_for_experiments.py --family imagefolder --help)."""
    parser = cli.ArgumentParser(prog="extract_datapoints_for_experiments.py --family imagefolder", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_split_flags(parser, "path")
    cli.add_runtime_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> Path:
    """Select and split the images ``argv`` names; write the manifest and its class counts.

    Returns:
        The path of the manifest.csv written.
    """
    args = cli.apply_runtime_flags(build_parser().parse_args(argv))
    with folder_lock(args.out):  # one run at a time writes the folder
        return select_and_write(args)


def select_and_write(args: argparse.Namespace) -> Path:
    """Select and write, holding the lock of ``args.out`` (see :func:`main`)."""
    claim_step1_folder(args.out)
    selection = select_imagefolder(args.data_path, args.test_fraction, args.val_fraction, args.seed, split_csv_path(args),
                                   progress=args.progress)
    manifest = selection.manifest
    path = write_step1_outputs(args, manifest, class_counts(manifest))
    with run_log(args.out) as logger:
        log_folder_notes(logger, args.data_path, selection.skipped, selection.unlisted, "are not images inside a class folder")
        train = manifest["split"] == "train"
        logger.info("step 1 (%s): %d images, %d classes; %d train (%d of them validation) / %d test (%s); wrote %s", FAMILY,
                    len(manifest), manifest["label"].nunique(), int(train.sum()), int(manifest["val"].sum()),
                    int((~train).sum()), "split CSV" if args.split_csv else f"seed {args.seed}", path)
        return path
