"""The mechanism study's report: the map's table from each setting's report files, Benjamini–Hochberg over the
map, the conclusion and control sentences, the losses behind the changes, report.md, report.csv, report_losses.csv,
mechanism.png and losses.png (mechanism.py runs the settings)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from pipeline.fingerprint import fingerprint_line
from pipeline.studies.main_job.paper import CONSISTENT, DID_NOT_LEARN, PAPER, PAPER_CLAIMS, SMALLER
from utils.loaders import read_csv
from utils.plots import legend_outside, plt, save_figure
from utils.run_dir import atomic_write_text
from utils.statistics import LEVEL

BASE_SETTING = "base"  # the knob and level names of the base setting
APPEARS = (CONSISTENT, SMALLER)  # decided above 0: the penalty is there, at the paper's size or below it
REPORT_COLUMNS = ["knob", "level", "setting", "task", "algorithm", "role", "paper_percent", "n_seeds", "change_percent",
                  "change_low", "change_high", "change_p", "detectable_percent", "verdict", "decided_after_bh_map",
                  "control_percent", "control_low", "control_high", "control_verdict", "iid_above_reference_percent",
                  "iid_low", "iid_high"]


def setting_dir(out_dir: Path, setting: dict[str, Any]) -> Path:
    """Where a setting's main-job report lands: ``settings/<slug>/``."""
    return Path(out_dir) / "settings" / setting["slug"]


def mechanism_table(config: dict[str, Any], out_dir: Path) -> pd.DataFrame:
    """One row per setting × task × algorithm (global models), from each setting's report files
    (:data:`REPORT_COLUMNS`); ``decided_after_bh_map``: Benjamini–Hochberg over every row of the map."""
    rows = []
    for setting in config["settings"]:
        rows += setting_rows(setting, setting_dir(out_dir, setting))
    table = pd.DataFrame(rows, columns=REPORT_COLUMNS)
    table["decided_after_bh_map"] = decided_after_bh(table)
    return table


def setting_rows(setting: dict[str, Any], folder: Path) -> list[dict[str, Any]]:
    """A setting's global-model rows of report_paper.csv, with its control and iid reference beside each."""
    paper = read_csv(folder / "report_paper.csv", "the setting's answer table")
    paper = paper[paper["model"] == "global"]
    control = _indexed(folder / "report_control.csv", "the setting's positive control")
    iid = _indexed(folder / "report_iid.csv", "the setting's iid reference")
    rows = []
    for row in paper.itertuples(index=False):
        key = (row.task, row.algorithm)
        claim = PAPER_CLAIMS.get(row.task)
        control_row = control.get(key, {})
        iid_row = iid.get(key, {})
        rows.append({
            "knob": setting["knob"], "level": setting["level"], "setting": setting["slug"], "task": row.task,
            "algorithm": row.algorithm, "role": row.role, "paper_percent": np.nan if claim is None or claim.size_percent is None
            else claim.size_percent, "n_seeds": row.n_seeds, "change_percent": row.change_percent,
            "change_low": row.change_low, "change_high": row.change_high, "change_p": row.change_p,
            "detectable_percent": row.detectable_percent, "verdict": row.verdict, "decided_after_bh_map": False,
            "control_percent": control_row.get("change_percent", np.nan), "control_low": control_row.get("change_low", np.nan),
            "control_high": control_row.get("change_high", np.nan), "control_verdict": control_row.get("verdict", "not run"),
            "iid_above_reference_percent": iid_row.get("above_centralized_percent", np.nan),
            "iid_low": iid_row.get("above_ci_low", np.nan), "iid_high": iid_row.get("above_ci_high", np.nan)})
    return rows


LOSS_COLUMNS = ["knob", "level", "setting", "task", "algorithm", "alpha", "n_seeds", "label_loss_mean", "label_loss_std",
                "embedding_loss_mean", "embedding_loss_std", "centralized_loss", "trivial_zero_loss",
                "trivial_constant_loss"]


def loss_table(config: dict[str, Any], out_dir: Path) -> pd.DataFrame:
    """The final global test loss of each grouping at every setting × task × algorithm × α (each setting's
    report.csv: mean and standard deviation over seeds), beside the centralized reference and the trivial
    predictors: what the changes of the map are changes of."""
    frames = []
    for setting in config["settings"]:
        frame = read_csv(setting_dir(out_dir, setting) / "report.csv", "the setting's per-α table")
        frame = frame.assign(knob=setting["knob"], level=setting["level"], setting=setting["slug"])
        frames.append(frame[LOSS_COLUMNS])
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=LOSS_COLUMNS)


