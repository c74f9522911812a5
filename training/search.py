"""The centralized hyperparameter search as a library: the grid, one row per trained (config, seed), the
per-config summary over seeds, the pick, the report.

Training is step 2's (``steps/search_centralized.py`` runs it once per config and seed); this module
only reads what each run wrote. A config's score (:class:`Score`) is the mean over seeds of its best validation
value over epochs 1..n: for a classification task the highest ``top1``, with a 95% t-interval on the logit scale,
inside [0, 1]; for a dense task the lowest ``loss``, with a 95% t-interval on the log scale, never below 0
(utils/statistics.py; epochs get log-scale intervals too). Configs are ranked by that mean (classification ties
by the lower mean best validation loss), then by grid order; a config with a diverged seed is ranked last. The
test split plays no part in the ranking and only gives the winner's final numbers.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pandas as pd

from utils.statistics import MIN_SEEDS, NONNEGATIVE, UNIT, mean_interval, metric_scale
from training.loop import VAL_SPLIT
from training.selection import curve, epochs_to_within, read_metrics
from utils.errors import TaskHetError
from utils.plots import plot_curves
from utils.run_dir import atomic_write_text

ACCURACY = "top1"  # the search ranks classification runs by their validation top-1 accuracy
CONFIG_COLUMNS = ("config", "lr", "weight_decay", "scheduler")
# search_runs.csv: one row per (config, seed)
RUN_COLUMNS = (*CONFIG_COLUMNS, "seed", "best_val_top1", "best_val_loss", "best_epoch", "epochs_to_within", "epochs_done",
               "status")
# search.csv: one row per config, over its seeds (mean and 95% t-interval bounds _low/_high; NaN bounds with one seed)
TABLE_COLUMNS = (*CONFIG_COLUMNS, "n_seeds", "n_diverged", "best_val_top1", "best_val_top1_low", "best_val_top1_high",
                 "best_val_loss", "best_val_loss_low", "best_val_loss_high", "epochs_to_within", "epochs_to_within_low",
                 "epochs_to_within_high", "epochs_to_within_max", "status")
DONE, DIVERGED = "done", "diverged"
CLEAR, NOT_CLEAR, UNKNOWN = "clear", "not clear", "unknown"


@dataclass(frozen=True)
class Score:
    """What the search ranks by: the best over epochs of one validation metric of metrics.csv, and its direction.

    Attributes:
        metric: metrics.csv's metric name (``top1``, ``loss``).
        higher_is_better: True for an accuracy, False for a loss.
        scale: the scale of its t-interval (:data:`utils.statistics.UNIT`: logit; ``NONNEGATIVE``: log).
        words: how the report names it (``validation top-1``).
    """

    metric: str
    higher_is_better: bool
    scale: str
    words: str

    @property
    def column(self) -> str:
        """Its column in search_runs.csv and search.csv (``best_val_top1``)."""
        return f"best_val_{self.metric}"

    def best_epoch(self, values: pd.Series) -> int:
        """The epoch of the best value (the first, on ties)."""
        return int(values.idxmax() if self.higher_is_better else values.idxmin())

    def clearly_better(self, row: dict, other: dict) -> bool:
        """Whether ``row``'s 95% interval lies wholly on the better side of ``other``'s (touching is not clear)."""
        if self.higher_is_better:
            return row[f"{self.column}_low"] > other[f"{self.column}_high"]
        return row[f"{self.column}_high"] < other[f"{self.column}_low"]

    def within(self, tolerance: float) -> str:
        """The rule of 'epochs needed' in words: ``top-1 >= 0.99 x best``."""
        factor, sign = (1 - tolerance, ">=") if self.higher_is_better else (1 + tolerance, "<=")
        return f"{self.metric} {sign} {factor:g} x best"


BY_ACCURACY = Score(ACCURACY, True, UNIT, "validation top-1")
BY_LOSS = Score("loss", False, NONNEGATIVE, "validation loss")


def score_for(task_kind: str) -> Score:
    """A classification task is ranked by validation top-1 accuracy; every dense task by validation loss."""
    return BY_ACCURACY if task_kind == "classification" else BY_LOSS


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

    def columns(self) -> dict:
        return {"config": self.name, "lr": self.lr, "weight_decay": self.weight_decay, "scheduler": self.scheduler}


def grid(lrs: list[float], weight_decays: list[float], schedulers: list[str]) -> list[Config]:
    """Every combination, in the order lr, then weight decay, then scheduler; repeated values are refused."""
    for flag, values in (("--lrs", lrs), ("--weight_decays", weight_decays), ("--schedulers", schedulers)):
        if len(set(values)) != len(values):
            raise TaskHetError(f"{flag} repeats a value: {', '.join(map(str, values))}")
    configs = [Config(lr, wd, scheduler) for lr, wd, scheduler in itertools.product(lrs, weight_decays, schedulers)]
    names: dict[str, Config] = {}
    for config in configs:  # %g keeps 6 significant digits: 0.1 and 0.1000001 would share one run folder
        if config.name in names:
            first = names[config.name]
            raise TaskHetError(f"lr {first.lr!r}, weight decay {first.weight_decay!r} and lr {config.lr!r}, weight decay "
                               f"{config.weight_decay!r} both map to the run folder {config.name}; give --lrs and "
                               "--weight_decays values that differ in 6 significant digits")
        names[config.name] = config
    return configs


def summarize(config: Config, seed: int, run_dir: Path, tolerance: float, score: Score = BY_ACCURACY) -> dict:
    """One row of search_runs.csv from a finished step-2 run of ``config`` with ``seed`` (keys :data:`RUN_COLUMNS`).

    ``best_epoch`` is the epoch of the best validation ``score`` (the first, on ties) and ``epochs_to_within`` the
    first epoch within ``tolerance`` of it (accuracy at least ``1 - tolerance`` times it, loss at most
    ``1 + tolerance`` times it). ``best_val_top1`` is NaN for a task without accuracy.
    """
    metrics = read_metrics(Path(run_dir) / "metrics.csv")
    values = curve(metrics, VAL_SPLIT, score.metric)
    trained = values[values.index >= 1]
    if trained.empty:
        raise TaskHetError(f"{run_dir}/metrics.csv: no validation {score.metric} of a trained epoch; "
                           "the search needs a manifest with a validation part")
    accuracy = curve(metrics, VAL_SPLIT, ACCURACY) if score.metric == ACCURACY else None
    return {**config.columns(), "seed": seed,
            "best_val_top1": math.nan if accuracy is None else float(accuracy[accuracy.index >= 1].max()),
            "best_val_loss": float(curve(metrics, VAL_SPLIT, "loss").min()), "best_epoch": score.best_epoch(trained),
            "epochs_to_within": epochs_to_within(values, tolerance, score.higher_is_better),
            "epochs_done": int(metrics["epoch"].max()), "status": DONE}


def diverged(config: Config, seed: int) -> dict:
    """The row of a run whose training loss became NaN/inf: no score (a too-high lr is an answer too)."""
    return {**config.columns(), "seed": seed, "best_val_top1": math.nan, "best_val_loss": math.nan, "best_epoch": -1,
            "epochs_to_within": -1, "epochs_done": -1, "status": DIVERGED}


def aggregate(runs: pd.DataFrame) -> pd.DataFrame:
    """search.csv from search_runs.csv: per config (in first-seen order), the mean and 95% t-interval over its finished seeds.

    A config with any diverged seed gets status diverged (its lr is unstable) and is ranked last by
    :func:`rank`; its means are over the seeds that finished (NaN when none did).
    """
    rows = []
    for _, group in runs.groupby("config", sort=False):
        done = group[group["status"] == DONE]
        accuracy = _interval(done["best_val_top1"].dropna(), UNIT)
        loss = _interval(done["best_val_loss"], NONNEGATIVE)
        epochs = _interval(done["epochs_to_within"], NONNEGATIVE)
        n_diverged = int((group["status"] == DIVERGED).sum())
        rows.append({**{key: group.iloc[0][key] for key in CONFIG_COLUMNS}, "n_seeds": len(group), "n_diverged": n_diverged,
                     "best_val_top1": accuracy[0], "best_val_top1_low": accuracy[1], "best_val_top1_high": accuracy[2],
                     "best_val_loss": loss[0], "best_val_loss_low": loss[1], "best_val_loss_high": loss[2],
                     "epochs_to_within": epochs[0], "epochs_to_within_low": epochs[1], "epochs_to_within_high": epochs[2],
                     "epochs_to_within_max": int(done["epochs_to_within"].max()) if len(done) else -1,
                     "status": DIVERGED if n_diverged else DONE})
    return pd.DataFrame(rows, columns=list(TABLE_COLUMNS))


def _interval(values: pd.Series, scale: str) -> tuple[float, float, float]:
    return mean_interval([float(value) for value in values], scale) if len(values) else (math.nan, math.nan, math.nan)


def rank(table: pd.DataFrame, score: Score = BY_ACCURACY) -> pd.DataFrame:
    """``table`` best first: finished configs before diverged ones, then the best mean ``score`` (an accuracy's ties
    by the lower mean best_val_loss), then grid order (a stable sort)."""
    order = table.assign(_diverged=table["status"] != DONE)
    keys = ["_diverged", score.column] + (["best_val_loss"] if score.column != "best_val_loss" else [])
    ascending = [True, not score.higher_is_better] + [True] * (len(keys) - 2)
    order = order.sort_values(keys, ascending=ascending, kind="stable", na_position="last")
    return order.drop(columns="_diverged")


def win_clarity(winner: dict, runner_up: dict | None, score: Score = BY_ACCURACY) -> str:
    """``clear`` when the winner's 95% interval of the mean score lies wholly on the better side of the runner-up's
    (above for an accuracy, below for a loss), ``not clear`` when they overlap, ``unknown`` without a runner-up or
    when either side is undecidable: fewer than 3 finished seeds (``n_seeds − n_diverged``) or zero spread (every
    seed the same score: a zero-width interval).

    Disjoint intervals are a conservative test (two means can differ significantly while their intervals touch):
    a ``clear`` win is clear, a ``not clear`` one may still be real with more seeds.
    """
    if runner_up is None or not _decidable(winner, score) or not _decidable(runner_up, score):
        return UNKNOWN
    return CLEAR if score.clearly_better(winner, runner_up) else NOT_CLEAR


def _decidable(row: dict, score: Score) -> bool:
    low, high = row[f"{score.column}_low"], row[f"{score.column}_high"]
    return row["n_seeds"] - row["n_diverged"] >= MIN_SEEDS and not math.isnan(low) and high > low


def long_metrics(runs: list[tuple[Config, int, Path]]) -> pd.DataFrame:
    """Every run's metrics.csv rows, with the config's columns and the seed in front (the search's metrics.csv).

    Args:
        runs: ``(config, seed, run folder)`` of the finished runs only.
    """
    frames = [read_metrics(run_dir / "metrics.csv").assign(**config.columns(), seed=seed) for config, seed, run_dir in runs]
    frame = pd.concat(frames, ignore_index=True)
    return frame[[*CONFIG_COLUMNS, "seed", "epoch", "split", "metric", "value"]]


def mean_validation_curves(metrics: pd.DataFrame, score: Score = BY_ACCURACY) -> pd.DataFrame:
    """The validation ``score`` metric per config and epoch, averaged over seeds (val_<metric>.csv, the numbers
    val_<metric>.png plots)."""
    rows = metrics[(metrics["split"] == VAL_SPLIT) & (metrics["metric"] == score.metric)]
    means = rows.groupby(["config", "epoch"], sort=False)["value"].mean().reset_index()
    return means.assign(split=VAL_SPLIT, metric=score.metric)[["config", "epoch", "split", "metric", "value"]]


def plot_validation_curves(curves_csv: Path, out_png: Path, score: Score = BY_ACCURACY) -> Path | None:
    """One line per config: the validation ``score`` metric per epoch (its mean over seeds)."""
    return plot_curves(curves_csv, out_png, x="epoch", hue="config", where={"split": VAL_SPLIT, "metric": score.metric},
                       title=f"{score.words} per config (mean over seeds)")


def pick(table: pd.DataFrame, score: Score = BY_ACCURACY) -> tuple[dict, dict | None]:
    """The best config of search.csv's ``table`` and the runner-up (None when only one config finished)."""
    done = rank(table[table["status"] == DONE], score)
    if done.empty:
        raise TaskHetError("every config diverged (NaN/inf training loss): try lower --lrs")
    return _plain(done.iloc[0].to_dict()), (_plain(done.iloc[1].to_dict()) if len(done) > 1 else None)


def scheduler_runner_up(table: pd.DataFrame, winner: dict, score: Score = BY_ACCURACY) -> dict | None:
    """The best finished config of any scheduler other than the winner's (None when no other scheduler finished)."""
    others = rank(table[(table["status"] == DONE) & (table["scheduler"] != winner["scheduler"])], score)
    return None if others.empty else _plain(others.iloc[0].to_dict())


def best_record(table: pd.DataFrame, tolerance: float, run_dirs: dict[int, Path], tests: dict[int, dict],
                score: Score = BY_ACCURACY) -> dict:
    """best.json: the winning row, how clear its win is, its run folders, and its test numbers.

    Args:
        table: search.csv's rows.
        tolerance: the search's --tolerance.
        run_dirs: the winner's run folder per seed.
        tests: per seed, the test metrics of the winner's best.pt epoch (chosen by validation loss;
            :func:`training.selection.selected_test_metrics`).
        score: what the search ranked by.
    """
    winner, runner_up = pick(table, score)
    other_scheduler = scheduler_runner_up(table, winner, score)
    interval = [f"{score.column}_low", f"{score.column}_high"]
    metric_names = [name for name in next(iter(tests.values())) if name not in ("epoch", "selected_on")]
    test = {name: dict(zip(("mean", "low", "high"), mean_interval([tests[seed][name] for seed in tests], metric_scale(name))))
            for name in metric_names}
    return {**winner, "tolerance": tolerance, "ranked_by": score.column,
            "runner_up": None if runner_up is None else runner_up["config"], "win": win_clarity(winner, runner_up, score),
            "runner_up_interval": None if runner_up is None else [runner_up[key] for key in interval],
            "scheduler_runner_up": None if other_scheduler is None else other_scheduler["config"],
            "scheduler_win": win_clarity(winner, other_scheduler, score),
            "run_dirs": {str(seed): str(path) for seed, path in run_dirs.items()},
            "test_at_selected_epoch": {str(seed): metrics for seed, metrics in tests.items()}, "test": test}


def scheduler_winners(table: pd.DataFrame, score: Score = BY_ACCURACY) -> pd.DataFrame:
    """The best row of each scheduler, best first (its config and mean score with interval, loss, epochs needed)."""
    ranked = rank(table, score)
    columns = [score.column, f"{score.column}_low", f"{score.column}_high"] + (
        ["best_val_loss"] if score.column != "best_val_loss" else [])
    return ranked.drop_duplicates("scheduler")[["scheduler", "config", *columns, "epochs_to_within"]]


def write_report(out_dir: Path, table: pd.DataFrame, best: dict, header: dict, score: Score = BY_ACCURACY) -> Path:
    """report.md: the winner, how many epochs it needs, whether it won clearly, which scheduler won, the whole table.

    Args:
        out_dir: the search folder.
        table: search.csv's rows.
        best: :func:`best_record`'s dict.
        header: ``task``, ``manifest``, ``n_epochs``, ``seeds`` (a list) of the search.
        score: what the search ranked by.
    """
    seeds = header["seeds"]
    test = ", ".join(f"{name} {_with_interval(value['mean'], value['low'], value['high'])}" for name, value in best["test"].items())
    epochs = ", ".join(f"seed {seed} epoch {metrics['epoch']}" for seed, metrics in best["test_at_selected_epoch"].items())
    lines = [
        f"# Centralized hyperparameter search: {header['task']}",
        "",
        f"{len(table)} configs (lr x weight decay x scheduler), {header['n_epochs']} epochs each, "
        f"{len(seeds)} seed(s) ({', '.join(map(str, seeds))}), manifest `{header['manifest']}`. Ranked by the mean over seeds "
        f"of the {'highest' if score.higher_is_better else 'lowest'} {score.words} over the epochs"
        f"{' (ties: lower mean validation loss)' if score.metric == ACCURACY else ''}; intervals are 95% "
        "t-intervals of the mean over seeds on the logit scale for accuracies and the log scale for losses and epochs, "
        "so they stay inside the metric's range; a win is judged only with at least 3 finished seeds per config and "
        "nonzero spread; the test split is not looked at for the ranking.",
        "",
        f"**Best config:** lr {best['lr']:g}, weight decay {best['weight_decay']:g}, scheduler **{best['scheduler']}**: "
        f"{score.words} {_with_interval(*(best[score.column + end] for end in ('', '_low', '_high')))}.",
        "",
        f"**Epochs needed:** {_epochs_needed(best, len(seeds), score)}",
        "",
        f"**Is the win clear?** {_clarity_sentence(best['win'], best, best['runner_up'], table, 'runner-up', score)}",
        "",
        f"**Scheduler that won:** {best['scheduler']}; "
        f"{_clarity_sentence(best['scheduler_win'], best, best['scheduler_runner_up'], table, 'best config of another scheduler', score)} "
        "The best config of each scheduler:",
        "",
        _markdown(scheduler_winners(table, score)),
        "",
        f"**Final test numbers** of the best config (its best.pt per seed, chosen by validation loss: {epochs}): {test}.",
        "",
        "## All configs, best first",
        "",
        _markdown(rank(table, score).dropna(axis="columns", how="all")),  # a dense task has no accuracy columns
        "",
        "Files: search.csv (this table), search_runs.csv (one row per config and seed), best.json, metrics.csv (every "
        f"run's rows), val_{score.metric}.csv and val_{score.metric}.png ({score.words} per epoch, mean over seeds), "
        "runs/<config>/seed<seed>/ (step 2).",
        "",
    ]
    path = Path(out_dir) / "report.md"
    atomic_write_text(path, "\n".join(lines))
    return path


def _with_interval(mean: float, low: float, high: float) -> str:
    """``0.6 (95% interval 0.3516 to 0.8484)``, or the mean alone with one seed."""
    if math.isnan(low):
        return f"{mean:.4g} (one seed: no interval)"
    return f"{mean:.4g} (95% interval {low:.4g} to {high:.4g})"


def _epochs_needed(best: dict, n_seeds: int, score: Score) -> str:
    within = f"to come within {best['tolerance']:.0%} of the run's best {score.words} ({score.within(best['tolerance'])})"
    if n_seeds == 1:
        return f"{best['epochs_to_within']:g} epochs {within}; one seed, so no interval (pass --seeds for one)."
    return (f"{_with_interval(best['epochs_to_within'], best['epochs_to_within_low'], best['epochs_to_within_high'])} epochs "
            f"on average over {n_seeds} seeds {within}; the slowest seed needed {best['epochs_to_within_max']}.")


def _clarity_sentence(clarity: str, best: dict, other_name: str | None, table: pd.DataFrame, role: str,
                      score: Score) -> str:
    if other_name is None:
        return f"{UNKNOWN}: there is no {role} to compare with."
    other = table[table["config"] == other_name].iloc[0]
    low, high = f"{score.column}_low", f"{score.column}_high"
    mine = f"[{best[low]:.4g}, {best[high]:.4g}]"
    theirs = f"[{other[low]:.4g}, {other[high]:.4g}]"
    if clarity == UNKNOWN:
        return (f"{UNKNOWN}: a win is judged only with at least {MIN_SEEDS} finished seeds per config and nonzero spread "
                f"(the winner has {best['n_seeds'] - best['n_diverged']} finished, the {role} {other_name} "
                f"{other['n_seeds'] - other['n_diverged']}, mean {other[score.column]:.4g}); rerun with more --seeds "
                "(e.g. 0,1,2) to tell.")
    side = "above" if score.higher_is_better else "below"
    verdict = (f"its interval lies wholly {side}" if clarity == CLEAR else "its interval overlaps")
    return f"{clarity}: {verdict} that of the {role} {other_name} (winner {mine}, {role} {theirs})."


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

