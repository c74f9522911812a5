"""The heterogeneity study's private weightings against exact sizes: each ``bucketed`` or ``noisy`` variant of the grid
paired by seed with its twin weighted by ``samples`` (``weightings.csv`` and a section of report.md)."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from pipeline.studies.toolbox_runs import FINETUNED_SUFFIX, METRICS, paired

PRIVATE_WEIGHTINGS = ("bucketed", "noisy")  # network/aggregation.py: the exact client size never leaves the client
# What a private variant and its samples twin may differ in: the weighting, and the settings only a private
# weighting reads (they change nothing under samples weighting).
WEIGHTING_SETTINGS = ("weighting", "buckets", "noise_scale")


def _twin_key(variant) -> tuple:
    """A variant's algorithm and every setting but :data:`WEIGHTING_SETTINGS`: equal for a variant and its twin."""
    return variant.algorithm, tuple(sorted((name, str(value)) for name, value in variant.settings
                                           if name not in WEIGHTING_SETTINGS))


def weighting_pairs(config: dict[str, Any]) -> list[tuple[str, str]]:
    """``(private variant, its samples twin)`` labels: each variant weighted ``bucketed`` or ``noisy`` and the variant of
    its block with the same algorithm and settings weighted by samples (named, or by default). A private variant
    without such a twin is left out: there is nothing to pair it with."""
    pairs = []
    for block in config["grid"]:
        samples = {_twin_key(variant): variant.label for variant in block["variants"]
                   if dict(variant.settings).get("weighting", "samples") == "samples"}
        for variant in block["variants"]:
            twin = samples.get(_twin_key(variant))
            if dict(variant.settings).get("weighting") in PRIVATE_WEIGHTINGS and twin is not None:
                pairs.append((variant.label, twin))
    return list(dict.fromkeys(pairs))


def weighting_table(runs: pd.DataFrame, pairs: list[tuple[str, str]]) -> pd.DataFrame:
    """Per situation and pair (local fine-tuning's ``+ft`` twins too): private − samples of every metric, paired by
    seed, in accuracy points (mean, 95% interval, verdict)."""
    rows = []
    for situation, group in runs.groupby("situation", sort=False):
        methods = set(group.method)
        for private, reference in pairs:
            for suffix in ("", FINETUNED_SUFFIX):
                if private + suffix not in methods or reference + suffix not in methods:
                    continue
                row = {"situation": situation, "method": private + suffix, "against": reference + suffix}
                for column in METRICS:
                    difference = paired(group, reference + suffix, private + suffix, column)
                    row.update({f"{column}_mean": difference.mean if difference else math.nan,
                                f"{column}_low": difference.low if difference else math.nan,
                                f"{column}_high": difference.high if difference else math.nan,
                                f"{column}_verdict": difference.explain() if difference else "no paired seed"})
                rows.append(row)
    columns = ["situation", "method", "against"] + [f"{column}_{part}" for column in METRICS
                                                    for part in ("mean", "low", "high", "verdict")]
    return pd.DataFrame(rows, columns=columns)


def weighting_lines(weightings: pd.DataFrame) -> list[str]:
    """The report's section on the private weightings (none when the grid pairs none)."""
    if weightings.empty:
        return []
    lines = ["", "## Private weightings against samples", "",
             "What hiding the exact client sizes costs: each bucketed or noisy variant minus the same method weighted by "
             "exact sizes, paired by seed, in accuracy points at the final round [95% t interval] (utils/statistics.py).",
             "", "| situation | method | against | " + " | ".join(METRICS.values()) + " |",
             "|---|---|---|" + "---|" * len(METRICS)]
    for _, row in weightings.iterrows():
        cells = []
        for column in METRICS:
            mean, low, high = (row[f"{column}_{part}"] for part in ("mean", "low", "high"))
            if math.isnan(mean):
                cells.append("–")
                continue
            interval = "" if math.isnan(low) else f" [{100 * low:+.1f}, {100 * high:+.1f}]"
            decided = "" if row[f"{column}_verdict"] != "decided" else " **decided**"
            cells.append(f"{100 * mean:+.1f}{interval}{decided}")
        lines.append(f"| {row.situation} | {row.method} | {row.against} | {' | '.join(cells)} |")
    return lines
