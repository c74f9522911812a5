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
* **verdict**: *reproduced* when the change is decided above 0, *not reproduced* when it is decided below 0
  (label-based partitions give the larger loss), *undecided* otherwise, with the reason; the paper's size,
  where it gives one, is set beside TaskHet's.
* **iid check**: the same algorithm on an iid partition ends within 10% of the centralized model's loss
  (pipeline/studies/main_job/iid.py), i.e. the runs trained enough to compare partitions.

Algorithms whose result is their clients' own models (``result_is_personal``: FedRep) are read from those
models and counted apart from the global models. A control task (``class_scene``: the label-based groups
are the task's own labels, so a label-based split is harder by construction) has its rows but never enters
the headline counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from partitioning.groupings import EMBEDDING_BASED, LABEL_BASED
from utils.statistics import PairedDifference, paired_difference

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
# Tasks whose label-based groups are the task's own labels: a control, never counted in the headline.
CONTROLS = {"class_scene": "control: the labels are the task"}
REPRODUCED, NOT_REPRODUCED, UNDECIDED = "reproduced", "not reproduced", "undecided"
GROWS, SHRINKS = "grows as α falls", "shrinks as α falls"
PAPER_COLUMNS = ["task", "algorithm", "model", "role", "paper_change", "n_seeds", "n_alphas", "change_percent",
                 "change_low", "change_high", "change_p", "trend_pp_per_decade", "trend_low", "trend_high", "trend_p",
                 "trend", "verdict", "reason", "iid_check"]


def relative_changes(results: pd.DataFrame) -> pd.DataFrame:
    """Per task × algorithm × seed × α run under both groupings: ``change`` = 100·(embedding − label)/label of the
    final loss (``results``: the report's finals with each run's result, pipeline/studies/main_job/report.py)."""
    paired = results[results.grouping.isin([LABEL_BASED, EMBEDDING_BASED])]
    sides = paired.pivot_table(index=["task", "algorithm", "seed", "alpha"], columns="grouping", values="loss")
    sides = sides.dropna(subset=[column for column in (LABEL_BASED, EMBEDDING_BASED) if column in sides])
    if sides.empty or LABEL_BASED not in sides or EMBEDDING_BASED not in sides:
        return pd.DataFrame(columns=["task", "algorithm", "seed", "alpha", "change"])
    change = 100.0 * (sides[EMBEDDING_BASED] - sides[LABEL_BASED]) / sides[LABEL_BASED]
    return change.rename("change").reset_index()


def seed_changes(changes: pd.DataFrame) -> pd.DataFrame:
    """Per seed of one task × algorithm: its mean change over α and its slope against log10 α (NaN with one α)."""
    rows = []
    for seed, group in changes.groupby("seed"):
        logs = np.log10(group.alpha.to_numpy(dtype=float))
        slope = float(np.polyfit(logs, group.change.to_numpy(dtype=float), 1)[0]) if np.unique(logs).size > 1 else np.nan
        rows.append({"seed": seed, "mean": float(group.change.mean()), "slope": slope, "n_alphas": group.alpha.nunique()})
    return pd.DataFrame(rows, columns=["seed", "mean", "slope", "n_alphas"])


def one_sample(values: list[float]) -> PairedDifference | None:
    """The mean of ``values`` with its 95% t interval and decision (``utils.statistics.paired_difference`` against 0);
    None without values."""
    return paired_difference([0.0] * len(values), values) if values else None


def paper_table(results: pd.DataFrame, iid: pd.DataFrame) -> pd.DataFrame:
    """One row per task × algorithm (:data:`PAPER_COLUMNS`), from the report's finals with each run's result
    (``results``) and the iid reference table (``iid``)."""
    changes = relative_changes(results)
    personal = set(results.loc[results.get("model", pd.Series("global", index=results.index)) == "personal", "algorithm"])
    rows = []
    for (task, algorithm), group in changes.groupby(["task", "algorithm"], sort=True):
        per_seed = seed_changes(group)
        change, trend = one_sample(per_seed["mean"].tolist()), one_sample(per_seed["slope"].dropna().tolist())
        slope = (np.nan,) * 4 if trend is None else (trend.mean, trend.low, trend.high, trend.p_value)
        claim = PAPER_CLAIMS.get(task)
        verdict, reason = decide(change, claim)
        rows.append({"task": task, "algorithm": algorithm, "model": "personal" if algorithm in personal else "global",
                     "role": CONTROLS.get(task, "headline"), "paper_change": claim.text if claim else NOT_GIVEN,
                     "n_seeds": change.n, "n_alphas": int(group.alpha.nunique()), "change_percent": change.mean,
                     "change_low": change.low, "change_high": change.high, "change_p": change.p_value,
                     **dict(zip(("trend_pp_per_decade", "trend_low", "trend_high", "trend_p"), slope)),
                     "trend": trend_text(trend, int(group.alpha.nunique())),
                     "verdict": verdict, "reason": reason, "iid_check": iid_check(iid, task, algorithm)})
    return pd.DataFrame(rows, columns=PAPER_COLUMNS)


def decide(change: PairedDifference, claim: PaperClaim | None) -> tuple[str, str]:
    """The verdict on the paper's direction and why, with the paper's size beside TaskHet's where it gives one."""
    measured = f"{change.mean:+.1f}%" + ("" if np.isnan(change.low) else f" [{change.low:+.1f}%, {change.high:+.1f}%]")
    if change.sign == 0:
        return UNDECIDED, f"{measured}: {change.explain()}"
    if change.sign < 0:
        return NOT_REPRODUCED, f"{measured}: label-based partitions give the larger loss"
    size = ""
    if claim is not None and claim.size_percent is not None:
        relation = ("below" if change.high < claim.size_percent else
                    "above" if change.low > claim.size_percent else "consistent with")
        size = f"; its size is {relation} the paper's {claim.text}"
    return REPRODUCED, f"{measured}: embedding-based partitions give the larger loss{size}"


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


def headline_counts(table: pd.DataFrame, model: str) -> dict[str, int]:
    """Verdict counts over the headline rows (controls left out) of one kind of model ("global" | "personal")."""
    rows = table[(table.role == "headline") & (table.model == model)]
    counts = {verdict: int((rows.verdict == verdict).sum()) for verdict in (REPRODUCED, NOT_REPRODUCED, UNDECIDED)}
    return {"rows": len(rows), **counts}


def headline_sentence(table: pd.DataFrame) -> str:
    """The report's first sentence: how many task × algorithm rows reproduce the paper, global and personal apart."""
    parts = []
    for model, what in (("global", "global models"), ("personal", "clients' own models (FedRep)")):
        counts = headline_counts(table, model)
        if counts["rows"]:
            parts.append(f"{what}: {counts[REPRODUCED]} of {counts['rows']} task × algorithm rows reproduced, "
                         f"{counts[NOT_REPRODUCED]} not reproduced, {counts[UNDECIDED]} undecided")
    controls = sorted(set(table[table.role != "headline"].task))
    control = f" ({', '.join(controls)} is a control and not counted)" if controls else ""
    return ("Does an embedding-based partition give a larger federated loss than a label-based one at equal α "
            f"({PAPER})? " + "; ".join(parts) + control + ".")


def paper_markdown(table: pd.DataFrame) -> str:
    """The table as GitHub Markdown (one row per task × algorithm; controls marked)."""
    lines = ["| task | algorithm | paper | TaskHet: embedding vs label [95% CI] | trend in α | verdict | iid check |",
             "|" + "---|" * 7]
    for row in table.itertuples():
        interval = "" if np.isnan(row.change_low) else f" [{row.change_low:+.1f}%, {row.change_high:+.1f}%]"
        algorithm = row.algorithm + (" (own models)" if row.model == "personal" else "")
        task = row.task + ("" if row.role == "headline" else f" ({row.role})")
        lines.append(f"| {task} | {algorithm} | {row.paper_change} | {row.change_percent:+.1f}%{interval} "
                     f"| {row.trend} | {row.verdict} | {row.iid_check} |")
    return "\n".join(lines)

