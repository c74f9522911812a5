import numpy as np
import pandas as pd
import pytest

from pipeline.studies.main_job.paper import PAPER_COLUMNS
from pipeline.studies.main_job.report import REPORT_COLUMNS, gap_table, personal_gap_table, summary_sentences, write_report


def _finals(embedding_loss: float) -> pd.DataFrame:
    rows = []
    for seed, noise in ((0, -0.1), (1, 0.1)):
        for grouping, loss in (("label_based", 1.0), ("embedding_based", embedding_loss)):
            rows.append(dict(task="depth_euclidean", grouping=grouping, alpha=0.1, algorithm="fedavg", seed=seed,
                             loss=loss + noise, metric="abs_rel", metric_value=0.5 + noise))
    return pd.DataFrame(rows)


def test_gap_is_relative_difference_of_seed_means():
    table = gap_table(_finals(1.5), {"depth_euclidean": 0.7})
    assert list(table.columns) == REPORT_COLUMNS
    row = table.iloc[0]
    assert np.isclose(row.label_loss_mean, 1.0) and np.isclose(row.embedding_loss_mean, 1.5)
    assert np.isclose(row.gap_percent, 50.0)
    assert np.isclose(row.label_loss_std, np.std([0.9, 1.1], ddof=1))
    assert row.n_seeds == 2 and row.centralized_loss == 0.7


def test_two_seeds_give_no_verdict_and_no_direction():
    # The first use's case: two seeds, embedding-based 50% worse on both. Too few seeds to decide anything.
    table = gap_table(_finals(1.5), {})
    assert table.verdict.item() == "undecided: 2 paired seeds, 3 needed" and table.reason.item() == "too few seeds"
    sentences = summary_sentences(table, {"depth_euclidean": {"nmi": 0.3, "ari": 0.1}})
    assert "no clear direction" in sentences[0] and "+50.0%" in sentences[0] and "NMI = 0.30" in sentences[0]
    assert "decided in 0 of 1 cells" in sentences[0] and "1 with too few seeds" in sentences[0]
    assert "is neither supported nor contradicted" in sentences[-1]


def test_the_summary_follows_decided_cells_only():
    hurts = summary_sentences(gap_table(_three_seeds([1.0, 2.0, 3.0], [1.2, 2.4, 3.3]), {}), {})
    helps = summary_sentences(gap_table(_three_seeds([1.0, 2.0, 3.0], [0.8, 1.7, 2.8]), {}), {})
    assert "embedding-based heterogeneity hurts more" in hurts[0] and "claim (embedding-based partitions give a larger federated loss) holds" in hurts[-1]
    assert "label-based heterogeneity hurts more" in helps[0] and "is contradicted" in helps[-1]


def _three_seeds(label, embedding, algorithm="fedavg", alpha=0.1):
    return pd.DataFrame([dict(task="normal", grouping=grouping, alpha=alpha, algorithm=algorithm, seed=seed, loss=loss,
                              metric="mean_angle", metric_value=30.0)
                         for grouping, losses in (("label_based", label), ("embedding_based", embedding))
                         for seed, loss in enumerate(losses)])


def test_the_gap_is_a_paired_difference_with_a_95_percent_interval():
    row = gap_table(_three_seeds([1.0, 2.0, 3.0], [1.2, 2.4, 3.3]), {}).iloc[0]
    # d = (0.2, 0.4, 0.3): mean 0.3, s = 0.1, t(0.975, 2) = 4.3027: half-width 0.24841
    assert np.isclose(row.diff_mean, 0.3) and np.isclose(row.diff_ci_low, 0.05159, atol=1e-5)
    assert np.isclose(row.diff_ci_high, 0.54841, atol=1e-5) and np.isclose(row.gap_percent, 15.0)
    assert row.verdict == "embedding worse" and row.n_seeds == 3
    undecided = gap_table(_three_seeds([1.0, 2.0, 3.0], [1.1, 1.9, 3.05]), {}).iloc[0]
    assert undecided.reason == "interval contains 0" and undecided.diff_ci_low < 0 < undecided.diff_ci_high
    only_one_side = _three_seeds([1.0, 2.0, 3.0], [1.2, 2.4, 3.3]).query("not (grouping == 'embedding_based' and seed == 2)")
    assert gap_table(only_one_side, {}).iloc[0].n_seeds == 2  # pairs only where both sides ran


