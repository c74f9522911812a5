"""Step 1: choose the samples of an experiment, label their scene class and split them.

The library half of extract_datapoints_for_experiments.py, which pipeline.runner also calls."""

from __future__ import annotations

import argparse
from pathlib import Path

from datasets.family import DEFAULT_VAL_FRACTION
from datasets.selection import SPLIT_BY, SelectionConfig, log_selection, select_datapoints, write_selection
from datasets.synthetic import PLACES_FILE, SPLIT_FILE
from datasets.taskonomy_domains import DOMAINS, NUM_SCENE_SCORES
from datasets.taskonomy_domains import TASKS as TASKONOMY_TASKS
from utils import cli
from utils.errors import TaskHetError
from utils.locks import folder_lock
from utils.run_dir import claim_folder, run_log, unfinished, write_config

STEP = "step 1"

DESCRIPTION = """Step 1: extract the datapoints used by the experiments.
Inputs: a data root in the Taskonomy/omnidata layout (--data_path: real Taskonomy from download_taskonomy.py,
or synthetic buildings from render_synthetic_buildings.py), its split CSV (--client_file_name, columns
id,train,val,test) and the Places365 class-name list (--scene_class_file_name).
Keeps the samples that have rgb, class_scene and every domain the --tasks need, labels each with the argmax
of its class_scene scores,
keeps the --top_k_classes most frequent labels (renumbered 0..K-1) and splits them into train,
validation and test, by default whole buildings per split (--split_by).
Outputs in --out: manifest.csv (family, sample_id, building, point, view, rgb_path, scene_class, scene_name, split,
val: 1 on the training rows set aside for validation),
class_counts.csv, class_distribution.png, config.json, run.log. Next: step 2, train_centralized_task_model.py.
This is the Taskonomy data family (--family taskonomy, the default); --family digits --help shows the digits family's step 1."""


BUILDING_COUNTS = cli.ints(1, 100_000)  # --taskonomy_clients_to_include N: far beyond Taskonomy's ~600 buildings


def buildings_argument(text: str) -> int | tuple[str, ...]:
    """argparse type: a count of ASCII digits in :data:`BUILDING_COUNTS` (as in the original script) or a
    comma-separated list of building ids."""
    if cli.INTEGER_PATTERN.fullmatch(text.strip()):
        return BUILDING_COUNTS(text)
    return tuple(name.strip() for name in text.split(",") if name.strip())


def required_domains(names: list[str]) -> tuple[str, ...]:
    """The domains ``names`` need: a Taskonomy task's ``required_domains``, or a domain name as itself.

    Raises:
        TaskHetError: a name that is neither a Taskonomy task nor a domain.
    """
    from models.tasks import get_task  # the models package imports torchvision; only this flag needs it

    domains: list[str] = []
    for name in names:
        if name in TASKONOMY_TASKS:
            domains += get_task(name).required_domains
        elif name in DOMAINS:
            domains.append(name)
        else:
            raise TaskHetError(f"--tasks: {name!r} is neither a Taskonomy task nor a domain; tasks: {', '.join(TASKONOMY_TASKS)}")
    return tuple(dict.fromkeys(domains))


def build_parser() -> argparse.ArgumentParser:
    """The step-1 command line (extract_datapoints_for_experiments.py --help)."""
    parser = cli.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_path", type=Path, default=Path("data/synthetic"), help="data root (default: data/synthetic)")
    parser.add_argument("--client_file_name", default=SPLIT_FILE, help=f"split CSV, relative to --data_path (default: {SPLIT_FILE})")
    parser.add_argument(
        "--taskonomy_clients_to_include",
        type=buildings_argument,
        default=None,
        help=f"buildings to use: a number N (the first N of the split CSV; an integer in {BUILDING_COUNTS}) or "
             "comma-separated building ids (default: all)",
    )
    parser.add_argument("--scene_class_file_name", default=PLACES_FILE, help=f"Places365 names, relative to --data_path (default: {PLACES_FILE})")
    parser.add_argument(
        "--tasks",
        nargs="+",
        default=[],
        help="tasks (or domains) the samples are for, space- or comma-separated: a kept sample has every domain they "
        "need besides rgb and class_scene (default: none, so only rgb and class_scene are required)",
    )
    parser.add_argument("--top_k_classes", type=cli.ints(1, NUM_SCENE_SCORES), default=16,
                        help="keep the K most frequent scene classes (default: 16)")
    parser.add_argument("--test_fraction", type=cli.floats(0.0, 1.0, low_open=True, high_open=True), default=0.2,
                        help="share of buildings (or samples) in the test split; at least one (default: 0.2)")
    parser.add_argument("--val_fraction", type=cli.floats(0.0, 1.0, high_open=True), default=DEFAULT_VAL_FRACTION,
                        help="share of buildings (or samples) set aside from training for validation (column val = 1), "
                             "on which step 2 selects its best epoch; at least one when > 0; 0: no validation part, and "
                             f"step 2 then needs --last_epoch (default: {DEFAULT_VAL_FRACTION})")
    parser.add_argument("--split_by", choices=SPLIT_BY, default="building",
                        help="building: whole buildings per split, stratified by scene class, so no building's views sit "
                             "on both sides; csv: the split CSV's own train/val/test columns (real Taskonomy's official "
                             "split; --test_fraction and --val_fraction unused); sample: views drawn one by one "
                             "(default: building)")
    parser.add_argument("--seed", type=cli.SEEDS, default=0, help="seed of the train/test split (default: 0)")
    parser.add_argument("--out", type=Path, default=Path("results/datapoints"), help="output folder (default: results/datapoints)")
    cli.add_runtime_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> Path:
    """Select, label and split the samples ``argv`` asks for; write the manifest and its summaries.

    Args:
        argv: command-line arguments; None reads sys.argv.

    Returns:
        The path of the manifest.csv written.
    """
    args = cli.apply_runtime_flags(build_parser().parse_args(argv))
    with folder_lock(args.out):  # one run at a time writes the folder
        return select_scenes(args)


def select_scenes(args: argparse.Namespace) -> Path:
    """Select and write, holding the lock of ``args.out`` (see :func:`main`)."""
    claim_folder(args.out, STEP)
    config = SelectionConfig(
        data_path=args.data_path,
        client_file_name=args.client_file_name,
        scene_class_file_name=args.scene_class_file_name,
        taskonomy_clients_to_include=args.taskonomy_clients_to_include,
        domains=required_domains([name for names in args.tasks for name in names.split(",") if name]),
        top_k_classes=args.top_k_classes,
        test_fraction=args.test_fraction,
        val_fraction=args.val_fraction,
        split_by=args.split_by,
        seed=args.seed,
    )
    selection = select_datapoints(config, progress=args.progress)
    with unfinished(args.out, STEP):  # steps 2-4 refuse a manifest whose folder says it did not finish
        paths = write_selection(selection, args.out)
        write_config(args.out, vars(args), step=STEP)
    with run_log(args.out) as logger:
        log_selection(selection, logger)
        logger.info(f"wrote {paths['manifest']}, {paths['class_counts'].name}, {paths['plot'].name}")
        return paths["manifest"]
