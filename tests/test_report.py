import numpy as np
import pandas as pd

from pipeline.report import REPORT_COLUMNS, gap_table, personal_gap_table, summary_sentences, write_report


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


def test_summary_follows_the_sign_of_the_numbers():
    hurts = summary_sentences(gap_table(_finals(1.5), {}), {"depth_euclidean": {"nmi": 0.3, "ari": 0.1}})
    helps = summary_sentences(gap_table(_finals(0.8), {}), {})
    assert "hurts more" in hurts[0] and "+50.0%" in hurts[0] and "NMI = 0.30" in hurts[0]
    assert "does not hurt more" in helps[0] and "does not hold" in helps[-1]
    assert "holds" in hurts[-1] and "does not hold" not in hurts[-1]


def test_a_gap_counts_only_beyond_the_seed_spread():
    # Each side's seed std is 0.141, so a gap must exceed 0.283 in loss to count.
    assert gap_table(_finals(1.5), {}).gap_exceeds_seed_std.item()
    within = gap_table(_finals(1.2), {"depth_euclidean": 0.8})
    assert not within.gap_exceeds_seed_std.item()
    sentences = summary_sentences(within, {})
    assert "0 of 1 gaps beyond the seed spread" in sentences[0] and "centralized loss: median +25%" in sentences[0]
    single_seed = gap_table(_finals(1.5).query("seed == 0"), {})
    assert not single_seed.gap_exceeds_seed_std.item()


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
    for name in ("report.md", "report.csv", "loss_vs_alpha.png", "round_curves.png", "partition_heatmaps.png",
                 "cluster_label_agreement.png"):
        assert (out / name).stat().st_size > 0, name
    assert list(pd.read_csv(out / "report.csv").columns) == REPORT_COLUMNS
    assert "+20.0" in (out / "report.md").read_text()


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
