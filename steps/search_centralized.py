"""The centralized baseline's hyperparameter search: step 2 once per lr x weight decay x scheduler and seed, scored on validation.

The library half of search_centralized_hparams.py; the table, pick and report are training/search.py."""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path
from typing import Callable

import pandas as pd
from tqdm import tqdm

from datasets.family import load_manifest
from models import get_task
from steps import train_centralized as step2
from training.schedules import list_schedulers
from training.search import (DONE, RUN_COLUMNS, Config, Score, aggregate, best_record, diverged, grid, long_metrics,
                             mean_validation_curves, pick, plot_validation_curves, rank, score_for, summarize, write_json,
                             write_report)
from training.selection import centralized_splits, selected_test_metrics
from utils import cli
from utils.errors import NonFiniteLossError, TaskHetError
from utils.locks import folder_lock
from utils.run_dir import atomic_write_text, claim_folder, run_log, unfinished, write_config

STEP = "centralized search"
DESCRIPTION = """Search the centralized baseline's lr x weight decay x scheduler on the validation split, over seeds.
Inputs: a step-1 manifest with a validation part (cifar, digits: val = 1 rows) and every step-2 flag
(train_centralized_task_model.py --help) but --init_lr, --weight_decay and --scheduler, which become the
lists --lrs, --weight_decays and --schedulers (and --seeds, a list, beside step 2's --seed). Each config is
one step-2 run per seed in --out/runs/<config>/seed<seed>/, trained on the train part and scored on the
validation part: a classification task by its highest validation top-1 accuracy, a dense task (edges,
keypoints, depth, normals) by its lowest validation loss. A finished run is skipped, an interrupted one
resumes, added seeds train only themselves. Outputs in --out: search_runs.csv (one row per config and seed),
search.csv (one row per config: mean over seeds and 95% t-interval of the best validation score and of the
epochs to come within --tolerance of it), best.json (the winner, whether its interval clears the runner-up's,
its test numbers), report.md (epochs needed, whether the win is clear, the winning scheduler), metrics.csv
(every run's rows), val_<metric>.csv and val_<metric>.png (the validation score per epoch, mean over seeds,
one line per config; metric top1 or loss), config.json, run.log."""


# Each config × seed is one step-2 training: the lists and their product are bounded.
MAX_SEARCH_RUNS = 1_000


def comma_list(convert: Callable[[str], object]) -> Callable[[str], list]:
    """argparse type: at most :data:`utils.cli.MAX_LIST_ITEMS` comma-separated values, each through ``convert`` (the
    pipeline writes lists this way); ``convert`` is kept as the type's ``each`` (its range shows in --help)."""
    def parse(text: str) -> list:
        items = [item.strip() for item in text.split(",")]
        if not all(items):
            raise argparse.ArgumentTypeError(f"expected comma-separated values, got {text!r}")
        if len(items) > cli.MAX_LIST_ITEMS:
            raise argparse.ArgumentTypeError(f"at most {cli.MAX_LIST_ITEMS} values, got {len(items)}")
        return [convert(item) for item in items]
    parse.each = convert
    return parse


def scheduler_name(text: str) -> str:
    if text not in list_schedulers():
        raise argparse.ArgumentTypeError(f"unknown scheduler {text!r}; choose from {', '.join(list_schedulers())}")
    return text


def build_parser() -> argparse.ArgumentParser:
    """The search's command line (search_centralized_hparams.py --help)."""
    parser = cli.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--lrs", type=comma_list(cli.LEARNING_RATES), required=True, help="initial learning rates, e.g. 0.1,0.01,0.001")
    add("--weight_decays", type=comma_list(cli.WEIGHT_DECAYS), default=[1e-4], help="weight decays (default: 1e-4)")
    add("--schedulers", type=comma_list(scheduler_name), default=["cosine"],
        help=f"schedules, from {', '.join(list_schedulers())} (default: cosine)")
    add("--tolerance", type=cli.floats(0.0, 1.0, low_open=True), default=0.01,
        help="'epochs needed' = first epoch within this relative distance of the best validation score: accuracy "
             ">= (1 - tolerance) x best, loss <= (1 + tolerance) x best (default: 0.01)")
    add("--seeds", type=comma_list(cli.SEEDS), default=None,
        help="seeds, each config trains once per seed, e.g. 0,1,2 (default: --seed alone; one seed gives no interval)")
    add("--out", type=Path, default=None,
        help="search folder (default: results/search_centralized/<task>/<encoder>-seeds<s1-s2-...>)")
    step2.add_training_arguments(parser, searched=False)
    parser.set_defaults(seed=None)  # None: not given, so --seed and --seeds can be told apart
    return parser


def resolve_seeds(args: argparse.Namespace) -> list[int]:
    """The seeds to run: --seeds, or --seed alone, or 0; both flags together are refused (which would win is unclear)."""
    if args.seeds is not None and args.seed is not None:
        raise TaskHetError("--seed and --seeds both given; pass the list --seeds alone")
    seeds = args.seeds if args.seeds is not None else [0 if args.seed is None else args.seed]
    if len(set(seeds)) != len(seeds):
        raise TaskHetError(f"--seeds repeats a value: {', '.join(map(str, seeds))}")
    return seeds


