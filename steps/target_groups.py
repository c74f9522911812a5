"""Step 3p: group every manifest sample by a property of its target, for the positive control's partition.

Inputs: manifest.csv (step 1), the data root and a dense task. The property of a sample is the mean of its target
over the valid pixels and channels at --image_size (the size the models train at): for edges how much edge an
image holds, for keypoints its keypoint response, for depth its mean depth. The samples are binned at the
--n_bins quantiles of the training rows' values (a value on an edge goes to the lower bin; empty bins are
dropped). Outputs in --out: groups.csv (sample_id, cluster: step 3b's --groups format, as step 3's clusters.csv),
property.csv (sample_id, split, value, bin), metrics.csv (per bin: its value range and sample counts), a histogram
property_bins.png, config.json and run.log. Step 3b then draws a partition over these bins through the same
Dirichlet mixture as the label- and embedding-based ones (make_client_assignments.py --groups groups.csv).
"""

from __future__ import annotations

import utils.tv_compat  # noqa: F401  (before anything imports torchvision)

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

from datasets.family import load_manifest
from models.tasks import get_task
from partitioning.property_bins import quantile_bins
from training.loop import make_loader
from utils import cli
from utils.errors import TaskHetError
from utils.locks import folder_lock
from utils.run_dir import claim_folder, run_log, unfinished, write_config

STEP = "step 3p"


def build_parser() -> argparse.ArgumentParser:
    """The step-3p command line (group_by_target_property.py --help)."""
    parser = cli.ArgumentParser(description=__doc__, formatter_class=cli.DefaultsHelpFormatter)
    parser.add_argument("--task", required=True, help="a dense task whose target's property groups the samples")
    parser.add_argument("--manifest", type=Path, required=True, help="step-1 manifest.csv")
    parser.add_argument("--data_path", type=Path, required=True,
                        help="data root of the manifest's files (ignored by families that ship their data)")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--n_bins", type=cli.ints(1, cli.MAX_CLUSTERS), default=10,
                        help="quantile bins of the property: the groups of the partition (fewer where values tie)")
    parser.add_argument("--image_size", type=cli.IMAGE_SIZES, default=32, help="side the targets are read at")
    parser.add_argument("--batch_size", type=cli.BATCH_SIZES, default=64, help="samples read at once")
    parser.add_argument("--cache_dir", type=Path, default=None, help="decoded-sample cache folder")
    parser.add_argument("--num_workers", type=cli.WORKERS, default=0, help="DataLoader worker processes")
    cli.add_runtime_flags(parser)
    return parser


def target_means(loader, domain: str) -> tuple[list[str], np.ndarray]:
    """Per sample, in loader order: its id and the mean of ``domain``'s target over its valid pixels and channels
    (0 for a sample without a valid pixel: its target holds nothing)."""
    ids, means = [], []
    for batch in loader:
        if not batch[domain].is_floating_point():
            raise TaskHetError(f"{domain}'s targets are class ids (a segmentation map): their mean is no property; "
                               "choose a task with a continuous target")
        target = batch[domain].double()  # [B, C, H, W]
        valid = batch["mask"].double().expand_as(target) if "mask" in batch else target.new_ones(target.shape)
        counts = valid.flatten(1).sum(1)
        sums = (target * valid).flatten(1).sum(1)
        means.append(np.where(counts.numpy() > 0, sums.numpy() / np.maximum(counts.numpy(), 1), 0.0))
        ids += list(batch["sample_id"])
    return ids, np.concatenate(means) if means else np.zeros(0)


def main(argv: list[str] | None = None) -> Path:
    """Bin every manifest sample by its target's mean and write the groups; returns groups.csv's path."""
    args = cli.apply_runtime_flags(build_parser().parse_args(argv))
    task = get_task(args.task)
    if task.kind != "dense":
        raise TaskHetError(f"--task {args.task} is a {task.kind} task: its target is its label, which the label-based "
                           "partition already skews; a property partition needs a dense task")
    with folder_lock(args.out):
        claim_folder(args.out, STEP)
        family, manifest = load_manifest(args.manifest)
        family.check_task(args.task, f"--task (manifest {args.manifest})")
        args.out.mkdir(parents=True, exist_ok=True)
        write_config(args.out, vars(args), step=STEP)
        with run_log(args.out) as logger, unfinished(args.out, STEP):
            return write_groups(args, family, manifest, task, logger)


def write_groups(args: argparse.Namespace, family, manifest: pd.DataFrame, task, logger) -> Path:
    """Read every target, bin the means at the training rows' quantiles, write the outputs."""
    dataset = family.dataset(args.data_path, manifest, task, args.image_size, args.cache_dir)
    loader = make_loader(dataset, args.batch_size, shuffle=False, seed=0, num_workers=args.num_workers)
    ids, values = target_means(loader, task.domain)
    if ids != manifest["sample_id"].tolist():
        raise TaskHetError("the loader changed the manifest's order; the groups would be misaligned")
    train = (manifest["split"] == "train").to_numpy()
    if not train.any():
        raise TaskHetError(f"{args.manifest}: no train rows to take the property's quantiles from")
    bins = quantile_bins(values, values[train], args.n_bins)  # every row at once: one numbering for all splits
    pd.DataFrame({"sample_id": ids, "cluster": bins}).to_csv(args.out / "groups.csv", index=False)
    table = pd.DataFrame({"sample_id": ids, "split": manifest["split"].to_numpy(), "value": values, "bin": bins})
    table.to_csv(args.out / "property.csv", index=False)
    per_bin = table.groupby("bin").agg(low=("value", "min"), high=("value", "max"),
                                       train=("split", lambda split: int((split == "train").sum())),
                                       other=("split", lambda split: int((split != "train").sum())))
    per_bin.reset_index().melt(id_vars="bin", var_name="metric").to_csv(args.out / "metrics.csv", index=False)
    draw_histogram(table, args.out / "property_bins.png", args.task)
    logger.info("%s: %d samples in %d bins of the mean target (asked %d); training values %.4g to %.4g",
                args.task, len(ids), int(bins.max()) + 1, args.n_bins, values[train].min(), values[train].max())
    return args.out / "groups.csv"


def draw_histogram(table: pd.DataFrame, path: Path, task: str) -> None:
    """The training rows' property, one colour per bin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = table[table.split == "train"]
    figure, axis = plt.subplots(figsize=(7, 3.5))
    edges = np.histogram_bin_edges(train.value, bins=40)
    for bin_index, rows in train.groupby("bin"):
        axis.hist(rows.value, bins=edges, label=f"bin {bin_index}", alpha=0.8)
    axis.set_xlabel(f"mean {task} target over valid pixels")
    axis.set_ylabel("training samples")
    axis.set_title(f"{task}: the positive control's groups (quantile bins of the training rows)", fontsize=10)
    axis.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
