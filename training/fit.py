"""Step 2's epoch loop with its run folder: ``fit``, run through an ``accelerate.Accelerator``
(mixed precision, and data-parallel processes under ``accelerate launch``; see :func:`fit`).

It writes ``metrics.csv`` (long format ``epoch, split, metric, value``; epoch 0 is the untrained model; one
set of rows per evaluated split, ``val`` and ``test`` or ``test`` alone; and once, at epoch 0, each trivial
predictor's loss on each evaluated split: split ``trivial_<split>``, metric ``<predictor>_loss``, see :func:`fit`),
``best.pt`` (the first epoch of the lowest loss on the selection split, the untrained epoch 0 included: a later
equal loss does not replace it), ``last.pt`` (every epoch, atomically), ``curves.png`` (every
metric) and ``loss.png`` / ``<primary metric>.png`` (one metric, every split). ``last.pt`` holds the
model, optimizer, scheduler, epoch, early-stopping counters and the training
loader's RNG state, so a resumed run ends bit-identical to an uninterrupted one
(same device, deterministic mode). There is no other randomness to restore: no
dropout, no augmentation. With a frozen pretrained encoder both checkpoints leave it
out and name it by source and hash (:mod:`models.frozen_encoder`); reading them puts it back.
"""

from __future__ import annotations

import csv
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from models.frozen_encoder import FrozenEncoder, frozen_encoder_of, load_full_checkpoint, strip_frozen_encoder
from models.tasks import TaskSpec
from training.loop import (LAST_EPOCH, METRICS_COLUMNS, TEST_SPLIT, TRAIN_SPLIT, TRIVIAL_METRIC_SUFFIX,
                           TRIVIAL_SPLIT_PREFIX, VAL_SPLIT, evaluate, task_spec, train_one_batch, trivial_losses)
from utils.errors import NonFiniteLossError, TaskHetError
from utils.interrupts import RESUME_HINT, interrupted
from utils.progress import Pace
from utils.run_dir import MetricsCSV, atomic_torch_save, remove_stale_temporaries
from utils.tensorboard_log import mirror_to_tensorboard

# accelerate and matplotlib (utils.plots) are imported in the functions that use them.
if TYPE_CHECKING:
    from accelerate import Accelerator

# The end of a run whose best.pt is epoch 0: without this line a small folder silently hands step 3 a random network.
UNTRAINED_BEST = ("best.pt is the untrained model (epoch 0): no epoch lowered the %s loss below the untrained one's; "
                  "step 3 refuses to embed it unless --allow_untrained asks (train longer, or change --init_lr)")


def _check_signature(path: Path, saved: dict, current: dict) -> None:
    differences = [f"{key}: {saved.get(key)!r} -> {current.get(key)!r}" for key in sorted(set(saved) | set(current))
                   if saved.get(key) != current.get(key)]
    if differences:
        raise TaskHetError(
            f"{path} belongs to a run with other arguments ({'; '.join(differences)}); "
            "pass --no-resume to start over, or choose another --out"
        )


def check_resumable(out_dir: Path, run_signature: dict, resume: bool) -> None:
    """Refuse, before anything is written, to resume ``out_dir/last.pt`` of a run with other arguments."""
    last_path = Path(out_dir) / "last.pt"
    if resume and last_path.is_file():
        _check_signature(last_path, _load_last(last_path)["run_signature"], run_signature)


def _load_last(path: Path, frozen: FrozenEncoder | None = None) -> dict:
    """last.pt as it was written (a left-out frozen encoder put back: ``frozen``, the run's own, or a rebuild)."""
    return load_full_checkpoint(path, "--resume: step-2 checkpoint",
                                keys=("model", "optimizer", "scheduler", "state", "rng", "run_signature"), known=frozen)