def test_summary_counts_only_decided_cells_and_prints_the_counts():
    finals = pd.concat([_three_seeds([1.0, 2.0, 3.0], [1.2, 2.4, 3.3], "fedavg"),
                        _three_seeds([1.0, 2.0, 3.0], [1.1, 1.9, 3.05], "fedprox"),
                        _three_seeds([1.0, 2.0, 3.0], [0.8, 1.7, 2.8], "scaffold")])
    table = gap_table(finals, {})
    assert list(table.verdict) == ["embedding worse", "undecided: the 95% interval contains 0", "label worse"]
    sentences = summary_sentences(table, {})
    # 2 of 3 decided, but split 1:1: no direction
    assert "no clear direction" in sentences[0] and "decided in 2 of 3 cells (embedding worse 1, label worse 1" in sentences[0]
    assert "1 whose interval contains 0" in sentences[0] and "is neither supported nor contradicted" in sentences[-1]


def test_zero_variance_is_undecided_in_the_report():
    # +1/360 on every seed: the first use's "+0.003 [+0.003, +0.003] noticeable".
    row = gap_table(_three_seeds([0.9, 0.8, 0.7], [0.9 + 1 / 360, 0.8 + 1 / 360, 0.7 + 1 / 360]), {}).iloc[0]
    assert row.reason == "zero variance" and row.verdict.startswith("undecided: zero variance")
    assert np.isnan(row.diff_ci_low) and not row.decided_after_bh


def test_one_decided_cell_of_eight_claims_no_direction_and_bh_is_counted_beside():
    cells = [_three_seeds([1.0, 2.0, 3.0], [1.2, 2.4, 3.3], "fedavg")]
    cells += [_three_seeds([1.0, 2.0, 3.0], [1.1, 1.9, 3.05], "fedprox", alpha) for alpha in (0.1, 0.5, 1.0, 10.0)]
    cells += [_three_seeds([1.0, 2.0], [1.3, 2.6], "scaffold", alpha) for alpha in (0.1, 0.5, 1.0)]
    table = gap_table(pd.concat(cells), {})
    assert len(table) == 8 and (table.verdict == "embedding worse").sum() == 1
    # BH over 8 cells: fedavg's p = 0.0351 > 0.05/8 · 1 (and every other p is 1 or large): not decided after it.
    assert not table.decided_after_bh.any()
    sentences = summary_sentences(table, {})
    assert "no clear direction" in sentences[0]
    assert ("decided in 1 of 8 cells (embedding worse 1, label worse 0; after Benjamini–Hochberg over the report's 8: "
            "embedding worse 0, label worse 0); undecided 7 (3 with too few seeds, 0 with zero variance, 4 whose interval "
            "contains 0)") in sentences[0]
    assert "is neither supported nor contradicted" in sentences[-1]


def test_iid_loss_intervals_never_go_below_zero():
    from pipeline.studies.main_job.iid import iid_table

    iid = pd.DataFrame([dict(task="normal", grouping="iid", alpha=float("inf"), algorithm="fedavg", seed=seed, loss=loss,
                             metric="mean_angle", metric_value=30.0) for seed, loss in enumerate((0.05, 0.4, 0.1))])
    row = iid_table(iid, {"normal": 0.1}).iloc[0]
    assert 0 < row.iid_loss_ci_low < row.iid_loss_mean < row.iid_loss_ci_high


