"""The centralized baseline's hyperparameter search: step 2 once per lr x weight decay x scheduler, scored on validation.

The library half of search_centralized_hparams.py; the table, pick and report are training/search.py."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

import pandas as pd
from tqdm import tqdm

from datasets.family import load_manifest
from models import get_task
from steps import train_centralized as step2
from training.schedules import list_schedulers
from training.search import (DONE, TABLE_COLUMNS, best_record, diverged, grid, long_metrics, plot_validation_accuracy, rank, summarize,
                             write_json, write_report)
from training.selection import centralized_splits
from utils import cli
from utils.errors import NonFiniteLossError, TaskHetError
from utils.run_dir import atomic_write_text, claim_folder, setup_logging, unfinished, write_config

STEP = "centralized search"
DESCRIPTION = """Search the centralized baseline's lr x weight decay x scheduler on the validation split.
Inputs: a step-1 manifest with a validation part (cifar, digits: val = 1 rows) and every step-2 flag
(train_centralized_task_model.py --help) but --init_lr, --weight_decay and --scheduler, which become the
lists --lrs, --weight_decays and --schedulers. Each config is one step-2 run in --out/runs/<config>/, trained
on the train part and scored on the validation part; a finished run is skipped, an interrupted one resumes.
Outputs in --out: search.csv (one row per config: lr, weight_decay, scheduler, best_val_top1, best_val_loss,
best_epoch, epochs_to_within), best.json (the winner and its test numbers), report.md (epochs needed to
come within --tolerance of the best validation accuracy, the winning scheduler), metrics.csv (every run's
rows), val_top1.png (validation accuracy per epoch, one line per config), config.json, run.log."""


def comma_list(convert: Callable[[str], object]) -> Callable[[str], list]:
    """argparse type: comma-separated values, each through ``convert`` (the pipeline writes lists this way)."""
    def parse(text: str) -> list:
        items = [item.strip() for item in text.split(",")]
        if not all(items):
            raise argparse.ArgumentTypeError(f"expected comma-separated values, got {text!r}")
        return [convert(item) for item in items]
    return parse


def scheduler_name(text: str) -> str:
    if text not in list_schedulers():
        raise argparse.ArgumentTypeError(f"unknown scheduler {text!r}; choose from {', '.join(list_schedulers())}")
    return text


def build_parser() -> argparse.ArgumentParser:
    """The search's command line (search_centralized_hparams.py --help)."""
    parser = cli.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--lrs", type=comma_list(cli.positive_float), required=True, help="initial learning rates, e.g. 0.1,0.01,0.001")
    add("--weight_decays", type=comma_list(cli.nonnegative_float), default=[1e-4], help="weight decays (default: 1e-4)")
    add("--schedulers", type=comma_list(scheduler_name), default=["cosine"],
        help=f"schedules, from {', '.join(list_schedulers())} (default: cosine)")
    add("--tolerance", type=cli.positive_float, default=0.01,
        help="'epochs needed' = first epoch within this relative distance of the best validation accuracy (default: 0.01)")
    add("--out", type=Path, default=None, help="search folder (default: results/search_centralized/<task>/<encoder>-seed<seed>)")
    step2.add_training_arguments(parser, searched=False)
    return parser


def main(argv: list[str] | None = None) -> pd.DataFrame:
    """Run the search ``argv`` asks for, skipping configs already trained.

    Returns:
        search.csv's table, best first.
    """
    args = build_parser().parse_args(argv)
    if args.out is None:
        args.out = Path("results/search_centralized") / args.task / f"{args.encoder}-seed{args.seed}"
    if get_task(args.task).kind != "classification":
        raise TaskHetError(f"--task {args.task}: the search ranks by validation accuracy, so it needs a classification task")
    _, manifest = load_manifest(args.manifest)
    if "val" not in centralized_splits(manifest, f"manifest {args.manifest}"):
        raise TaskHetError(f"manifest {args.manifest} has no validation part (no train row with val = 1); the search "
                           "scores on it: rerun step 1 with --val_fraction > 0 (cifar, digits)")
    configs = grid(args.lrs, args.weight_decays, args.schedulers)
    claim_folder(args.out, STEP)
    args.out.mkdir(parents=True, exist_ok=True)
    write_config(args.out, vars(args), step=STEP)
    logger = setup_logging(args.out, "search_centralized")
    logger.info("search over %d configs, %d epochs each, on the validation part of %s", len(configs), args.n_epochs, args.manifest)
    with unfinished(args.out, STEP):
        return _search(args, configs, logger)


def _search(args: argparse.Namespace, configs: list, logger) -> pd.DataFrame:
    searched = {key: value for key, value in vars(args).items() if key not in ("lrs", "weight_decays", "schedulers", "tolerance")}
    run_dirs = {config.name: args.out / "runs" / config.name for config in configs}
    rows = []
    for config in tqdm(configs, desc="search", dynamic_ncols=True):
        run_args = argparse.Namespace(**{**searched, "init_lr": config.lr, "weight_decay": config.weight_decay,
                                         "scheduler": config.scheduler, "out": run_dirs[config.name]})
        try:
            step2.train(step2.resolve(run_args))  # a finished run returns at once: the search resumes config by config
        except NonFiniteLossError as error:
            rows.append(diverged(config))
            logger.warning("%s diverged, ranked last: %s", config.name, error)
            continue
        rows.append(summarize(config, run_dirs[config.name], args.tolerance))
        logger.info("%s: best val top1 %.4f at epoch %d, within %g of it at epoch %d", config.name, rows[-1]["best_val_top1"],
                    rows[-1]["best_epoch"], args.tolerance, rows[-1]["epochs_to_within"])
    table = pd.DataFrame(rows, columns=list(TABLE_COLUMNS))
    atomic_write_text(args.out / "search.csv", table.to_csv(index=False))
    best = best_record(table, run_dirs, args.tolerance)  # refuses a search where every config diverged
    metrics_path = args.out / "metrics.csv"
    finished = [config for config, row in zip(configs, rows) if row["status"] == DONE]
    atomic_write_text(metrics_path, long_metrics(finished, [run_dirs[config.name] for config in finished]).to_csv(index=False))
    plot_validation_accuracy(metrics_path, args.out / "val_top1.png")
    write_json(args.out / "best.json", best)
    write_report(args.out, table, best, {"task": args.task, "manifest": args.manifest, "n_epochs": args.n_epochs, "seed": args.seed})
    logger.info("best: %s (val top1 %.4f); %d epochs to within %g; wrote %s", best["config"], best["best_val_top1"],
                best["epochs_to_within"], args.tolerance, args.out / "report.md")
    return rank(table)