def fit(model: nn.Module, task: TaskSpec | str, train_loader: DataLoader, eval_loaders: dict[str, DataLoader],
        optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        accelerator: Accelerator, *, input_key: str, n_epochs: int, out_dir: Path, run_signature: dict,
        select_split: str = VAL_SPLIT, early_stopping_patience: int | None = None, resume: bool = True,
        logger: logging.Logger | None = None, progress: bool = True, tensorboard: bool = False,
        plots: bool = True, trivial_train_loader: DataLoader | None = None) -> dict:
    """Train ``n_epochs`` epochs (or until early stopping), evaluating every split and checkpointing after each.

    Under ``accelerate launch`` every process runs this function: each trains on its slice of every
    global batch (DDP averages the gradients), evaluates every split whole, and takes the main
    process's numbers, so all of them take the same best-epoch and early-stopping decisions. Only the
    main process writes the run folder (metrics.csv, best.pt, last.pt, plots). The checkpoints hold the
    unwrapped model, so a run resumes at any number of processes.

    Args:
        model: a :class:`models.TaskModel` prepared by ``accelerator`` (its ``config`` goes into checkpoints).
        task: the task (spec or name).
        train_loader: training batches: :func:`make_loader`'s, prepared by ``accelerator``; its generator
            (the original loader's, kept by accelerate) is checkpointed.
        eval_loaders: split name -> its batches (not prepared: every process evaluates the whole split),
            evaluated after every epoch (and before the first); ``{"val": ..., "test": ...}`` or ``{"test": ...}``
            for data without a validation part.
        optimizer: over the model's parameters, prepared by ``accelerator``.
        scheduler: stepped once per epoch (not prepared), or None for a constant learning rate.
        accelerator: step 2's (device, mixed precision, processes).
        input_key: batch key of the model input (the data family's ``input_key``).
        n_epochs: epochs in total (a resumed run counts the epochs already done).
        out_dir: the run folder.
        run_signature: the arguments that define the run; resuming a checkpoint written
            with other values is refused.
        select_split: the key of ``eval_loaders`` whose loss picks best.pt and stops early (``val``), or
            :data:`~training.loop.LAST_EPOCH`: no split selects, best.pt is the last epoch and nothing stops early
            (step 2's --last_epoch, for data without validation rows; the test split never selects).
        early_stopping_patience: stop after this many epochs in a row without a strictly lower ``select_split``
            loss than the best so far (an equal loss is no improvement; epoch 0 is the first best), so a best epoch
            ``b`` stops the run after epoch ``b + patience``; reached at epoch ``n_epochs`` itself, nothing was cut
            short and ``stopped_early`` stays False.
        resume: continue from ``out_dir/last.pt`` when it exists; otherwise start over.
        logger: where the per-epoch summary goes.
        progress: draw the epoch and evaluation bars.
        tensorboard: also write metrics.csv's rows as TensorBoard scalars under ``out_dir/tensorboard``.
        plots: draw curves.png, loss.png and <metric>.png at the end (off: metrics.csv alone).
        trivial_train_loader: the training split's batches, unshuffled and not prepared, whose targets give the
            constants of the trivial predictors (:func:`training.loop.trivial_predictors`: all zeros, and the best
            constant under the task's loss); before the first epoch the main process writes their loss on every
            split of ``eval_loaders`` to metrics.csv (epoch 0, split ``trivial_test``, metric ``zero_loss``, ...), once:
            a resumed run whose metrics.csv has them computes nothing, one made before they existed gets them. None:
            no such rows.

    Returns:
        ``{"best_epoch", "best_val_loss" (the ``select_split`` loss of best.pt), "selected_on" (``select_split``),
        "epochs_done", "stopped_early"}``. ``best_epoch`` 0 means best.pt holds the untrained model (no epoch lowered
        the loss below it); the log says so in one line, and step 3 refuses to embed it unless asked.

    Raises:
        utils.interrupts.Interrupted: on Ctrl-C or SIGTERM, naming the epoch that was running and the epoch of
            last.pt (a rerun resumes from it).
    """
    if select_split not in eval_loaders and select_split != LAST_EPOCH:
        raise TaskHetError(f"the selection split {select_split!r} is not among the evaluated splits {sorted(eval_loaders)}")
    spec = task_spec(task)
    logger = logger or logging.getLogger(__name__)
    out_dir = Path(out_dir)
    run = _Run(accelerator, model, spec, eval_loaders, input_key, progress)
    last_path, best_path, csv_path = out_dir / "last.pt", out_dir / "best.pt", out_dir / "metrics.csv"
    if run.main:
        remove_stale_temporaries(out_dir)  # half-written files of a killed earlier run of this folder
    state = {"epoch": 0, "best_epoch": 0, "best_val_loss": math.inf, "epochs_without_improvement": 0, "stopped_early": False}
    if resume and last_path.is_file():
        checkpoint = _load_last(last_path, run.frozen)
        _check_signature(last_path, checkpoint["run_signature"], run_signature)
        run.module.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(checkpoint["scheduler"])
        if accelerator.scaler is not None and checkpoint.get("scaler"):
            accelerator.scaler.load_state_dict(checkpoint["scaler"])
        train_loader.generator.set_state(checkpoint["rng"]["train_loader"])
        state = dict(checkpoint["state"])
        metrics_csv = run.metrics_csv(csv_path, tensorboard, out_dir)
        # rows of an epoch that was running when the run stopped
        metrics_csv.truncate_after("epoch", state["epoch"])
        logger.info("resuming from %s after epoch %d", last_path, state["epoch"])
    else:
        if run.main:
            csv_path.unlink(missing_ok=True)
        metrics_csv = run.metrics_csv(csv_path, tensorboard, out_dir)
        initial = run.evaluate_all()
        metrics_csv.write(_rows(0, initial))
        _track_best(run, 0, initial.get(select_split), state, best_path)
        logger.info("epoch 0 (untrained): %s", _format_splits(initial))
    if run.main and trivial_train_loader is not None and not _has_trivial_rows(csv_path):
        trivial = trivial_losses(spec, trivial_train_loader, eval_loaders, _output_channels(run.module), accelerator.device)
        metrics_csv.write(_trivial_rows(trivial))
        logger.info("trivial predictors (no model): %s", _format_splits(trivial))

    pace = Pace(state["epoch"], n_epochs)
    saved = state["epoch"] if last_path.is_file() else None  # the epoch of last.pt, once there is one
    try:
        while state["epoch"] < n_epochs and not state["stopped_early"]:
            epoch = state["epoch"] + 1
            model.train()
            loss_sum, batches = 0.0, 0
            for batch in tqdm(train_loader, desc=f"epoch {epoch}/{n_epochs}", leave=False, dynamic_ncols=True,
                              disable=not progress):
                loss = train_one_batch(model, batch, spec, optimizer, accelerator.device, input_key=input_key,
                                       accelerator=accelerator)
                if not math.isfinite(loss):  # as step 4 stops: the weights are garbage from here on
                    raise NonFiniteLossError(f"epoch {epoch}, batch {batches + 1}: the training loss is {loss}; the run "
                                             f"stopped, {out_dir} stays marked incomplete (lower --init_lr?)")
                loss_sum += loss
                batches += 1
            learning_rate = optimizer.param_groups[0]["lr"]
            if scheduler is not None:
                scheduler.step()
            evaluated = run.evaluate_all()
            rows = [{"epoch": epoch, "split": TRAIN_SPLIT, "metric": "loss", "value": loss_sum / max(batches, 1)},
                    {"epoch": epoch, "split": TRAIN_SPLIT, "metric": "lr", "value": learning_rate}]
            rows += _rows(epoch, evaluated)
            # metrics before last.pt: a resume truncates rows past its checkpoint, never misses any
            metrics_csv.write(rows)
            watched = TEST_SPLIT if select_split == LAST_EPOCH else select_split  # a loss that shows divergence
            selection_loss = evaluated[watched]["loss"]
            if not math.isfinite(selection_loss):  # diverged weights: a finite train loss alone does not say so
                raise NonFiniteLossError(f"epoch {epoch}: the {watched} loss is {selection_loss} (the weights "
                                         f"diverged; the training loss was {loss_sum / max(batches, 1):.3g}); the run "
                                         f"stopped, {out_dir} stays marked incomplete (lower --init_lr?)")
            state["epoch"] = epoch
            _track_best(run, epoch, evaluated.get(select_split), state, best_path)
            patience_over = early_stopping_patience is not None and state["epochs_without_improvement"] >= early_stopping_patience
            state["stopped_early"] = patience_over and epoch < n_epochs
            if run.main:
                atomic_torch_save(strip_frozen_encoder({
                    "model": run.module.state_dict(), "model_config": run.module.config, "optimizer": optimizer.state_dict(),
                    "scheduler": None if scheduler is None else scheduler.state_dict(), "state": dict(state),
                    "scaler": None if accelerator.scaler is None else accelerator.scaler.state_dict(),
                    "rng": {"train_loader": train_loader.generator.get_state()}, "run_signature": run_signature, "task": spec.name,
                }, run.frozen), last_path)
            saved = epoch
            logger.info("epoch %d/%d: train loss %.5f, lr %.3g; %s; %s", epoch, n_epochs, loss_sum / max(batches, 1),
                        learning_rate, _format_splits(evaluated), pace.eta(epoch))
            if state["stopped_early"]:
                logger.info("early stopping: no lower %s loss in %d epochs", select_split, early_stopping_patience)
    except KeyboardInterrupt as error:  # Ctrl-C, or SIGTERM (utils/interrupts.py)
        checkpoint = "no checkpoint yet" if saved is None else f"checkpoint at epoch {saved}"
        raise interrupted(error, f"interrupted at epoch {state['epoch'] + 1} ({checkpoint}); {RESUME_HINT}") from None
    if hasattr(metrics_csv, "close"):  # the TensorBoard mirror's event file
        metrics_csv.close()
    if run.main and plots:
        _plot(csv_path, out_dir, spec)
    accelerator.wait_for_everyone()  # no process leaves (and ends its run) before the main one has written
    if select_split == LAST_EPOCH:
        logger.info("best.pt: the last epoch, %d (no validation rows: nothing selected)", state["best_epoch"])
    else:
        logger.info("best epoch %d (by %s loss), %s loss %.5f", state["best_epoch"], select_split, select_split,
                    state["best_val_loss"])
        if state["best_epoch"] == 0:
            logger.warning(UNTRAINED_BEST, select_split)
    return {"best_epoch": state["best_epoch"], "best_val_loss": state["best_val_loss"], "selected_on": select_split,
            "epochs_done": state["epoch"], "stopped_early": state["stopped_early"]}


