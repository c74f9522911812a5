"""The report of the heterogeneity study (``study: heterogeneity_toolbox``, issue 22): which method for which heterogeneity.

Each partition of the grid is a named *situation* (mild label skew, quantity skew, ...). Per
situation and method, over seeds (mean and 95% t interval on the logit scale,
utils/statistics.py), at the final round:

* **global accuracy**: the model each algorithm logs as its global one (metrics.csv's ``global`` rows: IFCA's
  most-populated cluster model, FedEM's components under uniform weights, FedPer's shared body with the
  server's head) on the global test split; ``local`` never moves its server model, so its global accuracy
  is the initial model's;
* **personalised accuracy**: the mean over clients of each client's own test rows under the model
  the method gives that client: its personal model when the method has them (Ditto, pFedMe, FedPer,
  IFCA's and CFL's cluster models, FedEM's mixture, local), the fine-tuned model for local fine-tuning
  (FedAvg's model after ``--finetune_steps``, reported as ``fedavg+ft``), else the global model;
* **worst 10%**: the mean of the worst ⌈10%⌉ clients on the same split (metrics.csv's ``worst_decile``);
* **unseen clients** (partitions with step 3b's ``unseen_fraction``): the mean top-1 over the clients held out of all
  training, on their test rows, under the same kind of model after the method's own adaptation of the final model
  (metrics.csv's ``unseen_test*`` splits); personalised accuracy and the worst 10% are then the seen clients';
* **G² at the start**: step 3c's gradient dissimilarity G² = Σ p_k‖∇F_k − ∇F‖² (and B²) of the
  situation's clients at the seed's centralized model, the model the theory's G² is defined at.

The **winner** of a metric is the method with the highest mean; it comes with its paired difference
against FedAvg and against the runner-up (paired by seed: the same seed gives the same initial model,
partition and client sampling). A difference is decided only with ≥ 3 paired seeds, nonzero variance
and a 95% interval excluding 0; otherwise the report says why it is undecided.

**Against the practitioners' table** (:data:`TABLE`): each row names the methods it recommends and
the metric they aim at; ``practitioners_table`` in the study file maps rows to situations. A row
*agrees* when a recommended method has the best mean (an exact tie too, whatever the order) or is not decidedly below the best (its
interval against the best contains 0), *disagrees* when every recommended method is decidedly below
the best, and is *undecided* when neither can be said (too few seeds, zero variance). A row no
situation of the run tests is listed as not measured.

**Private weightings** (an algorithm's ``weighting: [samples, bucketed, noisy]`` in the grid): each bucketed or noisy
variant against its twin with the same settings weighted by exact sizes, every metric, paired by seed
(``weightings.csv`` and a report section): what keeping the client sizes private costs.

Outputs: ``runs.csv`` (one row per run and method), ``report.csv`` (situation × method),
``situations.csv`` (G², B² and the winners), ``table_check.csv``, ``weightings.csv`` and ``report.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from pipeline.schema import Mapping
from pipeline.studies.grid.kind import register_grid_kind
from pipeline.studies.toolbox_runs import BASELINE, HEADERS, METRICS, meter_rows, paired, run_rows
from pipeline.studies.toolbox_weightings import weighting_lines, weighting_pairs, weighting_table
from utils.errors import TaskHetError
from utils.run_dir import atomic_write_text
from utils.statistics import NONNEGATIVE, UNIT, PairedDifference, mean_interval


@dataclass(frozen=True)
class Row:
    """A row of the practitioners' table: the situation it describes, what it recommends, for which metric."""

    situation: str
    recommended: tuple[str, ...]  # algorithm names (``fedavg+ft``: local fine-tuning)
    metric: str  # a key of METRICS

    @property
    def text(self) -> str:
        return f"{self.situation} → {' or '.join(self.recommended)}"


