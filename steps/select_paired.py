"""Step 1 for the paired_folders family: a user's images with dense targets in folders beside them.

The library half of ``extract_datapoints_for_experiments.py --family paired_folders``."""

from __future__ import annotations

import argparse
from pathlib import Path

from datasets.family import class_counts
from datasets.paired_folders import FAMILY, TASK_OF_KIND
from datasets.paired_selection import select_paired
from steps.manifest_output import claim_step1_folder, log_folder_notes, write_step1_outputs
from steps.select_imagefolder import add_split_flags, split_csv_path
from utils import cli
from utils.locks import folder_lock
from utils.run_dir import run_log

DESCRIPTION = """Step 1 (--family paired_folders): extract the datapoints of your own images with dense targets.
Inputs: --data_path, a folder holding images/<stem>.<ext> (.jpg .jpeg .png .ppm .bmp .pgm .tif .tiff .webp), one
folder per target with <stem>.png or <stem>.npy for every image (its size), targets.yaml (each target's kind:
regression, segmentation or edges, and its channels or classes, scale, ignore value) and optionally groups.csv
(stem,label and/or stem,source: the labels of label-based partitions, the owners of the natural scheme). Files
that are neither images nor targets are skipped, named in one warning. The split is --split_csv's (stem,split:
train, val or test) or seeded, stratified by label: --test_fraction for test, then --val_fraction of the training
images for validation (val = 1). Every image and target is decoded once here: a corrupt file, a target of
another size or with a value its kind cannot take, a stem in one folder only stops step 1, named.
Outputs in --out: manifest.csv (family, sample_id, image_path, label, label_name, source, split, val, and per target
kind <kind>_path, _target, _channels, _scale, _ignore), class_counts.csv (over the labels), config.json, run.log.
Next: step 2, train_centralized_task_model.py --task folder_regression | folder_segmentation | folder_edges."""


def build_parser() -> argparse.ArgumentParser:
    """The paired_folders step-1 command line (extract_datapoints_for_experiments.py --family paired_folders --help)."""
    parser = cli.ArgumentParser(prog="extract_datapoints_for_experiments.py --family paired_folders",
                                description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_split_flags(parser, "stem")
    parser.add_argument("--targets", default=None,
                        help="comma-separated targets of targets.yaml to keep, at most one of each kind (default: all)")
    parser.add_argument("--require_labels", action=argparse.BooleanOptionalAction, default=False,
                        help="refuse a folder whose groups.csv gives no label (run_pipeline.py's main job passes it: "
                             "it compares label- with embedding-based partitions) (default: no)")
    cli.add_runtime_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> Path:
    """Select and split the images ``argv`` names with their targets; write the manifest and its label counts.

    Returns:
        The path of the manifest.csv written.
    """
    args = cli.apply_runtime_flags(build_parser().parse_args(argv))
    with folder_lock(args.out):  # one run at a time writes the folder
        return select_and_write(args)


def select_and_write(args: argparse.Namespace) -> Path:
    """Select and write, holding the lock of ``args.out`` (see :func:`main`)."""
    claim_step1_folder(args.out)
    names = None if args.targets is None else [name.strip() for name in args.targets.split(",") if name.strip()]
    selection = select_paired(args.data_path, args.test_fraction, args.val_fraction, args.seed, split_csv_path(args),
                              names, args.require_labels, progress=args.progress)
    manifest = selection.manifest
    path = write_step1_outputs(args, manifest, class_counts(manifest))
    with run_log(args.out) as logger:
        log_folder_notes(logger, args.data_path, selection.skipped, selection.unlisted, "are neither images nor target files")
        train = manifest["split"] == "train"
        targets = ", ".join(f"{spec.name} ({spec.kind}: --task {TASK_OF_KIND[spec.kind]})" for spec in selection.targets)
        labels = "no labels" if (manifest["label_name"] == "").all() else f"{manifest['label'].nunique()} labels"
        logger.info("step 1 (%s): %d images, targets %s, %s; %d train (%d of them validation) / %d test (%s); wrote %s",
                    FAMILY, len(manifest), targets, labels, int(train.sum()), int(manifest["val"].sum()), int((~train).sum()),
                    "split CSV" if args.split_csv else f"seed {args.seed}", path)
        return path