def _indexed(path: Path, what: str) -> dict[tuple[str, str], dict[str, Any]]:
    """(task, algorithm) -> the global-model row of a report file; empty when the setting did not write it."""
    if not path.is_file():
        return {}
    frame = read_csv(path, what)
    if "model" in frame.columns:
        frame = frame[frame["model"] == "global"]
    return {(row["task"], row["algorithm"]): row for row in frame.to_dict("records")}


def decided_after_bh(table: pd.DataFrame) -> list[bool]:
    """Which rows' changes stay decided (interval off 0) after Benjamini–Hochberg over the whole map."""
    if table.empty:
        return []
    from scipy import stats  # slow to import; only the report needs it

    p_values = table["change_p"].fillna(1.0).clip(0.0, 1.0).to_numpy(dtype=float)
    adjusted = stats.false_discovery_control(p_values, method="bh")
    decided = (table["change_low"] > 0) | (table["change_high"] < 0)
    return [bool(is_decided and value <= 1 - LEVEL) for is_decided, value in zip(decided, adjusted)]


def learned(table: pd.DataFrame) -> pd.Series:
    """Which rows' task learned at their setting (the main job's role says "did not learn: ..." otherwise)."""
    return ~table["role"].astype(str).str.startswith(DID_NOT_LEARN)


def setting_name(row) -> str:
    return "the base" if row.knob == BASE_SETTING else f"{row.knob} = {row.level}"


def conclusion(table: pd.DataFrame) -> str:
    """The study's answer in one sentence: under which knob levels the penalty appears (decided above 0, still
    decided after Benjamini–Hochberg over the map, on a task that learned there), or that it appears under none;
    the settings whose task did not learn are named as saying nothing."""
    appears = table[table["verdict"].isin(APPEARS) & table["decided_after_bh_map"] & learned(table)]
    silent = list(dict.fromkeys(f"{setting_name(row)} ({row.task} did not learn)"
                                for row in table[~learned(table)].itertuples(index=False)))
    aside = f"; {', '.join(silent)}: {'that setting says' if len(silent) == 1 else 'those settings say'} nothing" if silent else ""
    moved = table[table["knob"] != BASE_SETTING]
    knobs = list(dict.fromkeys(moved["knob"]))
    if appears.empty:
        return (f"On this data the embedding-based penalty appears under none of these settings (the base and "
                f"{len(knobs)} knob(s) moved alone: {', '.join(knobs)}): no change is decided above 0 after "
                f"Benjamini–Hochberg over the map{aside}.")
    parts = [f"{setting_name(row)} ({row.task}, {row.algorithm}: {row.change_percent:+.1f}% "
             f"[{row.change_low:+.1f}%, {row.change_high:+.1f}%])" for row in appears.itertuples(index=False)]
    return (f"On this data the embedding-based penalty appears when {'; '.join(parts)}; under the other settings it "
            f"does not{aside}.")


def control_sentence(table: pd.DataFrame) -> str:
    """Where the positive control was detected: the settings that could show a penalty of its size at all."""
    detected = table[table["control_verdict"].astype(str).str.startswith("detected")]
    ran = table[table["control_verdict"] != "not run"]
    if ran.empty:
        return "No setting ran the positive control (partition.groupings without property_based)."
    if detected.empty:
        return (f"The positive control was detected in none of its {len(ran)} rows: no setting here shows that it "
                "could detect a partition penalty of the control's size.")
    settings = list(dict.fromkeys(setting_name(row) for row in detected.itertuples(index=False)))
    return f"The positive control was detected in {len(detected)} of its {len(ran)} rows: {', '.join(settings)}."