class _Run:
    """What :func:`fit` needs of its processes: the unwrapped model, who writes, and evaluations all processes agree on."""

    def __init__(self, accelerator: Accelerator, model: nn.Module, spec: TaskSpec, loaders: dict[str, DataLoader],
                 input_key: str, progress: bool) -> None:
        self.accelerator, self.spec, self.loaders = accelerator, spec, loaders
        self.input_key, self.progress = input_key, progress
        # the model itself (no DDP wrapper): what checkpoints hold; its forward keeps accelerate's autocast
        self.module = accelerator.unwrap_model(model)
        self.main = accelerator.is_main_process
        self.frozen = frozen_encoder_of(self.module)  # checkpoints name it instead of holding it

    def metrics_csv(self, path: Path, tensorboard: bool, out_dir: Path):
        """metrics.csv (and its TensorBoard mirror) in the main process; a sink elsewhere."""
        if not self.main:
            return _DiscardRows()
        return mirror_to_tensorboard(MetricsCSV(path, METRICS_COLUMNS), tensorboard, out_dir, "epoch")

    def evaluate_all(self) -> dict[str, dict[str, float]]:
        """Every split's metrics, the main process's in every process (each evaluates the whole split)."""
        from accelerate.utils import broadcast, broadcast_object_list

        if self.accelerator.num_processes > 1:
            # BatchNorm running statistics: each process updated its own in its last forward; take process 0's
            # (those that last.pt and best.pt hold), so every process evaluates the same model
            for buffer in self.module.buffers():
                broadcast(buffer, from_process=0)
        evaluated = _evaluate_all(self.module, self.loaders, self.spec, self.accelerator.device, self.input_key,
                                  self.progress)
        if self.accelerator.num_processes > 1:
            # equal models on equal data, but kernels may round differently: the decisions must not diverge
            evaluated = broadcast_object_list([evaluated], from_process=0)[0]
        return evaluated


