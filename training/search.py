"""The centralized hyperparameter search as a library: the grid, one summary row per trained config, the pick, the report.

Training is step 2's (``steps/search_centralized.py`` runs it once per config); this module
only reads what each run wrote. Configs are ranked by their best validation accuracy
(``val`` ``top1`` over epochs 1..n), ties by the lower best validation loss, then by grid
order; the test split plays no part in the ranking and only gives the winner's final numbers.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from training.loop import VAL_SPLIT
from training.selection import curve, epochs_to_within, read_metrics, selected_test_metrics
from utils.errors import TaskHetError
from utils.plots import plot_curves
from utils.run_dir import atomic_write_text

ACCURACY = "top1"  # the search ranks classification runs by their validation top-1 accuracy
TABLE_COLUMNS = ("config", "lr", "weight_decay", "scheduler", "best_val_top1", "best_val_loss", "best_epoch",
                 "epochs_to_within", "epochs_done", "status")
DONE, DIVERGED = "done", "diverged"


@dataclass(frozen=True)
class Config:
    """One point of the grid."""

    lr: float
    weight_decay: float
    scheduler: str

    @property
    def name(self) -> str:
        """The config's run folder name, e.g. ``lr0.1-wd0.0001-cosine`` (``%g``: 1e-05, not 0.00001)."""
        return f"lr{self.lr:g}-wd{self.weight_decay:g}-{self.scheduler}"


def grid(lrs: list[float], weight_decays: list[float], schedulers: list[str]) -> list[Config]:
    """Every combination, in the order lr, then weight decay, then scheduler; repeated values are refused."""
    for flag, values in (("--lrs", lrs), ("--weight_decays", weight_decays), ("--schedulers", schedulers)):
        if len(set(values)) != len(values):
            raise TaskHetError(f"{flag} repeats a value: {', '.join(map(str, values))}")
    return [Config(lr, wd, scheduler) for lr, wd, scheduler in itertools.product(lrs, weight_decays, schedulers)]


def summarize(config: Config, run_dir: Path, tolerance: float) -> dict:
    """One row of search.csv from a finished step-2 run of ``config`` (keys :data:`TABLE_COLUMNS`).

    ``best_epoch`` is the epoch of the highest validation accuracy (the first, on ties) and
    ``epochs_to_within`` the first epoch whose validation accuracy is at least ``1 - tolerance``
    times it.
    """
    metrics = read_metrics(Path(run_dir) / "metrics.csv")
    accuracy = curve(metrics, VAL_SPLIT, ACCURACY)
    trained = accuracy[accuracy.index >= 1]
    if trained.empty:
        raise TaskHetError(f"{run_dir}/metrics.csv: no validation {ACCURACY} of a trained epoch; "
                           "the search needs a classification task and a manifest with a validation part")
    return {"config": config.name, "lr": config.lr, "weight_decay": config.weight_decay, "scheduler": config.scheduler,
            "best_val_top1": float(trained.max()), "best_val_loss": float(curve(metrics, VAL_SPLIT, "loss").min()),
            "best_epoch": int(trained.idxmax()), "epochs_to_within": epochs_to_within(accuracy, tolerance),
            "epochs_done": int(metrics["epoch"].max()), "status": DONE}


def diverged(config: Config) -> dict:
    """The row of a config whose training loss became NaN/inf: no score, ranked last (a too-high lr is an answer too)."""
    return {"config": config.name, "lr": config.lr, "weight_decay": config.weight_decay, "scheduler": config.scheduler,
            "best_val_top1": float("nan"), "best_val_loss": float("nan"), "best_epoch": -1, "epochs_to_within": -1,
            "epochs_done": -1, "status": DIVERGED}