def main(argv: list[str] | None = None) -> pd.DataFrame:
    """Run the search ``argv`` asks for, skipping configs already trained.

    Returns:
        search.csv's table, best first.
    """
    args = cli.apply_runtime_flags(build_parser().parse_args(argv))
    cli.refuse_several_processes("search_centralized_hparams.py")
    args.seeds, args.seed = resolve_seeds(args), None
    if args.out is None:
        args.out = Path("results/search_centralized") / args.task / f"{args.encoder}-seeds{'-'.join(map(str, args.seeds))}"
    configs = grid(args.lrs, args.weight_decays, args.schedulers)
    if len(configs) * len(args.seeds) > MAX_SEARCH_RUNS:
        raise TaskHetError(f"the search would train {len(configs)} configs × {len(args.seeds)} seeds = "
                           f"{len(configs) * len(args.seeds):,} runs; at most {MAX_SEARCH_RUNS:,}")
    family, manifest = load_manifest(args.manifest)
    family.check_task(args.task, f"--task (manifest {args.manifest})")  # before the folder exists
    if "val" not in centralized_splits(manifest, f"manifest {args.manifest}"):
        raise TaskHetError(f"manifest {args.manifest} has no validation part (no train row with val = 1); the search "
                           "scores on it: rerun step 1 with --val_fraction > 0 (cifar, digits)")
    with folder_lock(args.out):  # one run at a time writes the folder
        return search(args, configs)


def search(args: argparse.Namespace, configs: list[Config]) -> pd.DataFrame:
    """Train every config and write the search's outputs, holding the lock of ``args.out`` (see :func:`main`)."""
    claim_folder(args.out, STEP)
    args.out.mkdir(parents=True, exist_ok=True)
    write_config(args.out, vars(args), step=STEP)
    with run_log(args.out) as logger:
        logger.info("search over %d configs x %d seed(s), %d epochs each, on the validation part of %s", len(configs),
                    len(args.seeds), args.n_epochs, args.manifest)
        with unfinished(args.out, STEP):
            return _search(args, configs, logger)


def _search(args: argparse.Namespace, configs: list[Config], logger) -> pd.DataFrame:
    score = score_for(get_task(args.task).kind)
    runs = _train_all(args, configs, score, logger)
    run_table = pd.DataFrame([row for row, _ in runs], columns=list(RUN_COLUMNS))
    atomic_write_text(args.out / "search_runs.csv", run_table.to_csv(index=False))
    table = aggregate(run_table)
    atomic_write_text(args.out / "search.csv", table.to_csv(index=False))
    winner, _ = pick(table, score)  # refuses a search where every config diverged
    run_dirs = {row["seed"]: run_dir for row, run_dir in runs if row["config"] == winner["config"]}
    tests = {seed: selected_test_metrics(run_dir / "metrics.csv") for seed, run_dir in run_dirs.items()}
    best = best_record(table, args.tolerance, run_dirs, tests, score)
    by_name = {config.name: config for config in configs}
    metrics = long_metrics([(by_name[row["config"]], row["seed"], run_dir) for row, run_dir in runs if row["status"] == DONE])
    atomic_write_text(args.out / "metrics.csv", metrics.to_csv(index=False))
    curves = args.out / f"val_{score.metric}.csv"
    atomic_write_text(curves, mean_validation_curves(metrics, score).to_csv(index=False))
    plot_validation_curves(curves, curves.with_suffix(".png"), score)
    write_json(args.out / "best.json", best)
    write_report(args.out, table, best, {"task": args.task, "manifest": args.manifest, "n_epochs": args.n_epochs,
                                         "seeds": args.seeds}, score)
    logger.info("best: %s (mean val %s %.4g, win %s); %.3g epochs to within %g; wrote %s", best["config"], score.metric,
                best[score.column], best["win"], best["epochs_to_within"], args.tolerance, args.out / "report.md")
    return rank(table, score)


def _train_all(args: argparse.Namespace, configs: list[Config], score: Score, logger) -> list[tuple[dict, Path]]:
    """Step 2 for every (config, seed), config-major; ``(search_runs.csv row, run folder)`` each."""
    searched = {key: value for key, value in vars(args).items()
                if key not in ("lrs", "weight_decays", "schedulers", "tolerance", "seeds")}
    runs = []
    for config, seed in tqdm(list(itertools.product(configs, args.seeds)), desc="search", dynamic_ncols=True,
                             disable=not args.progress):
        run_dir = args.out / "runs" / config.name / f"seed{seed}"
        run_args = argparse.Namespace(**{**searched, "init_lr": config.lr, "weight_decay": config.weight_decay,
                                         "scheduler": config.scheduler, "seed": seed, "out": run_dir})
        try:
            step2.train(step2.resolve(run_args))  # a finished run returns at once: the search resumes run by run
        except NonFiniteLossError as error:
            runs.append((diverged(config, seed), run_dir))
            logger.warning("%s seed %d diverged, its config is ranked last: %s", config.name, seed, error)
            continue
        runs.append((summarize(config, seed, run_dir, args.tolerance, score), run_dir))
        row = runs[-1][0]
        logger.info("%s seed %d: best val %s %.4g at epoch %d, within %g of it at epoch %d", config.name, seed,
                    score.metric, row[score.column], row["best_epoch"], args.tolerance, row["epochs_to_within"])
    return runs