# The practitioners' table (issue 22). Global-model remedies are judged on the global model, personalisation
# remedies on the accuracy each client gets from the model the method gives it.
TABLE = {
    "mild": Row("mild skew", ("fedavg",), "global"),
    "moderate": Row("moderate skew", ("fedprox", "scaffold"), "global"),
    "groups": Row("distinct groups", ("ifca", "cfl"), "personal"),
    "personal": Row("personal needs", ("pfedme", "fedavg+ft"), "personal"),
    "transfer": Row("transfer", ("fedper",), "personal"),
    "severe": Row("severe skew", ("fedem",), "personal"),
    "unequal": Row("unequal local work", ("fednova",), "global"),
}


@dataclass(frozen=True)
class Winner:
    """The best mean of a metric in one situation, against FedAvg and the runner-up (None: no paired seed or no
    such method)."""

    method: str
    mean: float
    vs_baseline: PairedDifference | None
    runner_up: str | None
    vs_runner_up: PairedDifference | None
    baseline: str | None


def method_means(runs: pd.DataFrame, column: str) -> pd.Series:
    """Mean over seeds per method, highest first (ties keep the runs' order); methods without a value left out."""
    means = runs.groupby("method", sort=False)[column].mean().dropna()
    return means.iloc[sorted(range(len(means)), key=lambda index: -means.iloc[index])]


def winner(runs: pd.DataFrame, column: str) -> Winner | None:
    """The winner of ``column`` among one situation's ``runs`` (None when no method has a value)."""
    means = method_means(runs, column)
    if means.empty:
        return None
    best = means.index[0]
    baseline = next((method for method in runs.method.unique() if method.split("-")[0] == BASELINE
                     and runs[runs.method == method].algorithm.iloc[0] == BASELINE), None)
    runner_up = means.index[1] if len(means) > 1 else None
    return Winner(best, float(means.iloc[0]),
                  paired(runs, baseline, best, column) if baseline and baseline != best else None,
                  runner_up, paired(runs, runner_up, best, column) if runner_up else None, baseline)


@dataclass(frozen=True)
class Verdict:
    """How one row of the practitioners' table fares in one situation."""

    outcome: str  # agrees | disagrees | undecided | not measured
    detail: str


def table_verdict(runs: pd.DataFrame, row: Row) -> Verdict:
    """The row's recommendation against one situation's ``runs`` on the row's metric (see the module doc)."""
    column = row.metric
    means = method_means(runs, column)
    recommended = [method for method in means.index
                   if runs[runs.method == method].algorithm.iloc[0] in row.recommended]
    if not recommended:
        return Verdict("not measured", f"none of {', '.join(row.recommended)} ran in this situation")
    best = means.index[0]
    # A recommended method with the best mean agrees however the runs are ordered (an exact tie has no interval).
    top = next((method for method in recommended if means[method] == means.iloc[0]), None)
    if top is not None:
        return Verdict("agrees", f"{top} has the best mean {_pct(means[top])}")
    tied, untestable, below = [], [], []
    for method in recommended:
        difference = paired(runs, method, best, column)  # best − recommended
        text = f"{method} {_pct(means[method])}, best − it: {_difference(difference)}"
        if difference is None or not difference.testable:
            untestable.append(text)
        elif difference.decided:
            below.append(text)
        else:
            tied.append(text)
    if tied:
        return Verdict("agrees", f"not decidedly below the best, {best} {_pct(means[best])}: {'; '.join(tied)}")
    if untestable:
        return Verdict("undecided", f"best {best} {_pct(means[best])}; {'; '.join(untestable + below)}")
    return Verdict("disagrees", f"{best} {_pct(means[best])} is decidedly better: {'; '.join(below)}")