def rank(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` best first: highest best_val_top1, then lowest best_val_loss, then grid order (a stable sort); diverged last."""
    return table.sort_values(["best_val_top1", "best_val_loss"], ascending=[False, True], kind="stable", na_position="last")


def long_metrics(configs: list[Config], run_dirs: list[Path]) -> pd.DataFrame:
    """Every run's metrics.csv rows, with the config's columns in front (the search's metrics.csv); pass finished runs only."""
    frames = [read_metrics(run_dir / "metrics.csv").assign(config=config.name, lr=config.lr, weight_decay=config.weight_decay,
                                                            scheduler=config.scheduler)
              for config, run_dir in zip(configs, run_dirs)]
    frame = pd.concat(frames, ignore_index=True)
    return frame[["config", "lr", "weight_decay", "scheduler", "epoch", "split", "metric", "value"]]


def plot_validation_accuracy(metrics_csv: Path, out_png: Path) -> Path | None:
    """One line per config: validation accuracy per epoch."""
    return plot_curves(metrics_csv, out_png, x="epoch", hue="config", where={"split": VAL_SPLIT, "metric": ACCURACY},
                       title="validation top-1 accuracy per config")


def best_record(table: pd.DataFrame, run_dirs: dict[str, Path], tolerance: float) -> dict:
    """best.json: the winning row, its run folder, and the test metrics of its best.pt epoch (chosen by validation loss)."""
    done = table[table["status"] == DONE]
    if done.empty:
        raise TaskHetError("every config diverged (NaN/inf training loss): try lower --lrs")
    best = rank(done).iloc[0].to_dict()
    run_dir = run_dirs[best["config"]]
    return {**_plain(best), "tolerance": tolerance, "run_dir": str(run_dir),
            "test_at_selected_epoch": selected_test_metrics(run_dir / "metrics.csv")}


def scheduler_winners(table: pd.DataFrame) -> pd.DataFrame:
    """The best row of each scheduler, best first (``scheduler, config, best_val_top1, best_val_loss, epochs_to_within``)."""
    ranked = rank(table)
    return ranked.drop_duplicates("scheduler")[["scheduler", "config", "best_val_top1", "best_val_loss", "epochs_to_within"]]


def write_report(out_dir: Path, table: pd.DataFrame, best: dict, header: dict) -> Path:
    """report.md: the winner, how many epochs it needs, which scheduler won, and the whole table best first.

    Args:
        out_dir: the search folder.
        table: search.csv's rows.
        best: :func:`best_record`'s dict.
        header: ``task``, ``manifest``, ``n_epochs``, ``seed`` of the search.
    """
    test = best["test_at_selected_epoch"]
    test_numbers = ", ".join(f"{key} {value:.4g}" for key, value in test.items() if key != "epoch")
    lines = [
        f"# Centralized hyperparameter search: {header['task']}",
        "",
        f"{len(table)} configs (lr x weight decay x scheduler), {header['n_epochs']} epochs each, seed {header['seed']}, "
        f"manifest `{header['manifest']}`. Ranked by the best validation top-1 accuracy over the epochs "
        "(ties: lower validation loss); the test split is not looked at for the ranking.",
        "",
        f"**Best config:** lr {best['lr']:g}, weight decay {best['weight_decay']:g}, scheduler **{best['scheduler']}**: "
        f"validation top-1 {best['best_val_top1']:.4f} at epoch {best['best_epoch']}.",
        "",
        f"**Epochs needed:** {best['epochs_to_within']} epochs reach within {best['tolerance']:.0%} of its best validation "
        f"accuracy (top-1 >= {1 - best['tolerance']:g} x {best['best_val_top1']:.4f}).",
        "",
        f"**Scheduler that won:** {best['scheduler']}. The best config of each scheduler:",
        "",
        _markdown(scheduler_winners(table)),
        "",
        f"**Final test numbers** of the best config (its best.pt, epoch {test['epoch']}, chosen by validation loss): "
        f"{test_numbers}.",
        "",
        "## All configs, best first",
        "",
        _markdown(rank(table)),
        "",
        "Files: search.csv (this table), best.json, metrics.csv (every run's rows), val_top1.png, runs/<config>/ (step 2).",
        "",
    ]
    path = Path(out_dir) / "report.md"
    atomic_write_text(path, "\n".join(lines))
    return path


def write_json(path: Path, record: dict) -> None:
    atomic_write_text(Path(path), json.dumps(record, indent=2) + "\n")


def _markdown(frame: pd.DataFrame) -> str:
    """A markdown table written here: pandas' to_markdown needs the optional tabulate package."""
    def cell(value) -> str:
        return f"{value:.4g}" if isinstance(value, float) else str(value)
    rows = ["| " + " | ".join(frame.columns) + " |", "|" + "---|" * len(frame.columns)]
    rows += ["| " + " | ".join(cell(value) for value in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(rows)


def _plain(record: dict) -> dict:
    """numpy scalars of a pandas row as plain Python numbers (json cannot write np.int64)."""
    return {key: value.item() if hasattr(value, "item") else value for key, value in record.items()}