def test_the_iid_reference_is_compared_with_the_centralized_loss():
    from pipeline.studies.main_job.iid import iid_table

    iid = pd.DataFrame([dict(task="normal", grouping="iid", alpha=float("inf"), algorithm=algorithm, seed=seed,
                             loss=loss, metric="mean_angle", metric_value=30.0)
                        for algorithm, losses in (("fedavg", (1.04, 1.06)), ("fedrep", (1.3, 1.5)))
                        for seed, loss in enumerate(losses)])
    table = iid_table(iid, {"normal": 1.0}).set_index("algorithm")
    assert np.isclose(table.loc["fedavg", "above_centralized_percent"], 5.0) and table.loc["fedavg", "within_10_percent"]
    assert np.isclose(table.loc["fedrep", "above_centralized_percent"], 40.0) and not table.loc["fedrep", "within_10_percent"]
    sentences = summary_sentences(gap_table(_three_seeds([1.0, 2.0, 3.0], [1.2, 2.4, 3.3]), {}), {},
                                  iid_table(iid, {"normal": 1.0}))
    assert "NOT within 10% for fedrep (+40%)" in sentences[0]


def test_the_heterogeneity_meter_table_and_its_link_to_the_gap():
    from pipeline.studies.main_job.meter import gap_correlation, meter_sentence, meter_table

    meters = pd.DataFrame([dict(task="normal", grouping=grouping, alpha=alpha, seed=seed, g2=g2 * (1 + 0.1 * seed), b2=1.5)
                           for alpha, label_g2, embedding_g2 in ((0.1, 2.0, 4.0), (1.0, 1.0, 1.5), (10.0, 0.5, 0.4))
                           for grouping, g2 in (("label_based", label_g2), ("embedding_based", embedding_g2))
                           for seed in (0, 1)])
    table = meter_table(meters)
    assert list(table.alpha) == [0.1, 1.0, 10.0] and np.allclose(table.g2_ratio, [2.0, 1.5, 0.8])
    assert np.isclose(table.label_g2.iloc[0], 2.1)  # mean of 2.0 and 2.2
    gaps = pd.DataFrame({"task": "normal", "alpha": [0.1, 1.0, 10.0, 0.1], "algorithm": ["a", "a", "a", "b"],
                         "gap_percent": [9.0, 3.0, -2.0, 7.0]})
    rho, _, n = gap_correlation(table, gaps)
    # ranks of the ratios (3.5, 2, 1, 3.5) and of the gaps (4, 2, 1, 3): ρ = 4.5 / √(4.5 · 5) = 3/√10
    assert n == 4 and np.isclose(rho, 3 / np.sqrt(10))
    assert "larger gradient dissimilarity G² in 2 of 3" in meter_sentence(table, gaps)


def test_write_report_produces_every_file(tmp_path):
    import matplotlib.pyplot as plt

    finals = _finals(1.2)
    curves = finals.assign(round=3)
    heatmap = tmp_path / "heatmap.png"
    plt.imsave(heatmap, np.eye(4))
    heatmaps = {("depth_euclidean", "label_based", 0.1): heatmap, ("depth_euclidean", "embedding_based", 0.1): heatmap}
    out = tmp_path / "report"
    write_report(out, finals, curves, {"depth_euclidean": 0.5}, {"depth_euclidean": {"nmi": 0.2, "ari": 0.1}},
                 heatmaps, "python run_pipeline.py x.yaml")
    for name in ("report.md", "report.csv", "loss_vs_alpha.png", "partition_heatmaps.png",
                 "cluster_label_agreement.png"):
        assert (out / name).stat().st_size > 0, name
    assert list(pd.read_csv(out / "report.csv").columns) == REPORT_COLUMNS
    assert list(pd.read_csv(out / "report_paper.csv").columns) == PAPER_COLUMNS
    text = (out / "report.md").read_text()
    assert "+20.0" in text
    # One evaluated round (3): no curve to draw, and the report says so instead of linking a missing figure.
    assert not (out / "round_curves.png").exists() and "round_curves.png" not in text
    assert "No round curves for depth_euclidean (evaluated at round 3 only): " in text