# ----- tables -----
def report_table(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per situation × method: mean and 95% interval over seeds of each metric."""
    rows = []
    for (situation, method), group in runs.groupby(["situation", "method"], sort=False):
        row = {"situation": situation, "method": method, "algorithm": group.algorithm.iloc[0], "n_seeds": len(group),
               "seeds": " ".join(str(seed) for seed in sorted(group.seed))}
        for column in METRICS:
            row.update(_interval(group[column].dropna().tolist(), column, UNIT))
        rows.append(row)
    return pd.DataFrame(rows)


def situation_table(runs: pd.DataFrame, meters: pd.DataFrame) -> pd.DataFrame:
    """One row per situation: G², B² (mean and interval over seeds) and each metric's winner against FedAvg."""
    rows = []
    for situation, group in runs.groupby("situation", sort=False):
        row = {"situation": situation}
        measured = meters[meters.situation == situation]
        for column in ("g2", "b2"):
            row.update(_interval(measured[column].tolist(), column, NONNEGATIVE))
        for column in METRICS:
            found = winner(group, column)
            difference = found.vs_baseline if found else None
            row.update({f"{column}_winner": found.method if found else None,
                        f"{column}_winner_mean": found.mean if found else math.nan,
                        f"{column}_vs_fedavg_mean": difference.mean if difference else math.nan,
                        f"{column}_vs_fedavg_low": difference.low if difference else math.nan,
                        f"{column}_vs_fedavg_high": difference.high if difference else math.nan,
                        f"{column}_vs_fedavg": _verdict(found, difference)})
        rows.append(row)
    return pd.DataFrame(rows)


def table_check(runs: pd.DataFrame, mapping: dict[str, str]) -> pd.DataFrame:
    """Every row of :data:`TABLE`: the situation that tests it (``mapping``), the verdict and its detail."""
    rows = []
    for key, row in TABLE.items():
        situation = mapping.get(key)
        if situation is None or situation not in set(runs.situation):
            verdict = Verdict("not measured", "no situation of this run tests this row (practitioners_table)")
        else:
            verdict = table_verdict(runs[runs.situation == situation], row)
        rows.append({"row": key, "recommendation": row.text, "metric": row.metric, "situation": situation or "",
                     "outcome": verdict.outcome, "detail": verdict.detail})
    return pd.DataFrame(rows)


# ----- text -----
def _interval(values: list[float], column: str, scale: str) -> dict[str, float]:
    mean, low, high = mean_interval(values, scale) if values else (math.nan, math.nan, math.nan)
    return {f"{column}_mean": mean, f"{column}_low": low, f"{column}_high": high}


def _pct(value: float) -> str:
    return "–" if math.isnan(value) else f"{100 * value:.1f}%"


def _difference(difference: PairedDifference | None) -> str:
    if difference is None:
        return "no paired seed"
    interval = "" if math.isnan(difference.low) else f" [{100 * difference.low:+.1f}, {100 * difference.high:+.1f}]"
    return f"{100 * difference.mean:+.1f} pts{interval}, {difference.explain()}"


def _verdict(found: Winner | None, difference: PairedDifference | None) -> str:
    if found is None:
        return "no values"
    if found.baseline is None:
        return "no fedavg runs"
    if found.method == found.baseline:
        return "fedavg itself"
    if difference is None:
        return "no paired seed"
    return ("better than fedavg" if difference.sign > 0 else "worse than fedavg" if difference.sign < 0
            else difference.explain())


def _cell(row: pd.Series, column: str, scale: float = 100.0, digits: int = 1) -> str:
    mean, low, high = (row[f"{column}_{part}"] for part in ("mean", "low", "high"))
    if math.isnan(mean):
        return "–"
    text = f"{scale * mean:.{digits}f}"
    return text if math.isnan(low) else f"{text} [{scale * low:.{digits}f}, {scale * high:.{digits}f}]"


def winner_lines(runs: pd.DataFrame) -> list[str]:
    """Per metric: the winner, its difference against FedAvg and against the runner-up."""
    lines = []
    for column, what in METRICS.items():
        found = winner(runs, column)
        if found is None:
            continue
        text = f"- {what}: **{found.method}** ({_pct(found.mean)})"
        if found.baseline is None:
            text += "; no fedavg runs to compare with"
        elif found.method == found.baseline:
            text += " is fedavg itself"
        else:
            text += f"; − fedavg: {_difference(found.vs_baseline)}"
        if found.runner_up is not None:
            text += f"; − runner-up {found.runner_up}: {_difference(found.vs_runner_up)}"
        lines.append(text + ".")
    return lines


def situation_options(config: dict[str, Any]) -> dict[str, str]:
    """Each situation's step-3b options as the study file gives them, and its unequal local work (step 4's)."""
    options = {}
    for block in config["grid"]:
        for partition in block["partitions"]:
            parts = [f"scheme {partition.scheme}"] + [f"{name} {value}" for name, value in partition.params]
            parts += [f"step 4's {name} {value}" for name, value in partition.work]  # unequal local work
            if partition.class_groups:
                parts.append("class groups " + " / ".join(",".join(map(str, group)) for group in partition.class_groups))
            options[partition.label] = "; ".join(parts)
    return options


def report_lines(config: dict[str, Any], command: str, runs: pd.DataFrame, table: pd.DataFrame,
                 situations: pd.DataFrame, check: pd.DataFrame, weightings: pd.DataFrame) -> list[str]:
    federated = config["federated"]
    counts = check.outcome.value_counts()
    lines = [f"# {config['name']}: which method for which heterogeneity", "", f"Command: `{command}`", "",
             f"Data {config['data']['source']}, task {config['task']}, {config['model']['encoder']} at "
             f"{config['model']['image_size']} px from scratch; {federated['n_clients']} clients, "
             f"{100 * federated['client_fraction']:g}% per round, rounds × J = {federated['rounds_x_local_steps']}, "
             f"{100 * federated['client_test_fraction']:g}% of each client's rows held out as its test set, "
             f"local fine-tuning {federated['finetune_steps']} steps; seeds {', '.join(map(str, config['seeds']))}. "
             "Accuracies are top-1 in % at the final round, mean [95% interval, t on the logit scale] over seeds; "
             "differences are paired by seed, in points, and decided only with ≥ 3 paired seeds, nonzero variance "
             "and an interval excluding 0 (utils/statistics.py). Every method gets the same rounds × J local steps, "
             "not the same gradient evaluations: a pFedMe step takes its inner_steps gradients, FedEM trains its M "
             "components, IFCA evaluates its k models on each sampled client.", "",
             "## Summary (computed)", "",
             f"- Situations run: {', '.join(situations.situation)}.",
             f"- Against the practitioners' table: {counts.get('agrees', 0)} rows agree, "
             f"{counts.get('disagrees', 0)} disagree, {counts.get('undecided', 0)} undecided, "
             f"{counts.get('not measured', 0)} not measured."]
    for _, row in situations.iterrows():
        unseen = ("" if row.unseen_vs_fedavg == "no values"
                  else f", best on unseen clients {row.unseen_winner} ({row.unseen_vs_fedavg})")
        lines.append(f"- {row.situation}: G² {_cell(row, 'g2', 1.0, 3)}; best personalised accuracy "
                     f"{row.personal_winner} ({row.personal_vs_fedavg}), best global accuracy {row.global_winner} "
                     f"({row.global_vs_fedavg}){unseen}.")
    lines += ["", "## Against the practitioners' table", "",
              "| row | situation | metric | outcome | detail |", "|---|---|---|---|---|"]
    for _, row in check.iterrows():
        lines.append(f"| {row.recommendation} | {row.situation or '–'} | {METRICS[row.metric]} | **{row.outcome}** | "
                     f"{row.detail} |")
    options = situation_options(config)
    lines += ["", "## Situations", "", "| situation | options | G² at the start | B² |", "|---|---|---|---|"]
    for _, row in situations.iterrows():
        lines.append(f"| {row.situation} | {options.get(row.situation, '')} | {_cell(row, 'g2', 1.0, 3)} | "
                     f"{_cell(row, 'b2', 1.0, 2)} |")
    lines += ["", "G² = Σ p_k‖∇F_k − ∇F‖² and B² = Σ p_k‖∇F_k‖²/‖∇F‖² of the situation's clients at the seed's "
              "centralized model (step 3c), mean [95% interval, log scale] over seeds."]
    shown = [column for column in METRICS if column != "unseen" or runs.unseen.notna().any()]
    for situation, group in runs.groupby("situation", sort=False):
        lines += ["", f"## {situation}", "", *winner_lines(group), "",
                  "| method | " + " | ".join(HEADERS[column] for column in shown) + " | seeds |",
                  "|---|" + "---|" * len(shown) + "---|"]
        for _, row in table[table.situation == situation].iterrows():
            lines.append(f"| {row.method} | " + " | ".join(_cell(row, column) for column in shown) + f" | {row.seeds} |")
    if "unseen" in shown:
        lines += ["", "Personalised and worst 10% are over the seen clients (those that trained); unseen clients never "
                  "trained or sent an update (step 3b's unseen_fraction) and are scored on their test rows after the "
                  "method's own adaptation of the final model (its personalisation step, or local fine-tuning for "
                  "fedavg+ft; the global model for methods without one)."]
    return lines + weighting_lines(weightings)


def write_report(config: dict[str, Any], out_dir: Path, run_dirs: dict, centralized: dict[int, Path], command: str,
                 meters: dict | None = None) -> pd.DataFrame:
    """Collect every run and step 3c reading; write runs.csv, report.csv, situations.csv, table_check.csv and
    report.md; returns the report table."""
    runs = pd.DataFrame([row for run, run_dir in run_dirs.items() for row in run_rows(run, run_dir)])
    runs.to_csv(out_dir / "runs.csv", index=False)
    table = report_table(runs)
    table.to_csv(out_dir / "report.csv", index=False)
    situations = situation_table(runs, meter_rows(meters or {}))
    situations.to_csv(out_dir / "situations.csv", index=False)
    check = table_check(runs, config["practitioners_table"])
    check.to_csv(out_dir / "table_check.csv", index=False)
    weightings = weighting_table(runs, weighting_pairs(config))
    weightings.to_csv(out_dir / "weightings.csv", index=False)
    atomic_write_text(out_dir / "report.md",
                      "\n".join(report_lines(config, command, runs, table, situations, check, weightings)) + "\n")
    return table


def validate_practitioners_table(config: dict[str, Any], source: Path) -> None:
    """``practitioners_table``: rows of :data:`TABLE`, each naming a situation of the grid."""
    situations = {partition.situation for block in config["grid"] for partition in block["partitions"]}
    for row, situation in config["practitioners_table"].items():
        if row not in TABLE:
            raise TaskHetError(f"{source}: practitioners_table.{row}: not a row of the practitioners' table; rows: "
                               f"{', '.join(TABLE)}")
        if situation not in situations:
            named = ", ".join(sorted(name for name in situations if name)) or "none (give partitions a situation name)"
            raise TaskHetError(f"{source}: practitioners_table.{row}: {situation!r} is not a situation of the grid; "
                               f"situations: {named}")


register_grid_kind(
    "heterogeneity_toolbox", "which method for which heterogeneity: named situations × personalised, clustered and "
    "multi-task methods, checked against the practitioners' table", write_report,
    report_unit="situation × method rows",
    extra_schema={"practitioners_table": {}},  # table row -> the situation that tests it (TABLE)
    extra_types={"practitioners_table": Mapping("map rows of the practitioners' table to situation names",
                                                "{mild: mild_label_skew, severe: severe_label_skew}", allow_empty=True)},
    extra_help={"practitioners_table": "which situation of the grid tests each row of the practitioners' table "
                                       "(mild, moderate, groups, personal, transfer, severe); a row left out is "
                                       "reported as not measured"},
    extra_checks=(validate_practitioners_table,), free_form=frozenset({"practitioners_table"}), reads_meters=True)