class _DiscardRows:
    """metrics.csv in a process other than the main one under ``accelerate launch``: the main process writes the rows."""

    def write(self, rows: list[dict]) -> None:
        pass

    def truncate_after(self, column: str, value: int) -> None:
        pass


def _evaluate_all(model: nn.Module, loaders: dict[str, DataLoader], spec: TaskSpec, device: torch.device,
                  input_key: str, progress: bool = True) -> dict[str, dict[str, float]]:
    """Every split's metrics; ``model``'s forward is accelerate's (it autocasts to --mixed_precision)."""
    return {split: evaluate(model, loader, spec, device, input_key=input_key, progress=progress, own_autocast=False)
            for split, loader in loaders.items()}


def _rows(epoch: int, evaluated: dict[str, dict[str, float]]) -> list[dict]:
    return [{"epoch": epoch, "split": split, "metric": key, "value": value}
            for split, values in evaluated.items() for key, value in values.items()]


def _trivial_rows(trivial: dict[str, dict[str, float]]) -> list[dict]:
    """metrics.csv's rows of :func:`training.loop.trivial_losses`'s ``{split: {predictor: loss}}``."""
    return [{"epoch": 0, "split": TRIVIAL_SPLIT_PREFIX + split, "metric": name + TRIVIAL_METRIC_SUFFIX, "value": value}
            for split, values in trivial.items() for name, value in values.items()]


