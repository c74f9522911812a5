"""Step 2: train one centralized model for a task; its penultimate layer later defines the task's embedding.

The library half of train_centralized_task_model.py, which pipeline.runner also calls."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from accelerate import Accelerator

from datasets.encoded import encoded_dataset, model_input_key
from datasets.family import load_manifest
from models import build_task_model, get_task, list_encoders
from models.encoders import NAMED_WEIGHTS, default_weights
from training.loop import check_resumable, fit, make_loader
from training.schedules import OPTIMIZERS, ScheduleConfig, list_schedulers, make_optimizer, make_scheduler
from training.selection import centralized_splits, selection_split
from utils import cli
from utils.cli import positive_float, positive_int
from utils.device import prepare_model
from utils.errors import TaskHetError
from utils.locks import folder_lock
from utils.run_dir import claim_folder, setup_logging, unfinished, write_config
from utils.seeding import derive_seed, set_deterministic

DESCRIPTION = """Step 2 of TaskHet: train one centralized model per task.
Inputs: the step-1 manifest (--manifest, default results/datapoints/manifest.csv; it names its data family)
and the data under --data_path (families whose data ships with a package ignore it).
With a validation part (cifar and digits manifests: val = 1 on some train rows) it trains on the other
train rows, keeps best.pt and stops early by the validation loss, and evaluates the test split every
epoch only for the curves and final numbers. Without one (taskonomy, synthetic) it trains on the train
split and selects on the test split.
Outputs in --out: config.json, run.log, metrics.csv (epoch, split, metric, value; splits train, val, test),
best.pt (lowest loss on the selection split; step 3 reads it), last.pt (every epoch; --resume continues
from it), curves.png, loss.png and <metric>.png (e.g. top1.png: the task's metric on every split)."""

STEP = "step 2"
# Arguments that do not change what a run computes: a resumed run may differ in them.
NOT_IN_SIGNATURE = ("out", "resume", "use_accelerator", "num_workers", "cache_dir", "deterministic")
# The flags a hyperparameter search (steps/search_centralized.py) replaces by lists.
SEARCHED = ("init_lr", "weight_decay", "scheduler")


def build_parser() -> argparse.ArgumentParser:
    """The step-2 command line (train_centralized_task_model.py --help)."""
    parser = cli.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_training_arguments(parser)
    parser.add_argument("--out", type=Path, default=None,
                        help="run folder (default: results/train_centralized/<task>/<encoder>-<weights>-seed<seed>)")
    return parser


def add_training_arguments(parser: argparse.ArgumentParser, searched: bool = True) -> None:
    """Step 2's flags but --out; ``searched=False`` leaves out :data:`SEARCHED` (the search adds them as lists)."""
    add = parser.add_argument
    add("--task", required=True, help="task to train (depth_euclidean, normal, segment_semantic, class_scene, digit_class, ...)")
    add("--encoder", default="resnet50", help=f"{' | '.join(list_encoders())} (default: resnet50)")
    add("--freeze_encoder", action=argparse.BooleanOptionalAction, default=False,
        help="keep the (pretrained) encoder fixed: only the decoder and head train (default: off)")
    add("--decoder_width", type=positive_int, default=None,
        help="channels of a dense task's decoder (default: the encoder's; its cost grows with the square)")
    add("--cache_features", action=argparse.BooleanOptionalAction, default=False,
        help="with --freeze_encoder: compute the encoder's maps once per sample (in --cache_dir) and train on them")
    add("--weights", default=None, help="none | imagenet | clip | PATH (default: the encoder's pretrained weights; none for small_cnn)")
    add("--data_path", type=Path, default=Path("data/synthetic"), help="data root (default: data/synthetic)")
    add("--manifest", type=Path, default=Path("results/datapoints/manifest.csv"), help="step-1 manifest.csv (default: step 1's)")
    add("--image_size", type=positive_int, default=224, help="side length the images are resized to (default: 224)")
    add("--n_epochs", type=positive_int, default=20, help="epochs (default: 20)")
    add("--batch_size", type=positive_int, default=32, help="batch size (default: 32)")
    if searched:
        add("--init_lr", type=positive_float, default=1e-3, help="initial learning rate (default: 1e-3)")
    add("--optimizer", choices=OPTIMIZERS, default=None, help="default: sgd, or adamw with --use_adam")
    add("--use_adam", action=argparse.BooleanOptionalAction, default=False, help="the original flag: same as --optimizer adamw")
    add("--momentum", type=cli.nonnegative_float, default=0.9, help="SGD momentum (default: 0.9)")
    if searched:
        add("--weight_decay", type=cli.nonnegative_float, default=1e-4, help="weight decay (default: 1e-4)")
        add("--scheduler", choices=list_schedulers(), default="exponential",
            help="per-epoch learning-rate schedule, after the warmup (default: exponential, by --lr_decay_rate)")
    add("--warmup_epochs", type=cli.nonnegative_int, default=0,
        help="epochs of linear warmup: epoch e <= W trains at init_lr * e / (W + 1) (default: 0)")
    add("--lr_decay_rate", type=positive_float, default=0.95, help="exponential schedule's factor per epoch (default: 0.95)")
    add("--step_size", type=positive_int, default=10, help="step schedule: epochs between decays (default: 10)")
    add("--gamma", type=positive_float, default=0.1, help="step schedule: factor per decay (default: 0.1)")
    add("--early_stopping_patience", type=cli.nonnegative_int, default=0, help="stop after this many epochs without a lower val loss (0 = off)")
    add("--embedding_grid", type=cli.nonnegative_int, default=0, help="embedding = global average + this grid's cell averages (default: 0)")
    add("--seed", type=int, default=0, help="root seed of init and loader order (default: 0)")
    add("--deterministic", action=argparse.BooleanOptionalAction, default=False, help="deterministic kernels (bit-identical reruns)")
    add("--use_accelerator", action=argparse.BooleanOptionalAction, default=True, help="use CUDA/MPS when present (default: yes)")
    add("--num_workers", type=cli.nonnegative_int, default=0, help="DataLoader worker processes (default: 0)")
    add("--cache_dir", type=Path, default=None, help="decoded-sample cache folder (default: none)")
    add("--resume", "--resume_training", action=argparse.BooleanOptionalAction, default=True,
        help="continue from <out>/last.pt if present (default: yes); --no-resume starts over")


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill defaults that depend on other arguments and reject contradictory ones."""
    get_task(args.task)
    if args.weights is None:
        args.weights = default_weights(args.encoder)
    if args.use_adam and args.optimizer == "sgd":
        raise TaskHetError("--use_adam contradicts --optimizer sgd; pass one of them")
    args.optimizer = args.optimizer or ("adamw" if args.use_adam else "sgd")
    if args.early_stopping_patience < 0 or args.embedding_grid < 0:
        raise TaskHetError("--early_stopping_patience and --embedding_grid must be >= 0")
    if args.out is None:
        weights_name = args.weights if args.weights in ("none", *NAMED_WEIGHTS) else Path(args.weights).stem
        args.out = Path("results/train_centralized") / args.task / f"{args.encoder}-{weights_name}-seed{args.seed}"
    return args


def optimizer_and_scheduler(args: argparse.Namespace, model: torch.nn.Module):
    """The optimizer and per-epoch scheduler (None: constant) the arguments ask for."""
    optimizer = make_optimizer(args.optimizer, model.parameters(), args.init_lr, args.weight_decay, args.momentum)
    schedule = ScheduleConfig(n_epochs=args.n_epochs, warmup_epochs=args.warmup_epochs, step_size=args.step_size,
                              gamma=args.gamma, decay_rate=args.lr_decay_rate)
    return optimizer, make_scheduler(optimizer, args.scheduler, schedule)


def main(argv: list[str] | None = None) -> dict:
    """Train one centralized task model as ``argv`` asks, resuming from the run folder's last.pt.

    Args:
        argv: command-line arguments; None reads sys.argv.

    Returns:
        The summary of :func:`training.loop.fit` for the run.
    """
    return train(resolve(build_parser().parse_args(argv)))


def train(args: argparse.Namespace) -> dict:
    """Train one centralized task model for resolved arguments (:func:`resolve`); what :func:`main` and the search run.

    Returns:
        The summary of :func:`training.loop.fit` (``best_epoch``, ``best_val_loss``, ``selected_on``, ...).
    """
    with folder_lock(args.out):  # one run at a time writes the folder
        return train_locked(args)


def train_locked(args: argparse.Namespace) -> dict:
    """:func:`train`'s work, holding the lock of ``args.out``."""
    if args.warmup_epochs >= args.n_epochs:
        raise TaskHetError(f"--warmup_epochs {args.warmup_epochs} must be below --n_epochs {args.n_epochs}")
    if args.cache_features and not args.freeze_encoder:
        raise TaskHetError("--cache_features needs --freeze_encoder (a trained encoder's maps change every step)")
    claim_folder(args.out, STEP)
    signature = {key: str(value) for key, value in vars(args).items() if key not in NOT_IN_SIGNATURE}
    check_resumable(args.out, signature, args.resume)  # before config.json: a refused resume changes nothing
    task = get_task(args.task)
    set_deterministic(args.deterministic)
    family, manifest = load_manifest(args.manifest)
    family.check_task(args.task, f"--task (manifest {args.manifest})")
    splits = centralized_splits(manifest, f"manifest {args.manifest}")
    datasets = {split: family.dataset(args.data_path, rows, task, args.image_size, args.cache_dir)
                for split, rows in splits.items()}
    num_classes = family.num_classes(manifest) if task.kind == "classification" else None
    model = build_task_model(args.task, args.encoder, args.weights, num_classes=num_classes,
                             embedding_grid=args.embedding_grid, seed=args.seed, freeze_encoder=args.freeze_encoder,
                             decoder_width=args.decoder_width)

    args.out.mkdir(parents=True, exist_ok=True)
    write_config(args.out, vars(args), step=STEP)
    logger = setup_logging(args.out, "train_centralized")
    device = Accelerator(cpu=not args.use_accelerator).device
    select = selection_split(splits)
    logger.info("task %s, encoder %s (weights %s), %s samples, best epoch chosen on %s, device %s", args.task, args.encoder,
                args.weights, " / ".join(f"{len(data)} {split}" for split, data in datasets.items()), select, device)
    model = prepare_model(model, device)
    if args.cache_features:  # a frozen encoder's maps, computed once (datasets/encoded.py)
        datasets = {split: encoded_dataset(data, splits[split], family, model, args.data_path, args.image_size,
                                           args.cache_dir, manifest) for split, data in datasets.items()}
    optimizer, scheduler = optimizer_and_scheduler(args, model)
    loader_seed = derive_seed(args.seed, "centralized", args.task)
    train_loader = make_loader(datasets.pop("train"), args.batch_size, True, loader_seed, args.num_workers)
    eval_loaders = {split: make_loader(data, args.batch_size, False, loader_seed, args.num_workers) for split, data in datasets.items()}
    with unfinished(args.out, STEP):  # step 3 refuses best.pt of a run that did not finish
        return fit(model, task, train_loader, eval_loaders, optimizer, scheduler, device,
                   input_key=model_input_key(family, args.cache_features),
                   n_epochs=args.n_epochs, out_dir=args.out, run_signature=signature, select_split=select,
                   early_stopping_patience=args.early_stopping_patience or None, resume=args.resume, logger=logger)