def write_report(config: dict[str, Any], out_dir: Path, table: pd.DataFrame, command: str) -> None:
    """report.csv, mechanism.png and report.md."""
    out_dir = Path(out_dir)
    atomic_write_text(out_dir / "report.csv", table.to_csv(index=False))
    plot_map(table, out_dir / "mechanism.png")
    losses = loss_table(config, out_dir)
    atomic_write_text(out_dir / "report_losses.csv", losses.to_csv(index=False))
    plot_losses(losses, out_dir / "losses.png")
    lines = [
        f"# When does the embedding-based penalty appear? ({config['name']})",
        "",
        fingerprint_line(config),
        "",
        f"Command: `{command}`",
        "",
        "## The conclusion",
        "",
        conclusion(table),
        "",
        control_sentence(table),
        "",
        "## The map",
        "",
        f"Each knob moves alone from the base toward the paper's setting ({PAPER}); every setting is a main job "
        "(its whole report in `settings/<setting>/report.md`). *Change*: the embedding-based federated loss against the "
        "label-based one at the same α, with its 95% interval over seeds, pooled over the setting's α values; every "
        "seed redraws the centralized model, the clusters, the partition and the federated run. *Detectable*: the "
        "smallest change the seeds detect with 80% power. *After BH*: still decided after Benjamini–Hochberg over "
        "every row of this map. *Control*: the property-based partition against the label-based one. *iid above "
        "reference*: how far the iid federation ends above the trained centralized reference. A task that did not "
        "beat the better trivial predictor at a setting (the main job's rule) is marked and says nothing there.",
        "",
        "![the change per knob level](mechanism.png)",
        "",
        map_markdown(table),
        "",
        "## The losses",
        "",
        "The final global test loss of each grouping at every setting (mean ± standard deviation over seeds), beside "
        "the trivial predictors (all zeros; the training targets' mean) and the centralized reference: the changes "
        "above compare these means.",
        "",
        "![the losses per setting](losses.png)",
        "",
        losses_markdown(losses),
        "",
        "The knobs (overrides of the base):",
        "",
        *[f"- **{knob['name']}**: base {knob['base_level']}; "
          + "; ".join(f"{level['label']}: `{' '.join(level['set'])}`" for level in knob["levels"])
          for knob in config["knobs"]],
        "",
        "Files: report.csv (the map), report_losses.csv (the losses), mechanism.png, losses.png, settings/<setting>/ "
        "(each setting's main-job report), config.json, run.log.",
        "",
    ]
    atomic_write_text(out_dir / "report.md", "\n".join(lines))