def _has_trivial_rows(csv_path: Path) -> bool:
    """Whether metrics.csv already holds trivial predictors' rows (a resumed run's, written when it started)."""
    if not csv_path.is_file():
        return False
    with csv_path.open(newline="") as handle:
        return any(row["split"].startswith(TRIVIAL_SPLIT_PREFIX) for row in csv.DictReader(handle))


def _output_channels(model: nn.Module) -> int:
    """The channels of a :class:`models.TaskModel`'s output: its head's (a 1×1 convolution, or a linear layer)."""
    head = model.head
    return head.out_channels if isinstance(head, nn.Conv2d) else head.out_features


def _plot(csv_path: Path, out_dir: Path, spec: TaskSpec) -> None:
    """curves.png with every metric, and one PNG per headline metric (loss, the task's primary metric) with every split."""
    from utils.plots import plot_curves  # matplotlib: see the imports above

    title = f"{spec.name}: {out_dir.name}"
    plot_curves(csv_path, out_dir / "curves.png", x="epoch", hue="split", title=title)
    for metric in dict.fromkeys(("loss", spec.primary_metric)):
        plot_curves(csv_path, out_dir / f"{metric}.png", x="epoch", hue="split", where={"metric": metric}, title=title)


def _track_best(run: _Run, epoch: int, val: dict[str, float] | None, state: dict, best_path: Path) -> None:
    """Write best.pt (main process) when the validation loss is strictly the lowest so far (epoch 0, the untrained
    model, included; on a tie the earlier epoch stays, as :func:`training.selection.selected_epoch` reads it back);
    ``val`` None (no split selects, :data:`~training.loop.LAST_EPOCH`): every epoch, so it ends the last."""
    if val is None or val["loss"] < state["best_val_loss"]:
        loss = math.nan if val is None else val["loss"]
        state.update(best_epoch=epoch, best_val_loss=loss, epochs_without_improvement=0)
        if run.main:
            atomic_torch_save(strip_frozen_encoder({"model": run.module.state_dict(), "model_config": run.module.config,
                                                    "epoch": epoch, "val_metrics": val, "task": run.spec.name}, run.frozen),
                              best_path)
    else:
        state["epochs_without_improvement"] += 1


def _format_splits(evaluated: dict[str, dict[str, float]]) -> str:
    return "; ".join(f"{split} {_format_metrics(values)}" for split, values in evaluated.items())


def _format_metrics(values: dict[str, float]) -> str:
    return ", ".join(f"{key} {value:.4g}" for key, value in values.items())
