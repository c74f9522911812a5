"""Step 2: train one centralized model for a task; its penultimate layer later defines the task's embedding.

The library half of train_centralized_task_model.py, which pipeline.runner also calls."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.state import AcceleratorState, GradientState

from datasets.encoded import encoded_dataset, model_input_key
from datasets.family import load_manifest
from models import build_task_model, get_task, list_encoders
from models.encoders import NAMED_WEIGHTS, default_weights
from training.fit import check_resumable, fit
from training.loop import LAST_EPOCH, make_loader
from training.schedules import OPTIMIZERS, ScheduleConfig, list_schedulers, make_optimizer, make_scheduler
from training.selection import centralized_splits, selection_split
from utils import cli
from utils.device import prepare_model
from utils.errors import TaskHetError
from utils.locks import folder_lock
from utils.run_dir import claim_folder, run_log, unfinished, write_config
from utils.seeding import derive_seed, set_deterministic

DESCRIPTION = """Step 2 of TaskHet: train one centralized model per task.
Inputs: the step-1 manifest (--manifest, default results/datapoints/manifest.csv; it names its data family)
and the data under --data_path (families whose data ships with a package ignore it).
Every family's step 1 sets a validation part aside (val = 1 on some train rows; Taskonomy by building): step 2
trains on the other train rows, keeps best.pt and stops early by the validation loss, and evaluates the test
split every epoch only for the curves and final numbers. A manifest without validation rows is refused.
Outputs in --out: config.json, run.log, metrics.csv (epoch, split, metric, value; splits train, val, test, and
trivial_val, trivial_test: the loss of predicting all zeros, and of the best constant of the training targets),
best.pt (lowest validation loss; step 3 reads it), last.pt (every epoch; --resume continues
from it), curves.png, loss.png and <metric>.png (e.g. top1.png: the task's metric on every split).
Several GPUs (data parallel; --batch_size is the global batch, split evenly over the processes):
  accelerate launch --multi_gpu --num_processes 4 train_centralized_task_model.py ... --mixed_precision bf16"""

STEP = "step 2"
# Arguments that do not change what a run computes: a resumed run may differ in them.
NOT_IN_SIGNATURE = ("out", "resume", "use_accelerator", "num_workers", "cache_dir", "deterministic", "progress", "threads",
                    "tensorboard", "plots")
MIXED_PRECISION = ("no", "bf16", "fp16")
# The flags a hyperparameter search (steps/search_centralized.py) replaces by lists.
SEARCHED = ("init_lr", "weight_decay", "scheduler")
# The embedding's grid side g: C·(1 + g²) numbers per sample, so 8 already gives 65 times the global average's.
MAX_EMBEDDING_GRID = 8
# A schedule decays the rate (a factor above 1 would grow it geometrically over up to MAX_EPOCHS epochs).
DECAY_FACTORS = cli.floats(0.0, 1.0, low_open=True)
EPOCH_COUNTS = cli.ints(0, cli.MAX_EPOCHS)


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
    cli.add_runtime_flags(parser)
    cli.add_plots_flag(parser, "curves.png, loss.png and <metric>.png")
    add("--tensorboard", action=argparse.BooleanOptionalAction, default=False,
        help="also write metrics.csv's rows as TensorBoard scalars under <out>/tensorboard (needs the tensorboard "
             "package; metrics.csv stays the source of truth)")
    add("--task", required=True, help="task to train (depth_euclidean, normal, segment_semantic, class_scene, digit_class, ...)")
    add("--encoder", default="resnet50", help=f"{' | '.join(list_encoders())} (default: resnet50)")
    add("--freeze_encoder", action=argparse.BooleanOptionalAction, default=False,
        help="keep the (pretrained) encoder fixed: only the decoder and head train (default: off)")
    add("--decoder_width", type=cli.ints(1, cli.MAX_DECODER_WIDTH), default=None,
        help="channels of a dense task's decoder (default: the encoder's; its cost grows with the square)")
    add("--cache_features", action=argparse.BooleanOptionalAction, default=False,
        help="with --freeze_encoder: compute the encoder's maps once per sample (in --cache_dir) and train on them")
    add("--weights", default=None, help="none | imagenet | clip | dino | PATH (default: the encoder's pretrained weights, "
        "e.g. dino for vit_s16_dino; none for small_cnn)")
    add("--data_path", type=Path, default=Path("data/synthetic"), help="data root (default: data/synthetic)")
    add("--manifest", type=Path, default=Path("results/datapoints/manifest.csv"), help="step-1 manifest.csv (default: step 1's)")
    add("--image_size", type=cli.IMAGE_SIZES, default=224, help="side length the images are resized to (default: 224)")
    add("--n_epochs", type=cli.EPOCHS, default=20, help="epochs (default: 20)")
    add("--batch_size", type=cli.BATCH_SIZES, default=32, help="batch size (default: 32)")
    if searched:
        add("--init_lr", type=cli.LEARNING_RATES, default=1e-3, help="initial learning rate (default: 1e-3)")
    add("--optimizer", choices=OPTIMIZERS, default=None, help="default: sgd, or adamw with --use_adam")
    add("--use_adam", action=argparse.BooleanOptionalAction, default=False, help="the original flag: same as --optimizer adamw")
    add("--momentum", type=cli.MOMENTA, default=0.9, help="SGD momentum (default: 0.9)")
    if searched:
        add("--weight_decay", type=cli.WEIGHT_DECAYS, default=1e-4, help="weight decay (default: 1e-4)")
        add("--scheduler", choices=list_schedulers(), default="exponential",
            help="per-epoch learning-rate schedule, after the warmup (default: exponential, by --lr_decay_rate)")
    add("--warmup_epochs", type=EPOCH_COUNTS, default=0,
        help="epochs of linear warmup: epoch e <= W trains at init_lr * e / (W + 1) (default: 0)")
    add("--lr_decay_rate", type=DECAY_FACTORS, default=0.95, help="exponential schedule's factor per epoch (default: 0.95)")
    add("--step_size", type=cli.EPOCHS, default=10, help="step schedule: epochs between decays (default: 10)")
    add("--gamma", type=DECAY_FACTORS, default=0.1, help="step schedule: factor per decay (default: 0.1)")
    add("--early_stopping_patience", type=EPOCH_COUNTS, default=0, help="stop after this many epochs without a lower val loss (0 = off)")
    add("--embedding_grid", type=cli.ints(0, MAX_EMBEDDING_GRID), default=0, help="embedding = global average + this grid's cell averages (default: 0)")
    add("--seed", type=cli.SEEDS, default=0, help="root seed of init and loader order (default: 0)")
    add("--deterministic", action=argparse.BooleanOptionalAction, default=False, help="deterministic kernels (bit-identical reruns)")
    add("--use_accelerator", action=argparse.BooleanOptionalAction, default=True, help="use CUDA/MPS when present (default: yes)")
    add("--mixed_precision", choices=MIXED_PRECISION, default=None,
        help="accelerate's autocast of the forward passes: no | bf16 | fp16 (fp16 with loss scaling; GPU only); "
             "default: bf16 on a GPU that has it, else no (or accelerate launch's --mixed_precision). Recorded in config.json")
    add("--num_workers", type=cli.WORKERS, default=0, help="DataLoader worker processes (default: 0)")
    add("--cache_dir", type=Path, default=None, help="decoded-sample cache folder (default: none)")
    add("--resume", "--resume_training", action=argparse.BooleanOptionalAction, default=True,
        help="continue from <out>/last.pt if present (default: yes); --no-resume starts over")
    add("--last_epoch", action=argparse.BooleanOptionalAction, default=False,
        help="a manifest without validation rows (column val) has nothing to select best.pt on (the test split never "
             "does): refused unless this flag asks to keep the last epoch as best.pt, with no early stopping; "
             "config.json and run.log record it, and every report that reads the run says so (default: no)")


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill defaults that depend on other arguments and reject contradictory ones."""
    get_task(args.task)
    if args.weights is None:
        args.weights = default_weights(args.encoder)
    if args.use_adam and args.optimizer == "sgd":
        raise TaskHetError("--use_adam contradicts --optimizer sgd; pass one of them")
    args.optimizer = args.optimizer or ("adamw" if args.use_adam else "sgd")
    args.mixed_precision = resolve_mixed_precision(args.mixed_precision, args.use_accelerator)
    if args.early_stopping_patience < 0 or args.embedding_grid < 0:
        raise TaskHetError("--early_stopping_patience and --embedding_grid must be >= 0")
    if args.warmup_epochs >= args.n_epochs:  # argument checks come before the folder is locked
        raise TaskHetError(f"--warmup_epochs {args.warmup_epochs} must be below --n_epochs {args.n_epochs}")
    if args.cache_features and not args.freeze_encoder:
        raise TaskHetError("--cache_features needs --freeze_encoder (a trained encoder's maps change every step)")
    if args.out is None:
        weights_name = args.weights if args.weights in ("none", *NAMED_WEIGHTS) else Path(args.weights).stem
        args.out = Path("results/train_centralized") / args.task / f"{args.encoder}-{weights_name}-seed{args.seed}"
    return args


def resolve_mixed_precision(flag: str | None, use_accelerator: bool) -> str:
    """--mixed_precision, or its default: accelerate launch's --mixed_precision when it set one, else bf16 on a GPU with bf16."""
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")  # accelerate launch writes "no" when not told
    if flag is not None and launched not in ("no", flag):
        raise TaskHetError(f"--mixed_precision {flag} contradicts accelerate launch --mixed_precision {launched}; pass one of them")
    if flag is not None:
        return flag
    if launched != "no":
        return launched
    return "bf16" if use_accelerator and torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"


def _shadowed_datasets_are_not_hugging_faces() -> None:
    """Tell accelerate that Hugging Face's ``datasets`` is not there when the name is TaskHet's own package.

    With flwr-datasets installed, accelerate finds Hugging Face's ``datasets`` installed and, when it shards a loader
    over several processes, runs ``from datasets import IterableDataset``, which imports TaskHet's ``datasets/``
    (first on the path) and fails. TaskHet's loaders hold torch datasets only, so the check has nothing to find.
    """
    import sys

    import accelerate.data_loader

    ours = sys.modules.get("datasets")
    if ours is not None and not hasattr(ours, "IterableDataset"):
        accelerate.data_loader.is_datasets_available = lambda: False


def make_accelerator(args: argparse.Namespace) -> Accelerator:
    """Step 2's accelerate ``Accelerator``: device, ``--mixed_precision`` and, under ``accelerate launch``, the processes.

    ``split_batches``: ``--batch_size`` is the global batch, cut into one equal slice per process, so the
    arguments mean the same at any number of processes (the last, smaller batch of an epoch is topped up
    from the epoch's first samples by accelerate, so that every process gets an equal slice).
    """
    world_size = cli.world_size()
    if args.batch_size % world_size:  # before the process group: every rank stops at once, none waits for the others
        raise TaskHetError(f"--batch_size {args.batch_size} is the global batch: it must be a multiple of the "
                           f"{world_size} processes")
    _shadowed_datasets_are_not_hugging_faces()
    # accelerate keeps its settings in process-wide state and refuses a second Accelerator with another mixed
    # precision or device; a pipeline or a search trains several step-2 models in one process. Reset as
    # accelerate's own AccelerateTestCase does, and GradientState too (it keeps the loaders of a run that
    # stopped mid-epoch). The process group (PartialState) is kept when torchrun started this process.
    AcceleratorState._reset_state(reset_partial_state=world_size == 1)
    GradientState._reset_state()
    try:
        accelerator = Accelerator(cpu=not args.use_accelerator, mixed_precision=args.mixed_precision,
                                  dataloader_config=DataLoaderConfiguration(split_batches=True))
    except ValueError as error:  # e.g. bf16 on a GPU without it
        raise TaskHetError(f"--mixed_precision {args.mixed_precision}: {error}") from error
    if args.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        raise TaskHetError("--mixed_precision fp16 needs a GPU (accelerate ignores it on the CPU); use bf16 or no")
    if accelerator.num_processes != world_size:  # so the batch check above counted the processes accelerate runs
        raise TaskHetError(f"launched as {world_size} processes, but accelerate sees {accelerator.num_processes}: "
                           "without GPUs, pass --no-use_accelerator to run the processes on the CPU")
    return accelerator


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
        The summary of :func:`training.fit.fit` for the run.
    """
    try:
        summary = train(resolve(cli.apply_runtime_flags(build_parser().parse_args(argv))))
    except BaseException:
        end_process_group(wait_for_the_others=False)  # a barrier would wait forever for a rank that failed
        raise
    end_process_group(wait_for_the_others=True)
    return summary


def end_process_group(wait_for_the_others: bool) -> None:
    """Close the process group ``accelerate launch`` made (gloo's threads otherwise abort the process as it exits).

    After a run that ended well every rank first waits for the others: the main process still writes last.pt and
    best.pt after the last collective, and a rank that tore its gloo threads down meanwhile was seen to abort
    ("terminate called without an active exception", once in a CI run under load).
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if wait_for_the_others and torch.distributed.get_world_size() > 1:
            torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def train(args: argparse.Namespace) -> dict:
    """Train one centralized task model for resolved arguments (:func:`resolve`); what :func:`main` and the search run.

    Under ``accelerate launch`` every process calls it; only the main one holds the folder's lock and writes.

    Returns:
        The summary of :func:`training.fit.fit` (``best_epoch``, ``best_val_loss``, ``selected_on``, ...).
    """
    accelerator = make_accelerator(args)
    # one run at a time writes the folder
    with folder_lock(args.out) if accelerator.is_main_process else contextlib.nullcontext():
        return train_locked(args, accelerator)


def train_locked(args: argparse.Namespace, accelerator: Accelerator) -> dict:
    """:func:`train`'s work, holding the lock of ``args.out`` (in the main process)."""
    main_process = accelerator.is_main_process
    family, manifest = load_manifest(args.manifest)  # before the folder is claimed: a refused run writes nothing
    family.check_task(args.task, f"--task (manifest {args.manifest})")
    splits = centralized_splits(manifest, f"manifest {args.manifest}")
    select = selection_split(splits)
    if select == LAST_EPOCH and not args.last_epoch:
        raise TaskHetError(f"manifest {args.manifest} has no validation rows (column val) to choose best.pt on (the "
                           "test split never chooses); make the manifest with a validation part (step 1's "
                           "--val_fraction, the default) or pass --last_epoch to keep the last epoch (reports then say so)")
    if select == LAST_EPOCH and args.early_stopping_patience:
        raise TaskHetError(f"--early_stopping_patience {args.early_stopping_patience}: manifest {args.manifest} has no "
                           "validation rows to stop on (the test split never decides); drop it or add a validation part")
    if main_process:
        claim_folder(args.out, STEP)
    signature = {key: str(value) for key, value in vars(args).items() if key not in NOT_IN_SIGNATURE}
    check_resumable(args.out, signature, args.resume)  # before config.json: a refused resume changes nothing
    task = get_task(args.task)
    set_deterministic(args.deterministic)
    datasets = {split: family.dataset(args.data_path, rows, task, args.image_size, args.cache_dir)
                for split, rows in splits.items()}
    num_classes = family.output_channels(manifest, task)
    model = build_task_model(args.task, args.encoder, args.weights, num_classes=num_classes,
                             embedding_grid=args.embedding_grid, seed=args.seed, freeze_encoder=args.freeze_encoder,
                             decoder_width=args.decoder_width)

    if main_process:
        args.out.mkdir(parents=True, exist_ok=True)
        write_config(args.out, {**vars(args), "num_processes": accelerator.num_processes}, step=STEP)
    with run_log(args.out) if main_process else contextlib.nullcontext(_silent_logger()) as logger:
        device = accelerator.device
        logger.info("task %s, encoder %s (weights %s), %s samples, best.pt: %s, device %s, %d process(es), "
                    "mixed precision %s", args.task, args.encoder, args.weights,
                    " / ".join(f"{len(data)} {split}" for split, data in datasets.items()),
                    "the last epoch (no validation rows)" if select == LAST_EPOCH else f"the epoch of the lowest {select} loss",
                    device,
                    accelerator.num_processes, args.mixed_precision)
        model = prepare_model(model, device)
        if args.cache_features:  # a frozen encoder's maps, computed once (datasets/encoded.py); the main process fills the cache
            with accelerator.main_process_first():
                datasets = {split: encoded_dataset(data, splits[split], family, model, args.data_path, args.image_size,
                                                   args.cache_dir, manifest) for split, data in datasets.items()}
        optimizer, scheduler = optimizer_and_scheduler(args, model)
        loader_seed = derive_seed(args.seed, "centralized", args.task)
        # item reads: accelerator.prepare cuts each batch into per-process slices (split_batches), which needs a batch_size
        train_data = datasets.pop("train")
        train_loader = make_loader(train_data, args.batch_size, True, loader_seed, args.num_workers, batch_reads=False)
        eval_loaders = {split: make_loader(data, args.batch_size, False, loader_seed, args.num_workers) for split, data in datasets.items()}
        # the training targets once more, in order, for the trivial predictors' constants (training's loader stays untouched)
        trivial_train_loader = make_loader(train_data, args.batch_size, False, loader_seed, args.num_workers)
        # the scheduler stays unprepared: it steps once per epoch, and it already holds the optimizer's parameter groups
        model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
        accelerator.wait_for_everyone()  # the main process has checked and claimed the folder
        with unfinished(args.out, STEP) if main_process else contextlib.nullcontext():  # step 3 refuses an unfinished best.pt
            return fit(model, task, train_loader, eval_loaders, optimizer, scheduler, accelerator,
                       input_key=model_input_key(family, args.cache_features),
                       n_epochs=args.n_epochs, out_dir=args.out, run_signature=signature, select_split=select,
                       early_stopping_patience=args.early_stopping_patience or None, resume=args.resume, logger=logger,
                       progress=args.progress and main_process, tensorboard=args.tensorboard,
                       plots=args.plots, trivial_train_loader=trivial_train_loader)


def _silent_logger() -> logging.Logger:
    """The logger of a process other than the main one under accelerate launch: the main process logs."""
    logger = logging.getLogger("train_centralized.other_process")
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())
    logger.propagate = False
    return logger
