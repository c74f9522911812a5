"""Step 1 for the digits family: a seeded, stratified train/test split of scikit-learn's handwritten digits.

The library half of ``extract_datapoints_for_experiments.py --family digits``."""

from __future__ import annotations

import argparse
from pathlib import Path

from datasets.digits import NUM_CLASSES, select_digits
from datasets.family import class_counts
from steps.manifest_output import claim_step1_folder, write_step1_outputs
from utils import cli
from utils.locks import folder_lock
from utils.run_dir import run_log

DESCRIPTION = """Step 1 (--family digits): extract the datapoints used by the experiments.
Inputs: none (scikit-learn's 1,797 bundled 8x8 handwritten digits). Keeps --n_samples of them (stratified by
digit, default all) and splits them train/test, stratified by digit and seeded; sets a stratified, seeded
--val_fraction of the training rows aside for validation (column val = 1; step 2 selects its best epoch on them).
Outputs in --out: manifest.csv (family, sample_id, image_index, label, split, val), class_counts.csv, config.json,
run.log. Next: step 2, train_centralized_task_model.py --task digit_class."""


DIGIT_IMAGES = 1_797  # scikit-learn's bundled digits: --n_samples keeps at most all of them


def build_parser() -> argparse.ArgumentParser:
    """The digits step-1 command line (extract_datapoints_for_experiments.py --family digits --help)."""
    parser = cli.ArgumentParser(prog="extract_datapoints_for_experiments.py --family digits", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--test_fraction", type=cli.floats(0.0, 1.0, low_open=True, high_open=True), default=0.2,
                        help="share of the samples in the test split; exactly ceil(fraction * samples) (default: 0.2)")
    parser.add_argument("--n_samples", type=cli.ints(2 * NUM_CLASSES, DIGIT_IMAGES), default=None,
                        help="samples to keep, stratified by digit (default: all 1,797)")
    parser.add_argument("--val_fraction", type=cli.floats(0.0, 1.0, high_open=True), default=0.1,
                        help="share of each digit's training images set aside for validation (default: 0.1)")
    parser.add_argument("--imbalance_factor", type=cli.floats(0.0, 1.0, low_open=True), default=1.0,
                        help="digits-LT: n_min / n_max of the training images (CIFAR-LT's exponential profile; "
                             "the test split stays balanced; default: 1.0, every image)")
    parser.add_argument("--seed", type=cli.SEEDS, default=0, help="seed of the subsample, the split and the validation part (default: 0)")
    parser.add_argument("--out", type=Path, default=Path("results/datapoints"), help="output folder (default: results/datapoints)")
    cli.add_runtime_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> Path:
    """Select and split the digits ``argv`` asks for; write the manifest and its class counts.

    Returns:
        The path of the manifest.csv written.
    """
    args = cli.apply_runtime_flags(build_parser().parse_args(argv))
    with folder_lock(args.out):  # one run at a time writes the folder
        return select_and_write(args)


def select_and_write(args: argparse.Namespace) -> Path:
    """Select and write, holding the lock of ``args.out`` (see :func:`main`)."""
    claim_step1_folder(args.out)
    manifest = select_digits(args.test_fraction, args.seed, args.n_samples, args.val_fraction, args.imbalance_factor)
    path = write_step1_outputs(args, manifest, class_counts(manifest))
    with run_log(args.out) as logger:
        num_test = int((manifest["split"] == "test").sum())
        num_val = int(manifest["val"].sum())
        logger.info("step 1 (digits): %d samples, 10 digits; %d train (%d of them validation) / %d test (stratified by digit, "
                    "seed %d); wrote %s", len(manifest), len(manifest) - num_test, num_val, num_test, args.seed, path)
        return path
