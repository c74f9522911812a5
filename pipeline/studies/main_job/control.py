"""The positive control: can this setup show a partition penalty at all?

The answer table asks whether embedding-based partitions raise the federated loss over label-based ones. An
undecided or small change there is only worth as much as the setup's power to show a penalty where one exists. The
control partitions the same data by quantile bins of each sample's mean target (``property_based``,
partitioning/property_bins.py) through the same Dirichlet mixture: clients then hold targets of different scale,
a skew the task's loss must feel. Per task × algorithm, the change 100·(property − label)/label is computed exactly
as the answer's (pipeline/studies/main_job/paper.py: paired by seed and α, each seed's mean over α, a 95% t interval
over seeds) and read as

* *detected*: decided above 0 (at least 3 seeds, nonzero variance, the interval above 0);
* *not detected*: anything else, with the reason;

``detected_after_bh`` applies Benjamini–Hochberg at 5% over the control's rows (a family apart from the answer's, so
adding the control changes none of the answer's adjusted verdicts). Where no row is detected the report says that
this setup cannot show a penalty of the control's size at its seeds.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from partitioning.groupings import PROPERTY_BASED
from pipeline.studies.main_job.paper import (detectable, detectable_text, one_sample, personal_algorithms,
                                             relative_changes, seed_changes)
from utils.statistics import adjusted_decided

DETECTED, NOT_DETECTED = "detected", "not detected"
CONTROL_COLUMNS = ["task", "algorithm", "model", "n_seeds", "n_alphas", "change_percent", "change_low", "change_high",
                   "change_p", "detectable_percent", "verdict", "reason", "detected_after_bh"]


def control_table(results: pd.DataFrame) -> pd.DataFrame:
    """One row per task × algorithm run under both label- and property-based partitions (:data:`CONTROL_COLUMNS`);
    empty where the experiment has no property-based runs. ``results``: the report's finals with each run's result."""
    changes = relative_changes(results, treatment=PROPERTY_BASED)
    personal = personal_algorithms(results)
    rows, differences = [], []
    for (task, algorithm), group in changes.groupby(["task", "algorithm"], sort=True):
        per_seed = seed_changes(group)["mean"].tolist()
        change = one_sample(per_seed)
        rows.append({"task": task, "algorithm": algorithm, "model": "personal" if algorithm in personal else "global",
                     "n_seeds": change.n, "n_alphas": int(group.alpha.nunique()), "change_percent": change.mean,
                     "change_low": change.low, "change_high": change.high, "change_p": change.p_value,
                     "detectable_percent": detectable(per_seed),
                     "verdict": DETECTED if change.sign > 0 else NOT_DETECTED,
                     "reason": "decided above 0" if change.sign > 0 else not_detected_reason(change)})
        differences.append(change)
    for row, keep in zip(rows, adjusted_decided(differences)):
        row["detected_after_bh"] = bool(keep and row["verdict"] == DETECTED)
    return pd.DataFrame(rows, columns=CONTROL_COLUMNS)


def not_detected_reason(change) -> str:
    """Why a control row is not detected: decided below 0, or why it is undecided."""
    if change.sign < 0:
        return "decided below 0: the label-based partitions give the larger loss"
    return change.explain().removeprefix("undecided: ")


def control_sentence(table: pd.DataFrame) -> str:
    """The answer section's line on the control: how many rows detected a penalty, and what that means."""
    if table.empty:
        return ""
    detected = int((table.verdict == DETECTED).sum())
    adjusted = int(table.detected_after_bh.sum())
    head = (f"Positive control (clients drawn from quantile bins of each sample's mean target instead of scene labels): "
            f"a penalty detected in {detected} of {len(table)} rows, {adjusted} after Benjamini–Hochberg over them.")
    if adjusted:
        return head + " The setup can show a partition penalty of the control's size at these seeds."
    largest = table.change_high.max()
    bound = "" if not np.isfinite(largest) else f" (the control's intervals reach at most {largest:+.1f}%)"
    return (head + f" This setup cannot show a partition penalty of the control's size at these seeds{bound}: an "
            "undecided answer row says nothing about a penalty below its detectable size.")


def control_markdown(table: pd.DataFrame) -> list[str]:
    """The report's "Positive control" section (no lines without property-based runs)."""
    if table.empty:
        return []
    lines = ["## Positive control", "",
             "The same data partitioned over quantile bins of each sample's mean target (as many bins as KMeans has "
             "clusters, through the same Dirichlet mixture and α), against the label-based partitions: clients then "
             "hold targets of different scale, a skew the loss must feel. *change*: 100·(property − label)/label of "
             "the final loss, paired by seed and α as in the answer table; *detected*: decided above 0; *after BH*: "
             "Benjamini–Hochberg at 5% over this table's rows; *detectable*: the smallest change detected with 80% "
             "power at these seeds, from their spread.", "", control_sentence(table), "",
             "| task | algorithm | property vs label [95% CI] | detectable (80% power) | verdict | after BH |",
             "|" + "---|" * 6]
    for row in table.itertuples():
        interval = "" if not np.isfinite(row.change_low) else f" [{row.change_low:+.1f}%, {row.change_high:+.1f}%]"
        algorithm = row.algorithm + (" (own models)" if row.model == "personal" else "")
        verdict = row.verdict + ("" if row.verdict == DETECTED else f" ({row.reason})")
        after = DETECTED if row.detected_after_bh else NOT_DETECTED
        lines.append(f"| {row.task} | {algorithm} | {row.change_percent:+.1f}%{interval} "
                     f"| {detectable_text(row.detectable_percent)} | {verdict} | {after} |")
    return lines + [""]
