"""The main job's answer to the paper, task by task: one row per task × algorithm.

The paper (Borazjani et al., arXiv 2503.14553) claims that splitting a dense task's data by its embedding
clusters gives a larger federated loss than splitting it by scene labels at equal Dirichlet α, up to about
60% larger for FedAvg on edges and about 5% on keypoints, and more so as α falls. Per task × algorithm:

* **change**: the relative change 100·(embedding − label)/label of the final loss, paired by seed and α
  (the same seed gives the same initial model and client sampling under both partitions). Each seed's
  change is its mean over the α values; the row's mean and 95% interval are over seeds (Student's t), so
  the interval counts seeds, not seed × α cells that share an initial model (utils/statistics.py: at least
  3 seeds, nonzero variance, an interval excluding 0, or the row is undecided and says why).
* **trend in α**: each seed's least-squares slope of its change against log10 α (percentage points per
  tenfold α); a decided negative slope means the change grows as α falls, as the paper says.
* **verdict**: weighs the paper's size (:data:`PAPER_CLAIMS`, in %) against the change's 95% interval
  [low, high] (:func:`verdict`):

  - *consistent with the paper*: decided above 0 and high ≥ the paper's size (an upper end exactly at the
    size reaches it); for a task the paper gives no size for, decided above 0 is enough;
  - *smaller than the paper's*: decided above 0 and high < the paper's size;
  - *no effect of the paper's size*: not decided, but measurable (at least 3 seeds and nonzero variance, so
    the interval exists; here it contains 0) and high < the paper's size;
  - *undecided*: not decided and either not measurable (too few seeds, zero variance) or the interval reaches
    the paper's size (high ≥ size) or the paper gives no size; ``reason`` says which;
  - *opposite*: decided below 0 (label-based partitions give the larger loss).

  ``decided_after_bh``: the row is decided and stays decided after Benjamini–Hochberg at 5% over all rows of
  the table (controls and did-not-learn rows included; an unmeasurable row enters with p = 1,
  ``utils.statistics.adjusted_decided``); ``verdict_after_bh`` applies the same rules with "decided" read as
  ``decided_after_bh``.
* **iid check**: the same algorithm on an iid partition ends within 10% of the centralized model's loss
  (pipeline/studies/main_job/iid.py), i.e. the runs trained enough to compare partitions.
* **detectable**: the smallest true change the row's test would detect with 80% power at its seeds, given the
  seed-to-seed spread of the changes measured (``utils.statistics.minimum_detectable_change``): the paper's +60%
  above it would have been seen; a change below it can hide in an undecided row.

Algorithms whose result is their clients' own models (``result_is_personal``: FedRep) are read from those
models and counted apart from the global models. A control task (``class_scene``: the label-based groups
are the task's own labels, so a label-based split is harder by construction) and a task that did not learn
(``paper_table``'s ``did_not_learn``) have their rows but never enter the headline counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from partitioning.groupings import EMBEDDING_BASED, LABEL_BASED
from utils.statistics import PairedDifference, adjusted_decided, minimum_detectable_change, paired_difference

PAPER = "arXiv 2503.14553"


@dataclass(frozen=True)
class PaperClaim:
    """What the paper reports for one task: its text for the table and, where it gives one, the size in %."""

    text: str
    size_percent: float | None = None


# What the paper reports for FedAvg (its headline: embedding-based heterogeneity raises the loss most on edges
# and least on keypoints); tasks not listed get no number from the paper.
PAPER_CLAIMS = {
    "edge_texture": PaperClaim("up to ≈ +60% (FedAvg)", 60.0),
    "edge_occlusion": PaperClaim("up to ≈ +60% (FedAvg, edges)", 60.0),
    "keypoints2d": PaperClaim("≈ +5% (FedAvg)", 5.0),
}
NOT_GIVEN = "larger (no number for this task)"
HEADLINE = "headline"
# Tasks whose label-based groups are the task's own labels: a control, never counted in the headline.
CONTROLS = {"class_scene": "control: the labels are the task"}
DID_NOT_LEARN = "did not learn"  # a row's role is "did not learn: <reason>" for a task in paper_table's did_not_learn
CONSISTENT, SMALLER, NO_EFFECT = "consistent with the paper", "smaller than the paper's", "no effect of the paper's size"
UNDECIDED, OPPOSITE = "undecided", "opposite"
VERDICTS = (CONSISTENT, SMALLER, NO_EFFECT, UNDECIDED, OPPOSITE)  # the order of the headline's counts
GROWS, SHRINKS = "grows as α falls", "shrinks as α falls"
PAPER_COLUMNS = ["task", "algorithm", "model", "role", "paper_change", "n_seeds", "n_alphas", "change_percent",
                 "change_low", "change_high", "change_p", "detectable_percent", "trend_pp_per_decade", "trend_low",
                 "trend_high", "trend_p",
                 "trend", "verdict", "reason", "decided_after_bh", "verdict_after_bh", "iid_check"]
# The rules in one paragraph, for the report beside the table.
VERDICT_NOTE = (
    "*verdict*, against the paper's size where it gives one and the 95% interval's upper end: consistent with the "
    "paper when the change is decided above 0 and the interval reaches the paper's size (its upper end at or above "
    "it; decided above 0 is enough where the paper gives no size), smaller than the paper's when decided above 0 and "
    "the interval ends below the size, no effect of the paper's size when the interval contains 0 and ends below "
    "the size (at least 3 seeds and nonzero variance), opposite when decided below 0, undecided otherwise (with the "
    "reason); *after BH*, where it differs: the same rules with only the rows still decided after "
    "Benjamini–Hochberg at 5% over the table's rows counted as decided. *detectable*: the smallest true change "
    "the row's test detects 4 times in 5 at its seeds, from the spread of its seeds' changes (noncentral t; – "
    "where no spread exists): a paper's size above it would have been seen, a change below it can hide in an "
    "undecided row.")


def relative_changes(results: pd.DataFrame, treatment: str = EMBEDDING_BASED) -> pd.DataFrame:
    """Per task × algorithm × seed × α run under both groupings: ``change`` = 100·(treatment − label)/label of the
    final loss (``results``: the report's finals with each run's result, pipeline/studies/main_job/report.py;
    ``treatment``: embedding_based, or property_based for the positive control)."""
    paired = results[results.grouping.isin([LABEL_BASED, treatment])]
    sides = paired.pivot_table(index=["task", "algorithm", "seed", "alpha"], columns="grouping", values="loss")
    sides = sides.dropna(subset=[column for column in (LABEL_BASED, treatment) if column in sides])
    if sides.empty or LABEL_BASED not in sides or treatment not in sides:
        return pd.DataFrame(columns=["task", "algorithm", "seed", "alpha", "change"])
    change = 100.0 * (sides[treatment] - sides[LABEL_BASED]) / sides[LABEL_BASED]
    return change.rename("change").reset_index()


def seed_changes(changes: pd.DataFrame) -> pd.DataFrame:
    """Per seed of one task × algorithm: its mean change over α and its slope against log10 α (NaN with one α)."""
    rows = []
    for seed, group in changes.groupby("seed"):
        logs = np.log10(group.alpha.to_numpy(dtype=float))
        slope = float(np.polyfit(logs, group.change.to_numpy(dtype=float), 1)[0]) if np.unique(logs).size > 1 else np.nan
        rows.append({"seed": seed, "mean": float(group.change.mean()), "slope": slope, "n_alphas": group.alpha.nunique()})
    return pd.DataFrame(rows, columns=["seed", "mean", "slope", "n_alphas"])


def personal_algorithms(results: pd.DataFrame) -> set[str]:
    """The algorithms whose rows in ``results`` are their clients' own models (``model`` "personal"; none without the
    column)."""
    return set(results.loc[results.get("model", pd.Series("global", index=results.index)) == "personal", "algorithm"])


def detectable(values: list[float]) -> float:
    """The smallest mean change detectable with 80% power over ``values`` (one per seed), from their spread."""
    spread = float(np.std(values, ddof=1)) if len(values) > 1 else float("nan")
    return minimum_detectable_change(spread, len(values))


def one_sample(values: list[float]) -> PairedDifference | None:
    """The mean of ``values`` with its 95% t interval and decision (``utils.statistics.paired_difference`` against 0);
    None without values."""
    return paired_difference([0.0] * len(values), values) if values else None


def paper_table(results: pd.DataFrame, iid: pd.DataFrame, did_not_learn: dict[str, str] | None = None) -> pd.DataFrame:
    """One row per task × algorithm (:data:`PAPER_COLUMNS`), from the report's finals with each run's result
    (``results``) and the iid reference table (``iid``). ``did_not_learn``: task -> why its runs did not learn;
    its rows get role "did not learn: <why>" (a control's too) and, like controls, stay out of the headline counts."""
    did_not_learn = did_not_learn or {}
    changes = relative_changes(results)
    personal = personal_algorithms(results)
    rows, differences = [], []
    for (task, algorithm), group in changes.groupby(["task", "algorithm"], sort=True):
        per_seed = seed_changes(group)
        change, trend = one_sample(per_seed["mean"].tolist()), one_sample(per_seed["slope"].dropna().tolist())
        slope = (np.nan,) * 4 if trend is None else (trend.mean, trend.low, trend.high, trend.p_value)
        claim = PAPER_CLAIMS.get(task)
        size = None if claim is None else claim.size_percent
        before = verdict(change.sign, change.testable, change.high, size)
        role = f"{DID_NOT_LEARN}: {did_not_learn[task]}" if task in did_not_learn else CONTROLS.get(task, HEADLINE)
        rows.append({"task": task, "algorithm": algorithm, "model": "personal" if algorithm in personal else "global",
                     "role": role, "paper_change": claim.text if claim else NOT_GIVEN,
                     "n_seeds": change.n, "n_alphas": int(group.alpha.nunique()), "change_percent": change.mean,
                     "change_low": change.low, "change_high": change.high, "change_p": change.p_value,
                     "detectable_percent": detectable(per_seed["mean"].tolist()),
                     **dict(zip(("trend_pp_per_decade", "trend_low", "trend_high", "trend_p"), slope)),
                     "trend": trend_text(trend, int(group.alpha.nunique())),
                     "verdict": before, "reason": verdict_reason(before, change, size),
                     "iid_check": iid_check(iid, task, algorithm)})
        differences.append((change, size))
    kept = adjusted_decided([change for change, _ in differences])
    for row, (change, size), keep in zip(rows, differences, kept):
        row["decided_after_bh"] = keep
        row["verdict_after_bh"] = verdict(change.sign if keep else 0, change.testable, change.high, size)
    return pd.DataFrame(rows, columns=PAPER_COLUMNS)


def verdict(sign: int, measurable: bool, high: float, size: float | None) -> str:
    """One of :data:`VERDICTS`: ``sign`` +1 / −1 for a change decided above / below 0, 0 when not decided;
    ``measurable``: at least 3 seeds and nonzero variance; ``high``: the 95% interval's upper end; ``size``: the
    paper's size in % (None: the paper gives none). An upper end exactly at the size reaches it."""
    if sign < 0:
        return OPPOSITE
    if sign > 0:
        return CONSISTENT if size is None or high >= size else SMALLER
    if measurable and size is not None and high < size:
        return NO_EFFECT
    return UNDECIDED


def verdict_reason(decision: str, change: PairedDifference, size: float | None) -> str:
    """Why ``change`` (not adjusted) got ``decision``: the rule that gave it, or why it is undecided."""
    paper = "" if size is None else f"the paper's {size:+g}%"
    if decision == OPPOSITE:
        return "decided below 0: label-based partitions give the larger loss"
    if decision == CONSISTENT:
        return "decided above 0; " + ("the paper gives no size for this task" if size is None else
                                      f"the interval reaches {paper}")
    if decision == SMALLER:
        return f"decided above 0; the interval ends below {paper}"
    if decision == NO_EFFECT:
        return f"the 95% interval contains 0 and ends below {paper}"
    if not change.testable:
        return change.explain().removeprefix("undecided: ")
    return "the 95% interval contains 0" + ("" if size is None else f" and reaches {paper}")


def trend_text(trend: PairedDifference | None, n_alphas: int) -> str:
    """How the change moves with α over seeds (a decided slope) or why that cannot be said."""
    if n_alphas < 2 or trend is None:
        return "one α: no trend"
    if trend.sign < 0:
        return GROWS
    if trend.sign > 0:
        return SHRINKS
    return f"undecided ({trend.explain().removeprefix('undecided: ')})"


def iid_check(iid: pd.DataFrame, task: str, algorithm: str) -> str:
    """The iid reference's verdict for one task × algorithm ("yes", "mean only", "no", "not compared"; "no iid runs")."""
    rows = iid[(iid.task == task) & (iid.algorithm == algorithm)] if not iid.empty else iid
    if rows.empty:
        return "no iid runs"
    row = rows.iloc[0]
    above = "" if np.isnan(row.above_centralized_percent) else f" ({row.above_centralized_percent:+.1f}%)"
    return f"{row.converged}{above}"


def headline_counts(table: pd.DataFrame, model: str) -> dict:
    """The verdicts of one kind of model's ("global" | "personal") headline rows (controls and did-not-learn rows
    left out): ``rows``, ``verdict`` and ``verdict_after_bh`` (each verdict of :data:`VERDICTS` -> its count) and
    ``bh_over``, how many rows the Benjamini–Hochberg adjustment ran over (all of ``table``'s, as
    :func:`paper_table` returned it)."""
    rows = table[(table.role == HEADLINE) & (table.model == model)]
    return {"rows": len(rows), "bh_over": len(table),
            "verdict": {name: int((rows.verdict == name).sum()) for name in VERDICTS},
            "verdict_after_bh": {name: int((rows.verdict_after_bh == name).sum()) for name in VERDICTS}}


def headline_sentence(table: pd.DataFrame) -> str:
    """The report's first lines: the question, then per kind of model the verdict counts of its headline rows and
    their Benjamini–Hochberg twins, and which tasks are not counted."""
    parts = []
    for model, what in (("global", "Global models"), ("personal", "Clients' own models (FedRep)")):
        counts = headline_counts(table, model)
        if counts["rows"]:
            before = ", ".join(f"{counts['verdict'][name]} {name}" for name in VERDICTS)
            after = ", ".join(str(counts["verdict_after_bh"][name]) for name in VERDICTS)
            parts.append(f"{what}, {rows_text(counts['rows'])}: {before}; after Benjamini–Hochberg over the table's "
                         f"{rows_text(counts['bh_over'])}: {after}.")
    if not parts:
        parts.append("No task × algorithm row is counted.")
    learned = table.role.str.startswith(DID_NOT_LEARN)
    controls = sorted(set(table[(table.role != HEADLINE) & ~learned].task))
    failed = sorted(set(table[learned].task))
    apart = []
    if controls:
        apart.append(f"{' and '.join(controls)} {'is a control' if len(controls) == 1 else 'are controls'} and not counted")
    if failed:
        apart.append(f"{' and '.join(failed)} did not learn and {'is' if len(failed) == 1 else 'are'} not counted")
    return " ".join([f"Does an embedding-based partition give a larger federated loss than a label-based one at equal "
                     f"α ({PAPER})?", *parts] + ([f"{'; '.join(apart)}."] if apart else []))


def detectable_text(percent: float) -> str:
    """``≥ 4.2%`` (a change of at least this size is detected 4 times in 5), or ``–`` where no spread exists."""
    return "–" if not np.isfinite(percent) else f"≥ {percent:.1f}%"


def rows_text(n: int) -> str:
    return f"{n} row" + ("" if n == 1 else "s")


def paper_markdown(table: pd.DataFrame) -> str:
    """The table as GitHub Markdown (one row per task × algorithm; controls and did-not-learn tasks marked). The
    verdict cell gives an undecided row's reason and, where it differs, the verdict after Benjamini–Hochberg."""
    lines = ["| task | algorithm | paper | TaskHet: embedding vs label [95% CI] | detectable (80% power) | trend in α "
             "| verdict | iid check |", "|" + "---|" * 8]
    for row in table.itertuples():
        interval = "" if np.isnan(row.change_low) else f" [{row.change_low:+.1f}%, {row.change_high:+.1f}%]"
        algorithm = row.algorithm + (" (own models)" if row.model == "personal" else "")
        # A did-not-learn task's reason is long and the same on each of its rows: the report's trivial-predictor
        # section gives it once, the table only marks the rows.
        role = row.role.split(":")[0] if row.role.startswith(DID_NOT_LEARN) else row.role
        task = row.task + ("" if row.role == HEADLINE else f" ({role})")
        decision = row.verdict + (f" ({row.reason})" if row.verdict == UNDECIDED else "")
        if row.verdict_after_bh != row.verdict:
            decision += f"; after BH: {row.verdict_after_bh}"
        lines.append(f"| {task} | {algorithm} | {row.paper_change} | {row.change_percent:+.1f}%{interval} "
                     f"| {detectable_text(row.detectable_percent)} | {row.trend} | {decision} | {row.iid_check} |")
    return "\n".join(lines)