def map_markdown(table: pd.DataFrame) -> str:
    def interval(mean: float, low: float, high: float) -> str:
        return "—" if pd.isna(mean) else f"{mean:+.1f}% [{low:+.1f}%, {high:+.1f}%]"

    rows = ["| knob | level | task | algorithm | change | detectable | verdict | after BH | control | iid above reference |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for row in table.itertuples(index=False):
        task = row.task if not str(row.role).startswith(DID_NOT_LEARN) else f"{row.task} (did not learn)"
        rows.append(f"| {row.knob} | {row.level} | {task} | {row.algorithm} | "
                    f"{interval(row.change_percent, row.change_low, row.change_high)} | "
                    f"{'—' if pd.isna(row.detectable_percent) else f'≥ {row.detectable_percent:.1f}%'} | {row.verdict} | "
                    f"{'yes' if row.decided_after_bh_map else 'no'} | "
                    f"{interval(row.control_percent, row.control_low, row.control_high)} | "
                    f"{interval(row.iid_above_reference_percent, row.iid_low, row.iid_high)} |")
    return "\n".join(rows)


def plot_map(table: pd.DataFrame, path: Path) -> None:
    """One panel per algorithm × task: the change (and the control's) with its 95% interval at every setting, the
    paper's size as a dashed line and 0 as a grey one."""
    panels = list(dict.fromkeys(zip(table["algorithm"], table["task"])))
    settings = list(dict.fromkeys(zip(table["knob"], table["level"])))
    figure, axes = plt.subplots(len(panels), 1, figsize=(max(6.0, 1.1 * len(settings) + 2), 3.2 * len(panels)),
                                squeeze=False, layout="constrained")
    handles, labels = [], []
    for axis, (algorithm, task) in zip(axes[:, 0], panels):
        rows = table[(table["algorithm"] == algorithm) & (table["task"] == task)]
        silent = set(zip(rows.loc[~learned(rows), "knob"], rows.loc[~learned(rows), "level"]))  # this task's own
        names = [("base" if knob == BASE_SETTING else f"{knob}\n= {level}")
                 + ("\n(did not learn)" if (knob, level) in silent else "") for knob, level in settings]
        for offset, (column, low, high, label, style) in enumerate((
                ("change_percent", "change_low", "change_high", "embedding- vs label-based", "o"),
                ("control_percent", "control_low", "control_high", "control: property- vs label-based", "s"))):
            where = [settings.index((row.knob, row.level)) + (offset - 0.5) * 0.2 for row in rows.itertuples(index=False)]
            values = rows[column].to_numpy(dtype=float)
            errors = np.vstack([values - rows[low].to_numpy(dtype=float), rows[high].to_numpy(dtype=float) - values])
            drawn = axis.errorbar(where, values, yerr=np.abs(errors), fmt=style, capsize=3, label=label)
            if label not in labels:
                handles.append(drawn)
                labels.append(label)
        for size in sorted(set(rows["paper_percent"].dropna())):
            line = axis.axhline(size, color="tab:red", linestyle="--", linewidth=1)
            if "the paper's size" not in labels:
                handles.append(line)
                labels.append("the paper's size")
        axis.axhline(0, color="grey", linewidth=0.8)
        axis.set_xticks(range(len(settings)), names, fontsize=8)
        axis.set_ylabel("loss change (%)")
        axis.set_title(f"{algorithm}: {task}")
    legend_outside(figure, handles, labels, where="lower")
    save_figure(figure, path)


def losses_markdown(losses: pd.DataFrame) -> str:
    rows = ["| knob | level | task | algorithm | α | label-based | embedding-based | trivial: zeros | trivial: mean | "
            "centralized |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in losses.itertuples(index=False):
        rows.append(f"| {row.knob} | {row.level} | {row.task} | {row.algorithm} | {row.alpha:g} | "
                    f"{row.label_loss_mean:.4g} ± {row.label_loss_std:.2g} | "
                    f"{row.embedding_loss_mean:.4g} ± {row.embedding_loss_std:.2g} | {row.trivial_zero_loss:.4g} | "
                    f"{row.trivial_constant_loss:.4g} | {row.centralized_loss:.4g} |")
    return "\n".join(rows)


def plot_losses(losses: pd.DataFrame, path: Path) -> None:
    """One panel per task × algorithm: each grouping's final loss (mean ± standard deviation over seeds) at every
    setting and α, with the trivial predictors and the centralized reference as horizontal lines."""
    panels = list(dict.fromkeys(zip(losses["task"], losses["algorithm"])))
    settings = list(dict.fromkeys(zip(losses["knob"], losses["level"])))
    names = ["base" if knob == BASE_SETTING else f"{knob}\n= {level}" for knob, level in settings]
    figure, axes = plt.subplots(len(panels), 1, figsize=(max(6.0, 1.1 * len(settings) + 2), 3.2 * len(panels)),
                                squeeze=False, layout="constrained")
    handles: dict[str, Any] = {}
    for axis, (task, algorithm) in zip(axes[:, 0], panels):
        rows = losses[(losses["task"] == task) & (losses["algorithm"] == algorithm)]
        alphas = list(dict.fromkeys(rows["alpha"]))
        for index, alpha in enumerate(alphas):
            at = rows[rows["alpha"] == alpha]
            where = np.array([settings.index((row.knob, row.level)) for row in at.itertuples(index=False)], dtype=float)
            for offset, (grouping, marker) in enumerate((("label", "o"), ("embedding", "s"))):
                label = f"{grouping}-based" + (f", α = {alpha:g}" if len(alphas) > 1 else "")
                shift = (offset - 0.5) * 0.2 + (index - (len(alphas) - 1) / 2) * 0.45
                handles[label] = axis.errorbar(where + shift, at[f"{grouping}_loss_mean"], yerr=at[f"{grouping}_loss_std"],
                                               fmt=marker, capsize=3, label=label)
        for column, label, style in (("trivial_zero_loss", "trivial: all zeros", ":"),
                                     ("trivial_constant_loss", "trivial: the targets' mean", "--"),
                                     ("centralized_loss", "centralized reference", "-.")):
            value = rows[column].dropna()
            if not value.empty:
                handles[label] = axis.axhline(float(value.mean()), color="grey", linestyle=style, linewidth=1, label=label)
        axis.set_xticks(range(len(settings)), names, fontsize=8)
        axis.set_ylabel("final test loss")
        axis.set_title(f"{task}, {algorithm}")
    legend_outside(figure, list(handles.values()), list(handles), where="lower")
    save_figure(figure, path)
