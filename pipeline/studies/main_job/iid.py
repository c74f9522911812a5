"""The iid reference's part of the report: is each federated model trained enough to be compared?

Input ``finals`` (pipeline/studies/main_job/report.py's table of final losses). Its rows of grouping ``iid`` are the
same algorithms and seeds run on an iid partition of the same clients. Without heterogeneity a
federated model that has converged ends near the centralized model, so the gap between the two
says how far training stopped short; a label-vs-embedding gap measured on models that stopped
early mixes heterogeneity with under-training.

Per task × algorithm: the mean final test loss over seeds with its 95% t interval on the log
scale (utils/statistics.py), and how far above the centralized model's test loss it ends, in %,
with the same interval divided by the centralized loss (which is one model, so it has none).
The criterion is "within 10%", on both sides: it **holds** when the mean is at most 10% above and at
most 10% below the centralized loss; the table says besides whether the whole interval is within
(*yes*) or only the mean (*mean only*). It fails two ways: more than 10% above (*no*: the federated
runs stopped short), or more than 10% below (*reference under-trained*: without heterogeneity the
federated model should not beat the centralized one by that much, so the centralized model stopped short,
and the check cannot say whether the federated runs trained enough). Both edges count as within: 10%
above and 10% below hold. Percentages are compared after rounding to :data:`PERCENT_DIGITS` decimals of a
percentage point, so float rounding never decides an edge (a loss of 1.1 against 1.0 computes as
10.000000000000009% above, and holds). Algorithms whose result is the clients' own models
(``result_is_personal``: FedRep's global head is never trained) are evaluated on each client's own test
split, not the global test split, so they are listed but not compared with the centralized loss.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from partitioning.groupings import IID_REFERENCE
from utils.statistics import NONNEGATIVE, mean_interval

WITHIN = 10.0  # % above or below the centralized loss that counts as "trained enough" under the iid partition
PERCENT_DIGITS = 9  # percentages are compared rounded to 1e-9 percentage points
YES, MEAN_ONLY, NO, NOT_COMPARED = "yes", "mean only", "no", "not compared"
UNDER_TRAINED = "reference under-trained"  # more than WITHIN % below the centralized loss
IID_COLUMNS = ["task", "algorithm", "iid_loss_mean", "iid_loss_ci_low", "iid_loss_ci_high", "centralized_loss",
               "above_centralized_percent", "above_ci_low", "above_ci_high", "within_10_percent", "converged",
               "n_seeds"]


def iid_table(finals: pd.DataFrame, centralized: dict[str, float]) -> pd.DataFrame:
    """Per task × algorithm of the iid runs: final loss with its 95% interval and its distance to the centralized loss."""
    iid = finals[finals.grouping == IID_REFERENCE]
    rows = [_row(task, algorithm, group, float(centralized.get(task, np.nan)))
            for (task, algorithm), group in iid.groupby(["task", "algorithm"])]
    return pd.DataFrame(rows, columns=IID_COLUMNS)


def _row(task: str, algorithm: str, group: pd.DataFrame, reference: float) -> dict:
    mean, low, high = mean_interval(list(group.loss), NONNEGATIVE)
    personal = bool(group.get("result_is_personal", pd.Series(False, index=group.index)).any())
    comparable = not personal and np.isfinite(reference) and reference > 0
    above, above_low, above_high = ((100.0 * (value / reference - 1.0) for value in (mean, low, high))
                                    if comparable else (np.nan, np.nan, np.nan))
    verdict = converged_verdict(above, above_low, above_high) if comparable else NOT_COMPARED
    return {"task": task, "algorithm": algorithm, "iid_loss_mean": mean, "iid_loss_ci_low": low,
            "iid_loss_ci_high": high, "centralized_loss": reference, "above_centralized_percent": above,
            "above_ci_low": above_low, "above_ci_high": above_high,
            "within_10_percent": verdict in (YES, MEAN_ONLY), "converged": verdict, "n_seeds": group.seed.nunique()}


def converged_verdict(above: float, above_low: float, above_high: float) -> str:
    """The iid check of one task × algorithm from its % above the centralized loss (negative: below): the mean's,
    and its 95% interval's ends (NaN: no interval, one seed). *no*: the mean is more than 10% above; *reference
    under-trained*: more than 10% below; *yes*: the whole interval is within 10% on both sides, its ends included;
    *mean only*: the mean is within, the interval is not (or there is none)."""
    above, above_low, above_high = (round(value, PERCENT_DIGITS) for value in (above, above_low, above_high))
    if above > WITHIN:
        return NO
    if above < -WITHIN:
        return UNDER_TRAINED
    whole_interval = -WITHIN <= above_low and above_high <= WITHIN  # False without an interval: NaN compares False
    return YES if whole_interval else MEAN_ONLY


def iid_clause(iid: pd.DataFrame | None, task: str) -> str:
    """'; under the iid partition ... of the centralized loss' for one task's summary (empty without iid runs)."""
    if iid is None or iid.empty or task not in set(iid.task):
        return ""
    rows = iid[(iid.task == task) & (iid.converged != NOT_COMPARED)]
    if rows.empty:
        return ""
    far, under, loose = (rows[rows.converged == verdict] for verdict in (NO, UNDER_TRAINED, MEAN_ONLY))
    failures = []
    if not far.empty:
        failures.append(f"NOT within {WITHIN:.0f}% for {_algorithms(far)}")
    if not under.empty:
        failures.append(f"more than {WITHIN:.0f}% below it for {_algorithms(under)}: the centralized reference is "
                        "under-trained")
    status = "; ".join(failures) or f"all within {WITHIN:.0f}%"
    if not loose.empty:
        status += f"; the 95% interval reaches past {WITHIN:.0f}% for {', '.join(loose.algorithm)}"
    low, high = rows.above_centralized_percent.min(), rows.above_centralized_percent.max()
    span = f"{low:+.0f}%" if round(low) == round(high) else f"{low:+.0f}% to {high:+.0f}%"
    return f"; under the iid partition the federated loss is {span} off the centralized loss ({status})"