def test_personal_models_get_their_own_gap_table(tmp_path):
    import matplotlib.pyplot as plt

    fedavg = _finals(1.2).assign(personal_loss=np.nan)
    fedrep = _finals(1.2).assign(algorithm="fedrep")
    fedrep["personal_loss"] = np.where(fedrep.grouping == "label_based", 0.5, 0.6)
    table = personal_gap_table(pd.concat([fedavg, fedrep]))
    assert list(table.algorithm) == ["fedrep"]
    assert np.isclose(table.gap_percent.item(), 20.0) and table.label_loss_std.item() == 0.0
    assert personal_gap_table(fedavg).empty
    plt.imsave(tmp_path / "heatmap.png", np.eye(4))
    out = tmp_path / "report"
    write_report(out, pd.concat([fedavg, fedrep]), fedavg.assign(round=1), {}, {"depth_euclidean": {"nmi": 0.2, "ari": 0.1}},
                 {("depth_euclidean", "label_based", 0.1): tmp_path / "heatmap.png"}, "cmd")
    assert "## Personalised models" in (out / "report.md").read_text()
    assert len(pd.read_csv(out / "report_personal.csv")) == 1


def _fedavg_and_fedrep() -> pd.DataFrame:
    """FedAvg read from its global model; FedRep's global loss 50 (an untrained head) beside its clients' own models."""
    fedavg = _three_seeds([1.0, 2.0, 3.0], [1.2, 2.4, 3.3]).assign(personal_loss=np.nan, result_is_personal=False)
    fedrep = _three_seeds([50.0] * 3, [50.0] * 3, algorithm="fedrep").assign(result_is_personal=True)
    fedrep["personal_loss"] = [0.5, 0.6, 0.7, 0.6, 0.8, 0.9]  # label 0.5, 0.6, 0.7; embedding 0.6, 0.8, 0.9
    fedrep["personal_metric_value"] = 20.0
    return pd.concat([fedavg, fedrep], ignore_index=True)


def test_fedrep_enters_the_table_the_counts_and_the_plots_through_its_personal_models(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from pipeline.studies.main_job import plots as report_plots

    drawn = {}
    monkeypatch.setattr(report_plots, "save_figure", lambda figure, path, dpi: drawn.setdefault(path.name, figure))
    finals = _fedavg_and_fedrep()
    curves = pd.concat([finals.assign(round=r, loss=np.where(finals.result_is_personal, finals.personal_loss, finals.loss),
                                      model=np.where(finals.result_is_personal, "personal", "global")) for r in (1, 2, 3)])
    plt.imsave(tmp_path / "heatmap.png", np.eye(4))
    out = tmp_path / "report"
    table = write_report(out, finals, curves, {"normal": 1.0}, {"normal": {"nmi": 0.2, "ari": 0.1}},
                         {("normal", "label_based", 0.1): tmp_path / "heatmap.png"}, "cmd").set_index("algorithm")
    # FedRep's row is its personal losses: label mean 0.6, embedding 0.7667; d = (0.1, 0.2, 0.2): mean 0.16667,
    # s = 0.057735, half-width 4.302653·0.057735/√3 = 0.143422 -> [0.023245, 0.310089]: decided, embedding worse.
    assert np.isclose(table.loc["fedrep", "label_loss_mean"], 0.6)
    assert np.isclose(table.loc["fedrep", "embedding_loss_mean"], 0.8 - 0.1 / 3)
    assert np.isclose(table.loc["fedrep", "diff_ci_low"], 0.023245, atol=1e-6)
    assert table.loc["fedrep", "verdict"] == "embedding worse"
    assert np.isclose(table.loc["fedrep", "label_metric_mean"], 20.0)  # its personal metric, not the global one
    text = (out / "report.md").read_text()
    # Both cells decided, both embedding worse: the summary counts FedRep's personal cell.
    assert "decided in 2 of 2 cells (embedding worse 2, label worse 0" in text
    # The paper table: normal has no size from the paper, so both rows decided above 0 are consistent with it
    # (FedAvg's seed changes +20%, +20%, +10%: [+2.3%, +31.0%]; FedRep's +20%, +33.3%, +28.6%), and stay decided
    # after Benjamini–Hochberg over the 2 rows.
    answer = pd.read_csv(out / "report_paper.csv").set_index("algorithm")
    assert list(answer.verdict) == list(answer.verdict_after_bh) == ["consistent with the paper"] * 2
    assert ("Global models, 1 row: 1 consistent with the paper, 0 smaller than the paper's, 0 no effect of the "
            "paper's size, 0 undecided, 0 opposite; after Benjamini–Hochberg over the table's 2 rows: 1, 0, 0, 0, 0. "
            "Clients' own models (FedRep), 1 row: 1 consistent with the paper,") in text
    assert "except fedrep: the global head is never trained" in text and "| normal | fedrep‡ | 0.1 |" in text
    # The loss-vs-α panel of FedRep is drawn from its personal losses, and its axis says so.
    panels = {axis.get_title(): axis for axis in drawn["loss_vs_alpha.png"].axes}
    fedrep_axis = panels["normal · fedrep"]
    assert fedrep_axis.get_ylabel() == "final test loss, clients' own models\n(task loss, no unit)"
    assert max(line.get_ydata().max() for line in fedrep_axis.get_lines()) < 1.0  # never the untrained head's 50
    assert panels["normal · fedavg"].get_ylabel() == "final global test loss\n(task loss, no unit)"
    # The round curves share one axis per α: the global loss of 50 must not be on it.
    curve_axis = drawn["round_curves.png"].axes[0]
    assert max(line.get_ydata().max() for line in curve_axis.get_lines()) < 4.0
    legend = [text.get_text() for text in drawn["round_curves.png"].legends[0].get_texts()]
    assert "fedrep (clients' own models)" in legend and "fedavg" in legend


def test_the_selection_note_names_a_last_epoch_reference_and_never_a_test_selection():
    from pipeline.studies.main_job.report import selection_note

    assert "epoch its **validation** rows chose" in selection_note({"normal": "val"})
    note = selection_note({"normal": "val", "edge_texture": "last"})
    assert "except for edge_texture: its **last epoch**" in note and "--last_epoch" in note
    assert "test split" not in note


def _curves(task: str, rounds: list[int]) -> pd.DataFrame:
    """Two seeds of fedavg under both groupings at α 0.1, evaluated at ``rounds``: loss 1 / (round + 1) + seed / 10."""
    return pd.DataFrame([dict(task=task, grouping=grouping, alpha=0.1, algorithm="fedavg", seed=seed, round=r,
                              loss=1 / (r + 1) + seed / 10, model="global")
                         for grouping in ("label_based", "embedding_based") for seed in (0, 1) for r in rounds])


def test_round_curves_need_three_evaluated_rounds_and_say_how_many_they_have(tmp_path, monkeypatch):
    """The demo evaluates edges at rounds 0 and 22 only: two points a line, not a curve. A task with 3 evaluated
    rounds is drawn, a marker per round; one with 2 is left out, by name, with its rounds."""
    from pipeline.studies.main_job import plots as report_plots
    from pipeline.studies.main_job.report import round_curves

    drawn = {}
    monkeypatch.setattr(report_plots, "save_figure", lambda figure, path, dpi: drawn.setdefault(path.name, figure))
    curves = pd.concat([_curves("normal", [0, 11, 22]), _curves("keypoints2d", [0, 5])])
    lines = round_curves(curves, tmp_path / "round_curves.png")
    assert lines == [
        "![round curves](round_curves.png)", "",
        "*Round curves*: the mean over seeds at each evaluated round, a marker each: normal 3 rounds (0 to 22).", "",
        "No round curves for keypoints2d (evaluated at rounds 0 and 5 only): a line through fewer than 3 evaluated "
        "rounds is not a curve; a lower `federated.eval_every` draws them (each evaluation is a pass over the test "
        "split)."]
    (axis,) = drawn["round_curves.png"].axes  # one task (normal) × one α: keypoints2d has no row
    assert axis.get_title() == "normal, α=0.1"
    for line in axis.get_lines():  # label-based and embedding-based fedavg, each the mean of seeds 0 and 1
        assert line.get_marker() == "o" and list(line.get_xdata()) == [0, 11, 22]
        assert np.allclose(line.get_ydata(), [1 + 0.05, 1 / 12 + 0.05, 1 / 23 + 0.05])
    assert len(axis.get_lines()) == 2


def test_round_curves_of_two_rounds_draw_nothing_and_remove_an_earlier_figure(tmp_path):
    from pipeline.studies.main_job.report import round_curves

    path = tmp_path / "round_curves.png"
    path.write_bytes(b"an earlier report's figure")
    lines = round_curves(pd.concat([_curves("edge_texture", [0, 22]), _curves("keypoints2d", [5])]), path)
    assert not path.exists()
    assert lines == ["No round curves for edge_texture (evaluated at rounds 0 and 22 only), keypoints2d (evaluated at "
                     "round 5 only): a line through fewer than 3 evaluated rounds is not a curve; a lower "
                     "`federated.eval_every` draws them (each evaluation is a pass over the test split)."]
    assert round_curves(pd.DataFrame(), path) == [] and not path.exists()  # no runs: nothing to say


# ----- the verdict rules at their edges -----
def test_one_seed_is_undecided_and_its_row_says_there_is_no_interval():
    from pipeline.studies.main_job.report import markdown_table

    table = gap_table(_three_seeds([1.0], [1.5]), {})
    row = table.iloc[0]
    assert (row.verdict, row.reason, row.n_seeds) == ("undecided: 1 paired seed, 3 needed", "too few seeds", 1)
    assert row.diff_mean == 0.5 and np.isnan(row.diff_ci_low) and np.isnan(row.p_value)
    assert "| +0.5000 [no interval] | undecided: 1 paired seed, 3 needed |" in markdown_table(table)


def test_equal_differences_on_every_seed_are_zero_variance_and_no_pair_is_no_verdict():
    tied = gap_table(_three_seeds([1.0, 2.0, 3.0], [1.5, 2.5, 3.5]), {}).iloc[0]  # +0.5 on every seed
    assert (tied.verdict, tied.reason) == ("undecided: zero variance (every seed gives +0.5)", "zero variance")
    assert np.isnan(tied.diff_ci_low) and not tied.decided_after_bh
    apart = _three_seeds([1.0, 2.0, 3.0], [1.5, 2.5, 3.5])
    apart = apart[(apart.grouping == "label_based") & (apart.seed < 2) | (apart.grouping == "embedding_based")
                  & (apart.seed == 2)]  # label-based seeds 0 and 1, embedding-based seed 2: no pair
    row = gap_table(apart, {}).iloc[0]
    assert (row.verdict, row.n_seeds) == ("undecided: no seed ran under both partitions", 0)


def _cells(verdicts: str) -> pd.DataFrame:
    """One task's gap table with a cell per letter: w embedding worse, b label worse (both decided), u undecided."""
    rows = {"w": ("embedding worse", "", 10.0), "b": ("label worse", "", -10.0),
            "u": ("undecided: the 95% interval contains 0", "interval contains 0", 1.0)}
    return pd.DataFrame([dict(task="normal", algorithm="fedavg", alpha=float(index + 1), verdict=rows[letter][0],
                              reason=rows[letter][1], gap_percent=rows[letter][2], decided_after_bh=False)
                         for index, letter in enumerate(verdicts)])


@pytest.mark.parametrize("verdicts, headline, overall", [
    ("wwuu", "embedding-based heterogeneity hurts more", "holds"),  # exactly half decided, all of them agree
    ("wuuu", "no clear direction", "is neither supported"),  # 1 of 4 decided: under half
    ("wwbu", "embedding-based heterogeneity hurts more", "holds"),  # 2 of 3 decided agree: exactly two thirds
    ("bbwu", "label-based heterogeneity hurts more", "is contradicted"),
    ("wwbb", "no clear direction", "is neither supported"),  # a tie: 2 against 2
    ("wb", "no clear direction", "is neither supported"),  # two cells, both decided, half each
])
def test_a_direction_needs_half_the_cells_decided_and_two_thirds_of_those_agreeing(verdicts, headline, overall):
    sentences = summary_sentences(_cells(verdicts), {})
    assert sentences[0].startswith(f"**normal**: {headline}: ")
    assert sentences[-1].startswith(f"Overall the paper's claim (embedding-based partitions give a larger federated "
                                    f"loss) {overall}")


def _heatmaps(tmp_path, tasks: list[str]) -> dict:
    import matplotlib.pyplot as plt

    plt.imsave(tmp_path / "heatmap.png", np.eye(4))
    return {(task, grouping, 0.1): tmp_path / "heatmap.png" for task in tasks for grouping in ("label_based", "embedding_based")}


def _learning_runs(task: str, label: list[float], embedding: list[float], iid: list[float]) -> pd.DataFrame:
    rows = [dict(task=task, grouping=grouping, alpha=alpha, algorithm="fedavg", seed=seed, loss=loss, metric="l1",
                 metric_value=loss)
            for grouping, alpha, losses in (("label_based", 0.1, label), ("embedding_based", 0.1, embedding),
                                            ("iid", np.inf, iid))  # the pipeline gives iid runs α = inf
            for seed, loss in enumerate(losses)]
    return pd.DataFrame(rows)


def test_trivial_predictors_are_in_report_csv_and_a_task_that_does_not_beat_them_leaves_the_headline(tmp_path):
    # edges: centralized 0.02 against all zeros 0.1 / median 0.08 (75% below the better): learned.
    # keypoints: centralized 0.0054 against zeros 0.005629 / median 0.005629: 4.07% below, short of the 5% margin.
    finals = pd.concat([_learning_runs("edge_texture", [1.0, 2.0, 3.0], [1.2, 2.4, 3.3], [0.021, 0.022, 0.020]),
                        _learning_runs("keypoints2d", [1.0, 2.0, 3.0], [1.2, 2.4, 3.3], [0.0050, 0.0051, 0.0052])])
    trivial = {"edge_texture": {"zero": 0.1, "median": 0.08}, "keypoints2d": {"zero": 0.005629, "median": 0.005629}}
    out = tmp_path / "report"
    write_report(out, finals, finals.assign(round=3), {"edge_texture": 0.02, "keypoints2d": 0.0054},
                 {"edge_texture": {"nmi": 0.2, "ari": 0.1}, "keypoints2d": {"nmi": 0.2, "ari": 0.1}},
                 _heatmaps(tmp_path, ["edge_texture", "keypoints2d"]), "python run_pipeline.py x.yaml", trivial=trivial)
    report = pd.read_csv(out / "report.csv").set_index("task")
    assert report.loc["edge_texture", "trivial_zero_loss"] == 0.1
    assert report.loc["edge_texture", "trivial_constant_loss"] == 0.08
    assert report.loc["keypoints2d", "trivial_zero_loss"] == report.loc["keypoints2d", "trivial_constant_loss"] == 0.005629
    answer = pd.read_csv(out / "report_paper.csv").set_index("task")
    assert answer.loc["edge_texture", "role"] == "headline"
    assert answer.loc["keypoints2d", "role"].startswith("did not learn: centralized 0.0054 (-4.1%) is not 5% below")
    text = (out / "report.md").read_text()
    assert "Global models, 1 row:" in text and "keypoints2d did not learn and is not counted" in text
    assert "| keypoints2d | 0.0054 | 0.005629 | training median 0.005629 | **no**: centralized 0.0054" in text
    assert "| edge_texture | 0.02 | 0.1 | training median 0.08 | yes |" in text
    assert "| keypoints2d (did not learn) | fedavg |" in text  # the reason once, in the trivial predictors' table


def test_a_run_without_trivial_rows_claims_nothing_about_learning(tmp_path):
    finals = _learning_runs("edge_texture", [1.0, 2.0, 3.0], [1.2, 2.4, 3.3], [0.5, 0.5, 0.5])
    out = tmp_path / "report"
    write_report(out, finals, finals.assign(round=3), {"edge_texture": 0.02}, {"edge_texture": {"nmi": 0.2, "ari": 0.1}},
                 _heatmaps(tmp_path, ["edge_texture"]), "c")
    assert pd.read_csv(out / "report.csv").trivial_zero_loss.isna().all()
    assert pd.read_csv(out / "report_paper.csv").role.item() == "headline"
    assert "| edge_texture | 0.02 | – | – | not measured |" in (out / "report.md").read_text()