def _algorithms(rows: pd.DataFrame) -> str:
    return ", ".join(f"{row.algorithm} ({row.above_centralized_percent:+.0f}%)" for row in rows.itertuples())


def iid_markdown(iid: pd.DataFrame) -> str:
    lines = ["| task | algorithm | iid loss [95% CI] | centralized loss | above centralized [95% CI] | within 10% | seeds |",
             "|" + "---|" * 7]
    for row in iid.itertuples():
        loss = f"{row.iid_loss_mean:.4f} [{row.iid_loss_ci_low:.4f}, {row.iid_loss_ci_high:.4f}]"
        if row.converged == NOT_COMPARED:
            lines.append(f"| {row.task} | {row.algorithm} | {loss} (personal models, client-test splits) "
                         f"| {row.centralized_loss:.4f} | – | not compared | {row.n_seeds} |")
            continue
        verdict = {YES: "yes", MEAN_ONLY: "mean only", NO: "**no**", UNDER_TRAINED: f"**{UNDER_TRAINED}**"}[row.converged]
        lines.append(f"| {row.task} | {row.algorithm} | {loss} | {row.centralized_loss:.4f} "
                     f"| {row.above_centralized_percent:+.1f}% [{row.above_ci_low:+.1f}%, {row.above_ci_high:+.1f}%] "
                     f"| {verdict} | {row.n_seeds} |")
    return "\n".join(lines)


def iid_section(iid: pd.DataFrame) -> list[str]:
    """The report's "IID reference" section (no lines without iid runs)."""
    if iid.empty:
        return []
    compared = iid[iid.converged != NOT_COMPARED]
    failing = compared[~compared.within_10_percent.astype(bool)]
    under = compared[compared.converged == UNDER_TRAINED]
    verdict = (f"It holds for every compared task × algorithm ({len(compared)})." if failing.empty else
               f"It does **not** hold for {len(failing)} of {len(compared)}: "
               + ", ".join(f"{row.task} · {row.algorithm} ({row.above_centralized_percent:+.1f}%)"
                           for row in failing.itertuples()) + ".")
    if not under.empty:
        verdict += (f" For {', '.join(sorted(set(under.task)))} the federated loss ends more than {WITHIN:.0f}% *below* "
                    "the centralized one: the centralized reference is under-trained, so this check cannot say whether "
                    "the federated runs trained enough.")
    return ["## IID reference", "",
            f"The same algorithms on an iid partition: is the federated model trained enough to compare partitions? "
            f"The criterion: its mean final test loss over seeds ends within {WITHIN:.0f}% of the centralized "
            f"model's test loss, above or below (more than {WITHIN:.0f}% above: *no*; more than {WITHIN:.0f}% below: "
            f"*{UNDER_TRAINED}*). {verdict} *within 10%*: *yes* when the whole 95% interval (t, log scale, over seeds) is "
            f"within, *mean only* when only the mean is; the centralized loss is one model, without an interval. "
            "Algorithms whose result is the clients' own models (FedRep) are evaluated on the clients' own test splits, "
            "so they are not compared with the centralized loss.", "",
            iid_markdown(iid), ""]
